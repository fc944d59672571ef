"""The tick's stages S0–S5, the jobs, the world's clock and the tick's record, with persistence.

Every function here is ``stage(runtime, input) -> summary``: it loads its inputs by
reference from the store (keyed by cluster and tick), calls one koi stage, persists
the output in the same store and returns a small summary (:mod:`koi.pipeline.messages`).
The Temporal activities (``activities/``) and the in-process runner
(:mod:`koi.pipeline.runner`) both call these, so a durable tick and a benchmark tick
run the same code. S6 (deploy), the only stage with side effects, and keep-all
compensation are in :mod:`koi.pipeline.deploy`.

Idempotency: S0–S5 overwrite their outputs (upserts keyed by cluster, tick, stage),
so a retry writes the same rows again.
"""

from __future__ import annotations

import time
from collections import Counter
from typing import Any

from koi.domain import (
    ClusterSnapshot,
    Deployment,
    Job,
    JobState,
    JobStatus,
    Plan,
    carry_since,
)
from koi.logging import get_logger
from koi.pipeline.errors import InputError
from koi.pipeline.fencing import lock_cluster
from koi.pipeline.messages import (
    AdvanceInput,
    DeploymentRef,
    EnsureWorldInput,
    EvidenceSummary,
    FinishInput,
    FinishSummary,
    ObserveSummary,
    PlanSummary,
    SlowSummary,
    SnapshotSummary,
    StageRef,
    SyncJobsInput,
    SyncJobsSummary,
    TickOutcome,
    ValidationSummary,
    WorldSummary,
)
from koi.pipeline.runtime import ProposeContext, Runtime, Verdict
from koi.store import (
    Stage,
    digest,
    get_deployments,
    get_fence,
    get_job,
    get_jobs,
    get_plan,
    load_stage_model,
    load_stage_output,
    save_deployments,
    save_job_state,
    save_plan,
    save_stage_output,
    save_telemetry,
    save_tick,
    session_scope,
    set_job_status,
)

log = get_logger(__name__)

#: Extra stage names (beside :class:`koi.store.Stage`).
S0_RELEASED = "S0_released"
MAX_VIOLATIONS = 20


# ---- helpers ---------------------------------------------------------------------------------------------
def _snapshot(session: Any, ref: StageRef) -> ClusterSnapshot:
    snap = load_stage_model(session, ref.cluster_id, ref.tick, Stage.S0_SNAPSHOT, ClusterSnapshot)
    if snap is None:
        raise InputError(f"tick {ref.tick} of {ref.cluster_id!r} has no S0 snapshot; run s0_snapshot first")
    return snap


def _short(items: list[str]) -> list[str]:
    out = [s if len(s) <= 300 else s[:297] + "..." for s in items[:MAX_VIOLATIONS]]
    if len(items) > MAX_VIOLATIONS:
        out.append(f"... and {len(items) - MAX_VIOLATIONS} more")
    return out


def _digest_of(session: Any, cluster_id: str, tick: int, stage: str) -> str | None:
    row = load_stage_output(session, cluster_id, tick, stage)
    return None if row is None else row.output_digest


def _save_merged(session: Any, cluster_id: str, tick: int, stage: str, mine: dict[str, Any], before: str | None,
                 input_digest: str) -> None:
    """Save the pipeline's keys of a stage output; when the stage's own implementation wrote the
    row during this call (its digest changed), keep its keys beside ours instead of replacing them."""
    row = load_stage_output(session, cluster_id, tick, stage)
    theirs = row.payload if row is not None and row.output_digest != before and isinstance(row.payload, dict) else {}
    save_stage_output(session, cluster_id, tick, stage, {**theirs, **mine},
                      input_digest=row.input_digest if theirs else input_digest)


