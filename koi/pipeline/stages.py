"""The tick's stages S0–S6, keep-all compensation, and the world's clock, with persistence.

Every function here is ``stage(runtime, input) -> summary``: it loads its inputs by
reference from the store (keyed by cluster and tick), calls one koi stage, persists
the output in the same store and returns a small summary (:mod:`koi.pipeline.messages`).
The Temporal activities (``activities/``) and the in-process runner
(:mod:`koi.pipeline.runner`) both call these, so a durable tick and a benchmark tick
run the same code.

Idempotency: S0–S5 overwrite their outputs (upserts keyed by cluster, tick, stage),
so a retry writes the same rows again. S6 is the only stage with side effects; each
of its operations runs in one transaction that (1) takes the cluster lock and checks
the fence, (2) claims the operation's idempotency key in the deploy log, (3) applies it
through the executor, (4) saves the world. A retried or reset S6 finds its claims and
skips them; a stale tick is refused by the fence before it touches anything.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from koi.domain import (
    ActionType,
    ClusterSnapshot,
    Deployment,
    DeploymentState,
    Job,
    JobState,
    JobStatus,
    Plan,
    Rank,
)
from koi.logging import get_logger
from koi.pipeline.errors import InputError, LaunchRefused, PlanRejected, StaleTick
from koi.pipeline.fencing import hold_fence, lock_cluster
from koi.pipeline.messages import (
    AdvanceInput,
    CompensationSummary,
    DeploymentRef,
    DeploySummary,
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
    DeployStatus,
    Stage,
    advance_fence,
    deploy_key,
    digest,
    get_deploy,
    get_deployments,
    get_fence,
    get_job,
    get_jobs,
    get_plan,
    list_deploys,
    load_stage_model,
    load_stage_output,
    mark_plan_committed,
    record_deploy,
    save_deployments,
    save_job_state,
    save_plan,
    save_stage_output,
    save_telemetry,
    save_tick,
    session_scope,
    set_job_status,
    update_deploy,
)

log = get_logger(__name__)

#: Extra stage names (beside :class:`koi.store.Stage`).
S0_RELEASED = "S0_released"
S6_EPOCH = "S6_epoch"
COMPENSATION = "S6_compensation"
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
    by_type = Counter(a.type.value for a in plan.actions)
    return PlanSummary(
        tick=ref.tick, attempt=ref.attempt, proposer=plan.proposer, n_actions=len(plan.actions), by_type=dict(by_type), digest=pd
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


# ---- S6 deploy -------------------------------------------------------------------------------------------------------
@dataclass
class Op:
    kind: str  # launch | scale | teardown | reweight
    job_id: str
    rank: Rank
    rank_id: str
    key: str
    n_replicas: int = 0
    prev_replicas: int = 0
    drain_s: float = 0.0
    handover: bool = False  # a swap's old rank: serves until the new ladder does (make before break)
    detail: dict[str, Any] = field(default_factory=dict)


def _epoch(session: Any, cluster_id: str, tick: int) -> int:
    row = load_stage_output(session, cluster_id, tick, S6_EPOCH)
    return int((row.payload or {}).get("epoch", 0)) if row is not None else 0


def _key(cluster_id: str, tick: int, job_id: str, rank_id: str, kind: str, epoch: int) -> str:
    base = deploy_key(cluster_id, tick, job_id, rank_id)
    if kind != "launch":
        base = f"{base}:{kind}"
    return base if epoch == 0 else f"{base}#e{epoch}"


def _pool_of(rank: Rank) -> tuple[str, str | None]:
    return rank.env.env_id, rank.config.instance_type


def _same_pool(a: Rank, b: Rank) -> bool:
    (ea, ia), (eb, ib) = _pool_of(a), _pool_of(b)
    return ea == eb and (ia is None or ib is None or ia == ib)


def plan_ops(snapshot: ClusterSnapshot, plan: Plan, cluster_id: str, tick: int, epoch: int, drain_s: float,
             released: list[Deployment] = ()) -> list[Op]:  # type: ignore[assignment]
    """The operations that take the snapshot to the plan, in three waves (the capacity model of
    S5's C1, ``koi.planning.capacity``):

    1. releases, at once (no drain): preempted and terminated ranks, ranks of jobs that finished
       or were cancelled (``released``), scale-downs, and a swap's old ranks in a pool its new
       ladder uses when that pool has no room for the plan's launches besides them (a swap
       within a pool needs only the difference: C1 counted the old instances as reused);
    2. launches and scale-ups;
    3. a swap's old ranks in other pools, handed over: each keeps taking traffic until a rank of
       the new ladder serves (the executor's ``handover``), then drains for ``drain_s`` — the A/B
       canary overlap (make before break) that SwitchCost's C_parallel prices. Tearing them down
       at once left a job's traffic waiting at the gateway through the new ladder's cold start
       (on hetero-3h about a fifth of a swapped job's requests in that tick were dropped).
    """
    live: dict[str, list[Deployment]] = {}
    for d in snapshot.deployments:
        if d.is_live:
            live.setdefault(d.job_id, []).append(d)
    known = {j.job.job_id for j in snapshot.jobs}
    first: list[Op] = []
    ups: list[Op] = []
    last: list[Op] = []
    in_place: list[tuple[str, Deployment, str]] = []  # a swap's old ranks in a pool its new ladder uses

    def teardown(job_id: str, d: Deployment, action: str, drain: float, handover: bool = False) -> Op:
        return Op("teardown", job_id, d.rank, d.rank_id, _key(cluster_id, tick, job_id, d.rank_id, "teardown", epoch),
                  drain_s=drain, handover=handover, detail={"action": action})

    for a in plan.actions:
        current = {d.rank_id: d for d in live.get(a.job_id, [])}
        if a.carries_ladder and a.ladder is not None:
            target: dict[str, Rank] = {r.rank_id(a.job_id): r for r in a.ladder.ranks}
            for rid, r in target.items():
                if rid not in current:
                    ups.append(Op("launch", a.job_id, r, rid, _key(cluster_id, tick, a.job_id, rid, "launch", epoch),
                                  n_replicas=r.n_replicas, detail={"action": a.type.value}))
                elif current[rid].rank.n_replicas != r.n_replicas:
                    op = Op("scale", a.job_id, r, rid, _key(cluster_id, tick, a.job_id, rid, "scale", epoch),
                            n_replicas=r.n_replicas, prev_replicas=current[rid].rank.n_replicas,
                            detail={"action": a.type.value})
                    (first if r.n_replicas < op.prev_replicas else ups).append(op)
                elif current[rid].state is DeploymentState.DEGRADED and current[rid].replicas_ready < r.n_replicas:
                    # replicas that failed to materialise (or were lost) are not retried by the
                    # executor: the plan asking for this rank at its size again means "recover them"
                    ups.append(Op("scale", a.job_id, r, rid, _key(cluster_id, tick, a.job_id, rid, "scale", epoch),
                                  n_replicas=r.n_replicas, prev_replicas=current[rid].replicas_ready,
                                  detail={"action": a.type.value, "recover": True}))
            for rid, d in current.items():
                if rid in target:
                    continue
                if any(_same_pool(d.rank, r) for r in target.values()):
                    in_place.append((a.job_id, d, a.type.value))
                else:
                    last.append(teardown(a.job_id, d, a.type.value, drain_s, handover=True))
        elif a.type in (ActionType.PREEMPT, ActionType.TERMINATE):
            for d in current.values():
                first.append(teardown(a.job_id, d, a.type.value, 0.0))
        elif a.type is ActionType.KEEP and a.route_weights:
            for rid, w in sorted(a.route_weights.items()):
                d = current.get(rid)
                if d is None or d.rank.route_weight == w:
                    continue
                first.append(Op("reweight", a.job_id, d.rank.model_copy(update={"route_weight": w}), rid,
                                _key(cluster_id, tick, a.job_id, rid, "reweight", epoch),
                                detail={"action": a.type.value, "route_weight": w,
                                        "prev_weight": d.rank.route_weight}))
    # ranks of jobs that left (finished, cancelled) are released
    gone = [d for ds in live.values() for d in ds if d.job_id not in known] + list(released)
    seen: set[str] = set()
    for d in sorted(gone, key=lambda d: d.rank_id):
        if d.rank_id in seen or not d.is_live:
            continue
        seen.add(d.rank_id)
        first.append(teardown(d.job_id, d, "release", 0.0))
    from koi.planning.capacity import PoolIndex

    index = PoolIndex(snapshot.resources)
    roomy = _pools_with_room(index, ups)
    for job_id, d, action in in_place:
        p = index.pool_of(d.rank)
        if p is not None and p.pool_id in roomy:
            last.append(teardown(job_id, d, action, drain_s, handover=True))
        else:
            first.append(teardown(job_id, d, action, 0.0))
    return first + ups + last


def _pools_with_room(index: Any, ups: list[Op]) -> set[str]:
    """Pools whose free instances hold every launch and scale-up of the plan there without
    releasing anything first: a swap in place there can be make-before-break too."""
    from koi.planning.capacity import instances_for

    need: dict[str, int] = {}
    for op in ups:
        p = index.pool_of(op.rank)
        if p is None:
            continue
        g = op.rank.config.gpus
        k = instances_for(g, op.n_replicas, p.gpus_per_instance)
        if op.kind == "scale":
            k -= instances_for(g, op.prev_replicas, p.gpus_per_instance)
        need[p.pool_id] = need.get(p.pool_id, 0) + max(k, 0)
    return {pid for pid, p in index.by_id.items() if need.get(pid, 0) <= p.free_instances}


_DONE = {DeployStatus.LAUNCHED.value, DeployStatus.DRAINED.value, "scaled", "reweighted", "duplicate"}


def _apply(rt: Runtime, cluster_id: str, tick: int, op: Op, jobs: dict[str, Job]) -> str:
    """One operation in one transaction; returns launched | scaled | drained | duplicate | skipped."""
    with session_scope(rt.engine) as s:
        if not hold_fence(s, cluster_id, tick):
            raise StaleTick(f"tick {tick} may not deploy: tick {get_fence(s, cluster_id)} has committed a newer plan")
        prev = get_deploy(s, op.key)
        if prev is not None and prev.status in _DONE:
            return "skipped"
        record_deploy(s, cluster_id, tick, op.job_id, op.rank_id, status=DeployStatus.REQUESTED,
                      detail={"op": op.kind, **op.detail}, idempotency_key=op.key)
        with rt.world.open(s, cluster_id, tick, write=True) as w:
            ex = w.executor
            if op.kind == "launch":
                res = ex.launch(jobs[op.job_id], op.rank, op.key)
                status = {"launched": "launched", "duplicate": "duplicate", "failed": "failed"}[res.status.value]
                detail = {"op": "launch", "replicas": res.replicas_launched, "reason": res.reason, **op.detail,
                          "rank": op.rank.model_dump(mode="json")}
            elif op.kind == "scale":
                res = ex.scale(op.job_id, op.rank_id, op.n_replicas, op.key, drain_s=op.drain_s)
                status = {"launched": "scaled", "duplicate": "duplicate", "failed": "failed"}[res.status.value]
                detail = {"op": "scale", "replicas": op.n_replicas, "prev_replicas": op.prev_replicas,
                          "reason": res.reason, **op.detail}
            elif op.kind == "reweight":
                took = ex.reweight(op.job_id, op.rank_id, float(op.detail["route_weight"]), op.key)
                status = "reweighted" if took else "skipped"
                detail = {"op": "reweight", **op.detail}
            else:
                gone = ex.teardown(op.job_id, op.rank_id, op.key, drain_s=op.drain_s, handover=op.handover)
                status = DeployStatus.DRAINED.value
                detail = {"op": "teardown", "released": bool(gone), "drain_s": op.drain_s, "handover": op.handover,
                          **op.detail,
                          "rank": op.rank.model_dump(mode="json")}
        update_deploy(s, op.key, status, detail)
    if status == "failed":
        raise LaunchRefused(f"{op.kind} of {op.rank_id} refused: {detail.get('reason') or 'no reason given'}")
    return status


def s6_deploy(rt: Runtime, ref: StageRef) -> DeploySummary:
    """Deploy the validated plan: fenced, idempotent, make-before-break; then commit it."""
    with session_scope(rt.engine) as s:
        snap = _snapshot(s, ref)
        plan = get_plan(s, ref.cluster_id, ref.tick)
        if plan is None:
            raise PlanRejected(f"tick {ref.tick} of {ref.cluster_id!r} has no plan")
        row = load_stage_output(s, ref.cluster_id, ref.tick, Stage.S5_VALIDATE_PLAN)
        if row is None or not row.payload.get("valid") or row.payload.get("plan_digest") != digest(plan):
            raise PlanRejected(f"the plan of tick {ref.tick} has not passed S5; refusing to deploy it")
        fence = get_fence(s, ref.cluster_id)
        if fence is not None and fence > ref.tick:
            raise StaleTick(f"tick {ref.tick} may not deploy: tick {fence} has committed a newer plan")
        epoch = _epoch(s, ref.cluster_id, ref.tick)
        rel = load_stage_output(s, ref.cluster_id, ref.tick, S0_RELEASED)
        released = [Deployment.model_validate(d) for d in (rel.payload or [])] if rel is not None else []
    jobs = {j.job.job_id: j.job for j in snap.jobs}
    ops = plan_ops(snap, plan, ref.cluster_id, ref.tick, epoch, rt.drain_s, released)
    counts: Counter[str] = Counter()
    for i, op in enumerate(ops):
        rt.heartbeat({"done": i, "of": len(ops), "next": op.key})
        counts[_apply(rt, ref.cluster_id, ref.tick, op, jobs)] += 1
    rt.heartbeat({"done": len(ops), "of": len(ops)})
    summary = _commit(rt, ref, snap, plan, ops, counts, epoch)
    log.info("tick.deploy", cluster=ref.cluster_id, tick=ref.tick, **summary.model_dump(exclude={"tick"}))
    return summary


def _commit(rt: Runtime, ref: StageRef, snap: ClusterSnapshot, plan: Plan, ops: list[Op], counts: Counter[str], epoch: int) -> DeploySummary:
    with session_scope(rt.engine) as s:
        if not hold_fence(s, ref.cluster_id, ref.tick):
            raise StaleTick(f"tick {ref.tick} may not commit: tick {get_fence(s, ref.cluster_id)} committed first")
        advance_fence(s, ref.cluster_id, ref.tick)
        mark_plan_committed(s, ref.cluster_id, ref.tick)
        # the deployments table: from the world when it reports them, else from the plan
        with rt.world.open(s, ref.cluster_id, ref.tick, write=False) as w:
            reported = w.deployments()
        by_rank = {d.rank_id: d for d in snap.deployments}
        for op in ops:
            if op.kind == "reweight":
                if op.rank_id in by_rank:
                    by_rank[op.rank_id] = by_rank[op.rank_id].model_copy(update={"rank": op.rank})
            elif op.kind == "teardown":
                if op.rank_id in by_rank:
                    by_rank[op.rank_id] = by_rank[op.rank_id].model_copy(update={"state": DeploymentState.TERMINATED})
                else:
                    by_rank[op.rank_id] = Deployment(job_id=op.job_id, rank=op.rank, state=DeploymentState.TERMINATED,
                                                     since_tick=ref.tick, idempotency_key=op.key)
            else:
                since = by_rank[op.rank_id].since_tick if op.rank_id in by_rank else ref.tick
                by_rank[op.rank_id] = Deployment(job_id=op.job_id, rank=op.rank, state=DeploymentState.LAUNCHING,
                                                 since_tick=since, idempotency_key=op.key)
        if reported is not None:
            rep = {d.rank_id: d for d in reported}
            for rid in list(by_rank):
                if rid in rep:
                    by_rank[rid] = rep[rid]
        save_deployments(s, ref.cluster_id, list(by_rank.values()), ref.tick)
        # job lifecycle from the plan's actions
        for a in plan.actions:
            js = next((j for j in snap.jobs if j.job.job_id == a.job_id), None)
            if js is None:
                continue
            if a.carries_ladder and js.status is JobStatus.PENDING:
                set_job_status(s, ref.cluster_id, a.job_id, JobStatus.ACTIVE, admitted_tick=ref.tick)
            elif a.type is ActionType.PREEMPT and js.status is JobStatus.ACTIVE:
                set_job_status(s, ref.cluster_id, a.job_id, JobStatus.PENDING)
            elif a.type is ActionType.TERMINATE:
                set_job_status(s, ref.cluster_id, a.job_id, JobStatus.CANCELLED, finished_at=snap.now)
        summary = DeploySummary(
            tick=ref.tick,
            launched=counts["launched"],
            scaled=counts["scaled"],
            torn_down=counts["drained"],
            reweighted=counts["reweighted"],
            duplicates=counts["duplicate"] + counts["skipped"],
            failed=counts["failed"],
            committed=True,
            fence=get_fence(s, ref.cluster_id),
            epoch=epoch,
        )
        save_stage_output(s, ref.cluster_id, ref.tick, Stage.S6_DEPLOY, summary, input_digest=digest(plan))
    return summary


# ---- keep-all compensation --------------------------------------------------------------------------------------------
def compensate_keep_all(rt: Runtime, ref: StageRef, reason: str = "") -> CompensationSummary:
    """Keep-all: undo whatever this tick's S6 applied, so the running cluster stays as it was.

    Launches are torn down, scales reverted, teardowns relaunched — each with its own
    idempotency key (``<key>:undo``), newest first. The tick's deploy epoch is bumped,
    so a later reset of this tick launches afresh instead of finding its undone claims.
    A tick that already committed (the failure came after S6) is left alone.
    """
    undone = 0
    with session_scope(rt.engine) as s:
        done = load_stage_output(s, ref.cluster_id, ref.tick, Stage.S6_DEPLOY)
        if done is not None and done.payload.get("committed"):
            # this tick's plan was deployed and committed (e.g. a reset of a committed tick that the fence
            # then refused): what it launched is the running cluster now, and keep-all keeps it
            return CompensationSummary(tick=ref.tick, reason=f"tick {ref.tick} had committed; nothing to undo ({reason})")
        epoch = _epoch(s, ref.cluster_id, ref.tick)
        claims = [r for r in list_deploys(s, ref.cluster_id, ref.tick) if not r.idempotency_key.endswith(":undo")]
        any_claims = any(r.status not in ("rolled_back", "abandoned") for r in claims)
        rows = [r for r in claims if r.status in ("launched", "scaled", "reweighted", "drained", "duplicate")]
        stale = [r.idempotency_key for r in claims if r.status in ("failed", "requested")]
        snap = load_stage_model(s, ref.cluster_id, ref.tick, Stage.S0_SNAPSHOT, ClusterSnapshot)
    jobs = {j.job.job_id: j.job for j in snap.jobs} if snap is not None else {}
    for r in sorted(rows, key=lambda r: r.id or 0, reverse=True):
        with session_scope(rt.engine) as s:
            lock_cluster(s, ref.cluster_id)
            key = f"{r.idempotency_key}:undo"
            if get_deploy(s, key) is not None:
                continue
            record_deploy(s, ref.cluster_id, ref.tick, r.job_id, r.rank_id, status="undo", idempotency_key=key,
                          detail={"undo": r.idempotency_key})
            detail = r.detail or {}
            op = detail.get("op", "launch")
            with rt.world.open(s, ref.cluster_id, ref.tick, write=True) as w:
                ex = w.executor
                if op == "launch":
                    ex.teardown(r.job_id, r.rank_id, key, drain_s=0.0)
                elif op == "scale":
                    ex.scale(r.job_id, r.rank_id, int(detail.get("prev_replicas", 1)), key)
                elif op == "reweight" and detail.get("prev_weight"):
                    ex.reweight(r.job_id, r.rank_id, float(detail["prev_weight"]), key)
                elif op == "teardown" and r.job_id in jobs and "rank" in detail:
                    ex.launch(jobs[r.job_id], Rank.model_validate(detail["rank"]), key)
            update_deploy(s, r.idempotency_key, "rolled_back")
            undone += 1
    restored = 0
    with session_scope(rt.engine) as s:
        lock_cluster(s, ref.cluster_id)
        for key in stale:
            update_deploy(s, key, "abandoned")
        if undone or any_claims:
            save_stage_output(s, ref.cluster_id, ref.tick, S6_EPOCH, {"epoch": epoch + 1}, input_digest="")
        fence = get_fence(s, ref.cluster_id)
        if snap is not None and (fence is None or fence <= ref.tick) and undone:
            # the running cluster is the safe state: the deployments table goes back to the snapshot
            current = {d.rank_id: d for d in get_deployments(s, ref.cluster_id)}
            keep = {d.rank_id for d in snap.deployments}
            back = list(snap.deployments)
            for rid, d in current.items():
                if rid not in keep and d.is_live and d.since_tick == ref.tick:
                    back.append(d.model_copy(update={"state": DeploymentState.TERMINATED}))
            restored = save_deployments(s, ref.cluster_id, back, ref.tick) if back else 0
        summary = CompensationSummary(tick=ref.tick, undone=undone, restored=restored, reason=reason)
        save_stage_output(s, ref.cluster_id, ref.tick, COMPENSATION, summary, input_digest="")
    log.warning("tick.keep_all", cluster=ref.cluster_id, tick=ref.tick, undone=undone, reason=reason)
    return summary


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