def clock_bound_at(session: Any, cluster_id: str, tick: int) -> list[dict[str, Any]]:
    """What cut this tick's planning at a wall-clock limit, if anything: S4's selection (HiGHS's time
    limit, the greedy's) and a policy's own search (``S4_search``: EvoX's time budget). A plan cut by
    the clock depends on the machine's speed, so another machine (or a replay) may not reproduce it."""
    out = []
    for stage, part in ((Stage.S4_PLAN, "selection"), (Stage.S4_SEARCH, None)):
        row = load_stage_output(session, cluster_id, tick, stage)
        body = row.payload if row is not None and isinstance(row.payload, dict) else {}
        body = (body.get(part) or {}) if part else body
        why = body.get("clock_bound") if isinstance(body, dict) else None
        if why:
            out.append({"tick": tick, "stage": str(stage), "cut": str(why)[:300]})
    return out


def deployment_refs(deployments: list[Deployment]) -> list[DeploymentRef]:
    return [
        DeploymentRef(
            job_id=d.job_id,
            rank_id=d.rank_id,
            env_id=d.rank.env.env_id,
            n_replicas=d.rank.n_replicas,
            gpus=d.rank.gpus,
            state=d.state.value,
            since_tick=d.since_tick,
        )
        for d in deployments
    ]


# ---- jobs and the world ----------------------------------------------------------------------------------
def sync_jobs(rt: Runtime, inp: SyncJobsInput) -> SyncJobsSummary:
    """Persist jobs the cluster workflow admitted to its queue, and cancellations.

    A job already stored keeps its status and progress (a retried sync changes nothing).
    """
    saved = cancelled = 0
    with session_scope(rt.engine) as s:
        lock_cluster(s, inp.cluster_id)
        new: list[Job] = []
        for raw in inp.jobs:
            job = Job.model_validate(raw)
            if get_job(s, inp.cluster_id, job.job_id) is None:
                save_job_state(s, inp.cluster_id, JobState(job=job, status=JobStatus.PENDING))
                new.append(job)
                saved += 1
        if new:  # a submitted job starts sending traffic: the world learns of it
            with rt.world.open(s, inp.cluster_id, inp.tick, write=True) as w:
                register = getattr(w.world, "ensure_job", None)
                if register is not None:
                    for job in new:
                        register(job)
                    w.dirty = True
        for job_id in inp.cancelled:
            cur = get_job(s, inp.cluster_id, job_id)
            if cur is not None and cur.status not in (JobStatus.CANCELLED, JobStatus.FINISHED):
                set_job_status(s, inp.cluster_id, job_id, JobStatus.CANCELLED)
                cancelled += 1
    return SyncJobsSummary(tick=inp.tick, saved=saved, cancelled=cancelled)


def ensure_world(rt: Runtime, inp: EnsureWorldInput) -> WorldSummary:
    """Create the cluster's world if it has none; report its clock and the next tick to run."""
    from koi.store import list_ticks

    with session_scope(rt.engine) as s:
        lock_cluster(s, inp.cluster_id)
        now, created = rt.world.ensure(s, inp.cluster_id, inp.scenario, inp.seed)
        at = rt.world.current_tick(s, inp.cluster_id)
        last = list_ticks(s, inp.cluster_id, limit=1, newest_first=True)
        next_tick = max(at, last[0].tick + 1 if last else 0)
        n_jobs = len(get_jobs(s, inp.cluster_id))
    log.info("world.ensure", cluster=inp.cluster_id, created=created, now=now, tick=at, next_tick=next_tick)
    return WorldSummary(cluster_id=inp.cluster_id, tick=at, now=now, next_tick=next_tick, created=created,
                        scenario=inp.scenario, jobs=n_jobs)


def advance_world(rt: Runtime, inp: AdvanceInput) -> WorldSummary:
    """Advance the (simulated) world to ``t_target`` and record it as tick ``inp.tick``; idempotent."""
    with session_scope(rt.engine) as s:
        lock_cluster(s, inp.cluster_id)
        now = rt.world.advance(s, inp.cluster_id, inp.tick, inp.t_target)
    return WorldSummary(cluster_id=inp.cluster_id, tick=inp.tick, now=now)


# ---- S0 snapshot ---------------------------------------------------------------------------------------------
def _finished(job: JobState, now: float, state: tuple[int, bool] | None) -> bool:
    """Done: the world says so (a batch job served, an online job departed), or its lifetime is over."""
    if state is not None:
        return bool(state[1])
    j = job.job
    return j.lifetime_s is not None and now >= j.submitted_at + j.lifetime_s


def _world_job_states(world: Any) -> dict[str, tuple[int, bool]]:
    """job id -> (requests served, finished) as the world reports them; {} when it cannot.

    ``infra.sim.SimWorld`` has ``job_states``; a bare ``koi.sim`` World (a benchmark's
    in-process world) has ``progress`` per job.
    """
    fn = getattr(world, "job_states", None)
    if fn is not None:
        return dict(fn())
    progress, ids = getattr(world, "progress", None), getattr(world, "job_ids", None)
    if progress is None or ids is None:
        return {}
    out = {}
    for job_id in ids:
        p = progress(job_id)
        out[job_id] = (int(p.served), bool(p.departed or p.finished_at is not None))
    return out


def s0_snapshot(rt: Runtime, ref: StageRef) -> SnapshotSummary:
    """Freeze jobs, deployments, capacity and the fence for this tick."""
    with session_scope(rt.engine) as s:
        with rt.world.open(s, ref.cluster_id, ref.tick, write=False) as w:
            now = w.now()
            resources = w.capacity()
            live = w.deployments()
            world_jobs = _world_job_states(w.world)
        states = get_jobs(s, ref.cluster_id, status=[JobStatus.PENDING, JobStatus.ACTIVE])
        visible, finished = [], []
        for js in states:
            if js.job.submitted_at > now + 1e-9:
                continue  # not arrived yet on the cluster clock
            ws = world_jobs.get(js.job.job_id)
            if ws is not None:
                js.completed_requests = max(js.completed_requests, int(ws[0]))
            if _finished(js, now, ws):
                js.status, js.finished_at = JobStatus.FINISHED, now
                save_job_state(s, ref.cluster_id, js)
                finished.append(js.job.job_id)
                continue
            visible.append(js)
        job_ids = {j.job.job_id for j in visible}
        departed = {j.job.job_id for j in get_jobs(s, ref.cluster_id, status=[JobStatus.FINISHED, JobStatus.CANCELLED])}
        if live is not None:  # the world knows best what runs (replicas that failed, spot preemptions)
            live = carry_since(live, get_deployments(s, ref.cluster_id, live_only=True))  # when is ours
            own = [d for d in live if d.job_id in job_ids or d.job_id in departed]
            if own:
                save_deployments(s, ref.cluster_id, own, ref.tick)
        else:
            own = get_deployments(s, ref.cluster_id, live_only=True)
        deployments = [d for d in own if d.is_live and d.job_id in job_ids]
        # an active job that lost every rank (replicas that never came up, a spot reclaim) is pending
        # again: the planner places it anew (C7: place is for pending jobs, keep/swap for running ones)
        running = {d.job_id for d in deployments}
        for js in visible:
            if js.status is JobStatus.ACTIVE and js.job.job_id not in running:
                js.status = JobStatus.PENDING
                save_job_state(s, ref.cluster_id, js)
                log.warning("job.lost_ranks", cluster=ref.cluster_id, tick=ref.tick, job=js.job.job_id)
        # ranks of this cluster's jobs that finished or were cancelled: S6 releases them
        released = [d for d in own if d.is_live and d.job_id in departed]
        save_stage_output(s, ref.cluster_id, ref.tick, S0_RELEASED, [d.model_dump(mode="json") for d in released],
                          input_digest="")
        snap = ClusterSnapshot(
            cluster_id=ref.cluster_id,
            tick=ref.tick,
            now=now,
            jobs=visible,
            deployments=deployments,
            resources=resources,
            last_committed_tick=get_fence(s, ref.cluster_id),
        )
        out = save_stage_output(
            s, ref.cluster_id, ref.tick, Stage.S0_SNAPSHOT, snap, input_digest=digest({"tick": ref.tick, "now": now})
        )
    return SnapshotSummary(
        tick=ref.tick,
        now=now,
        n_jobs=len(snap.jobs),
        n_pending=len(snap.pending_jobs),
        n_active=len(snap.active_jobs),
        n_deployments=len(snap.deployments),
        free_gpus=resources.free_gpus,
        total_gpus=resources.total_gpus,
        last_committed_tick=snap.last_committed_tick,
        finished_jobs=finished,
        output_digest=out,
    )


# ---- S1 observe -----------------------------------------------------------------------------------------------
def s1_observe(rt: Runtime, ref: StageRef) -> ObserveSummary:
    """Per-rank V/Y telemetry for [t-1, t] into the store."""
    with session_scope(rt.engine) as s:
        snap = _snapshot(s, ref)
        prev = load_stage_model(s, ref.cluster_id, ref.tick - 1, Stage.S0_SNAPSHOT, ClusterSnapshot) if ref.tick else None
        t1 = snap.now
        t0 = prev.now if prev is not None and prev.now < t1 else max(0.0, t1 - rt.interval_s)
        with rt.world.open(s, ref.cluster_id, ref.tick, write=False) as w:
            windows = w.telemetry(t0, t1, cluster_id=ref.cluster_id, tick=ref.tick) if t1 > t0 else []
        if windows:
            save_telemetry(s, windows)
        n_records = 0
        if rt.record_perf and windows:
            # PerfDB: each serving rank's observed performance against the physics, before S3 reads it
            from koi.evidence.perfdb import record_perf

            n_records = record_perf(s, ref.cluster_id, ref.tick, snap)
        n_samples = sum(w.n_samples for w in windows)
        save_stage_output(
            s,
            ref.cluster_id,
            ref.tick,
            Stage.S1_OBSERVE,
            {"t_start": t0, "t_end": t1, "ranks": sorted(w.rank_id for w in windows), "n_samples": n_samples,
             "perf_records": n_records},
            input_digest=digest({"snapshot": snap.model_dump(mode="json")["now"], "t0": t0, "t1": t1}),
        )
    return ObserveSummary(tick=ref.tick, t_start=t0, t_end=t1, n_windows=len(windows), n_samples=n_samples)


# ---- S2 / S3 -----------------------------------------------------------------------------------------------------
def s2_validate(rt: Runtime, ref: StageRef) -> EvidenceSummary:
    """Residuals → mechanisms → CUSUM → quadrant → ICP → EvidenceRows (written by koi.evidence)."""
    from koi.pipeline import delegates
    from koi.store import get_evidence

    fn = rt.s2 or delegates.run_s2
    with session_scope(rt.engine) as s:
        _snapshot(s, ref)
        detail = fn(s, ref.cluster_id, ref.tick) or {}
        n_rows = len(get_evidence(s, ref.cluster_id, tick=ref.tick))
        save_stage_output(s, ref.cluster_id, ref.tick, Stage.S2_VALIDATE, {"n_rows": n_rows, **detail}, input_digest="")
    return EvidenceSummary(tick=ref.tick, n_rows=n_rows, detail=detail)


def s3_slow_update(rt: Runtime, ref: StageRef) -> SlowSummary:
    """Beta fan-out and the slow loop (applied by koi.calibration)."""
    from koi.pipeline import delegates

    fn = rt.s3 or delegates.run_s3
    with session_scope(rt.engine) as s:
        _snapshot(s, ref)
        detail = fn(s, ref.cluster_id, ref.tick) or {}
        save_stage_output(s, ref.cluster_id, ref.tick, Stage.S3_SLOW, detail, input_digest="")
    return SlowSummary(tick=ref.tick, detail=detail)


# ---- S4 plan -------------------------------------------------------------------------------------------------------
def s4_plan(rt: Runtime, ref: StageRef) -> PlanSummary:
    """One proposal (attempt 0) or the repair round (attempt 1, with S5's objections)."""
    with session_scope(rt.engine) as s:
        snap = _snapshot(s, ref)
        before = _digest_of(s, ref.cluster_id, ref.tick, Stage.S4_PLAN)
        plan = _propose(rt, ref, s, snap, 0)
        save_plan(s, ref.cluster_id, plan, committed=False)
        pd = digest(plan)
        _save_merged(s, ref.cluster_id, ref.tick, Stage.S4_PLAN,
                     {"attempt": ref.attempt, "proposer": plan.proposer, "plan_digest": pd}, before,
                     input_digest=digest({"snapshot": digest(snap), "attempt": ref.attempt}))
        cut = "; ".join(c["cut"] for c in clock_bound_at(s, ref.cluster_id, ref.tick))
    by_type = Counter(a.type.value for a in plan.actions)
    return PlanSummary(
        tick=ref.tick, attempt=ref.attempt, proposer=plan.proposer, n_actions=len(plan.actions), by_type=dict(by_type),
        digest=pd, clock_bound=cut,
    )


def _propose(rt: Runtime, ref: StageRef, s: Any, snap: ClusterSnapshot, index: int) -> Plan:
    name, proposer = rt.proposer(ref.proposer)
    feedback: list[str] = []
    previous = None
    if ref.attempt > 0:
        row = load_stage_output(s, ref.cluster_id, ref.tick, Stage.S5_VALIDATE_PLAN)
        feedback = list((row.payload or {}).get("violations", [])) if row is not None else []
        previous = get_plan(s, ref.cluster_id, ref.tick)
    ctx = ProposeContext(
        session=s, cluster_id=ref.cluster_id, tick=ref.tick, snapshot=snap, attempt=ref.attempt, feedback=feedback,
        previous=previous, seed=rt.seed + 7919 * ref.tick + 104729 * index + ref.attempt, runtime=rt,
    )
    plan = proposer(ctx)
    if not isinstance(plan, Plan):
        plan = Plan.model_validate(plan)
    return plan.model_copy(update={"tick": ref.tick, "cluster_id": ref.cluster_id, "proposer": plan.proposer or name})


def _candidate_stage(attempt: int, index: int) -> str:
    return f"S4_candidate.a{attempt}.{index}"


def s4_propose(rt: Runtime, ref: StageRef, index: int) -> PlanSummary:
    """One planner trajectory: a candidate plan stored under its index (not yet the tick's plan)."""
    with session_scope(rt.engine) as s:
        snap = _snapshot(s, ref)
        plan = _propose(rt, ref, s, snap, index)
        pd = save_stage_output(s, ref.cluster_id, ref.tick, _candidate_stage(ref.attempt, index), plan,
                               input_digest=digest({"snapshot": digest(snap), "index": index}))
    by_type = Counter(a.type.value for a in plan.actions)
    return PlanSummary(tick=ref.tick, attempt=ref.attempt, proposer=plan.proposer, n_actions=len(plan.actions),
                       by_type=dict(by_type), digest=pd)


def s4_select(rt: Runtime, ref: StageRef, candidates: list[int]) -> PlanSummary:
    """Deterministic code decides among the trajectories (whitepaper, "The Agentic Planner":
    "returns the plan with the best σ score").

    Among the candidates that pass C0–C7, the highest plan value wins: the joint selector's
    objective (Φ plus kept ladders' σ minus the priority-weighted unserved demand), computed
    by the same scoring code every proposer is judged by; ties go to the lowest index. Only
    when no candidate is valid does the one with the fewest violations go on to S5's repair.
    """
    from koi.pipeline import delegates

    fn = rt.validator or delegates.default_validator
    with session_scope(rt.engine) as s:
        snap = _snapshot(s, ref)
        scored = []
        for k in sorted(candidates):
            plan = load_stage_model(s, ref.cluster_id, ref.tick, _candidate_stage(ref.attempt, k), Plan)
            if plan is None:
                continue
            v = fn(s, ref.cluster_id, ref.tick, snap, plan)
            scored.append((0 if v.valid else 1, len(v.violations), k, plan))
        if not scored:
            raise InputError(f"tick {ref.tick}: no stored candidate among {candidates}")
        valid = [(k, plan) for ok, _, k, plan in scored if ok == 0]
        if len(valid) > 1:
            value = _plan_values(s, ref, snap, [p for _, p in valid])
            k, plan = max(zip(valid, value, strict=True), key=lambda t: (t[1], -t[0][0]))[0]
        else:
            _, _, k, plan = min(scored, key=lambda t: t[:3])
        save_plan(s, ref.cluster_id, plan, committed=False)
        pd = digest(plan)
        save_stage_output(s, ref.cluster_id, ref.tick, Stage.S4_PLAN,
                          {"attempt": ref.attempt, "proposer": plan.proposer, "plan_digest": pd, "selected": k,
                           "candidates": sorted(candidates)}, input_digest=digest(sorted(candidates)))
    by_type = Counter(a.type.value for a in plan.actions)
    return PlanSummary(tick=ref.tick, attempt=ref.attempt, proposer=plan.proposer, n_actions=len(plan.actions),
                       by_type=dict(by_type), digest=pd)


def _plan_values(s: Any, ref: StageRef, snap: ClusterSnapshot, plans: list[Plan]) -> list[float]:
    """The selector's objective of each plan, scored on this tick's planning context."""
    from koi.agent.backend import ToolBackend
    from koi.planning.tick import load_planning_context

    backend = ToolBackend(snap, load_planning_context(s, ref.cluster_id, ref.tick))
    return [float(backend.plan_value(p)[0]) for p in plans]


# ---- S5 validate ---------------------------------------------------------------------------------------------------
def s5_validate_plan(rt: Runtime, ref: StageRef) -> ValidationSummary:
    """C0–C7 on the stored plan; a valid (possibly repaired) plan is stored back for S6."""
    from koi.pipeline import delegates

    fn = rt.validator or delegates.default_validator
    with session_scope(rt.engine) as s:
        snap = _snapshot(s, ref)
        plan = get_plan(s, ref.cluster_id, ref.tick)
        if plan is None:
            raise InputError(f"tick {ref.tick} of {ref.cluster_id!r} has no plan; run s4_plan first")
        before = _digest_of(s, ref.cluster_id, ref.tick, Stage.S5_VALIDATE_PLAN)
        verdict: Verdict = fn(s, ref.cluster_id, ref.tick, snap, plan)
        final = verdict.plan.model_copy(update={"tick": ref.tick, "cluster_id": ref.cluster_id})
        if verdict.valid:  # the plan S6 will deploy is exactly the one validated
            save_plan(s, ref.cluster_id, final, committed=False)
        violations = _short([str(v) for v in verdict.violations])
        _save_merged(
            s, ref.cluster_id, ref.tick, Stage.S5_VALIDATE_PLAN,
            {"attempt": ref.attempt, "valid": verdict.valid, "violations": violations, "plan_digest": digest(final),
             "kept": verdict.kept},
            before, input_digest=digest(plan),
        )
    return ValidationSummary(
        tick=ref.tick,
        attempt=ref.attempt,
        valid=verdict.valid,
        repairable=verdict.repairable,
        violations=violations,
        kept=verdict.kept,
    )



# ---- the tick's record --------------------------------------------------------------------------------------------------
def finish_tick(rt: Runtime, inp: FinishInput) -> FinishSummary:
    """Record the tick's outcome (the ``ticks`` table) and report what now runs."""
    status = inp.outcome.value
    with session_scope(rt.engine) as s:
        save_tick(s, inp.cluster_id, inp.tick, status, reason=inp.reason[:2000], timings=inp.timings)
        deps = [d for d in get_deployments(s, inp.cluster_id, live_only=True)]
        jobs = {j.job.job_id: j.status.value for j in get_jobs(s, inp.cluster_id)}
        now = None
        try:
            with rt.world.open(s, inp.cluster_id, inp.tick, write=False) as w:
                now = w.now()
        except Exception:  # noqa: BLE001 - the world's clock is informative only
            now = None
    if inp.outcome is TickOutcome.COMMITTED:
        log.info("tick.finish", cluster=inp.cluster_id, tick=inp.tick, outcome=status)
    else:
        log.warning("tick.finish", cluster=inp.cluster_id, tick=inp.tick, outcome=status, reason=inp.reason)
    return FinishSummary(tick=inp.tick, outcome=inp.outcome, deployments=deployment_refs(deps), job_status=jobs, world_now=now)


def timed(fn: Any, *args: Any) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t0
