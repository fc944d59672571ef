"""S6 deploy and keep-all compensation, with persistence: the only stage with side effects.

Split from :mod:`koi.pipeline.stages` (the same ``stage(runtime, input) -> summary`` shape;
the Temporal activities and the in-process runner call both): :func:`plan_ops` turns the
validated plan into operations in three waves, :func:`s6_deploy` applies them and commits the
plan, and :func:`compensate_keep_all` undoes what a failed tick applied.

Idempotency: each S6 operation runs in one transaction that (1) takes the cluster lock and
checks the fence, (2) claims the operation's idempotency key in the deploy log, (3) applies it
through the executor, (4) saves the world. A retried or reset S6 finds its claims and skips
them; a stale tick is refused by the fence before it touches anything.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from koi.domain import (
    ActionType,
    ClusterSnapshot,
    Deployment,
    DeploymentState,
    Job,
    JobStatus,
    Plan,
    Rank,
    carry_since,
)
from koi.logging import get_logger
from koi.pipeline.errors import LaunchRefused, PlanRejected, StaleTick
from koi.pipeline.fencing import hold_fence, lock_cluster
from koi.pipeline.messages import CompensationSummary, DeploySummary, StageRef
from koi.pipeline.runtime import Runtime
from koi.pipeline.stages import S0_RELEASED, _snapshot
from koi.planning.capacity import PoolIndex, held_replicas, instances_for
from koi.store import (
    DeployStatus,
    Stage,
    advance_fence,
    deploy_key,
    digest,
    get_deploy,
    get_deployments,
    get_fence,
    get_plan,
    list_deploys,
    load_stage_model,
    load_stage_output,
    mark_plan_committed,
    record_deploy,
    save_deployments,
    save_stage_output,
    session_scope,
    set_job_status,
    update_deploy,
)

log = get_logger(__name__)

#: Extra stage names (beside :class:`koi.store.Stage`).
S6_EPOCH = "S6_epoch"
COMPENSATION = "S6_compensation"


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
       or were cancelled (``released``), scale-downs, and — when a pool has no room for the plan's
       launches there besides a swap's old ranks in it (a swap within a pool needs only the
       difference: C1 counted the old instances as reused) — just enough of those old ranks'
       replicas to make the room: a *rolling replacement*, as a Kubernetes rolling update with
       ``maxUnavailable`` set to what is missing. An old rank that must give back everything it
       holds is torn down; one that gives back part is scaled in now and the rest handed over
       in wave 3. Tearing every old rank of a full pool down at once took the whole job dark for
       the new chain's cold start: on homo-12h (Koi, seed 1) a 56 × TP1 → 14 × TP2 rebuild of
       agent-moe-30b needed half of the pool's instances and took all of them, and the job met
       6–7% of its requests for two ticks. Old ranks give back in plan order (deterministic);
    2. launches and scale-ups;
    3. a swap's old ranks in other pools, handed over: each keeps taking traffic until a rank of
       the new ladder serves (the executor's ``handover``), then drains for ``drain_s`` — the A/B
       canary overlap (make before break) that SwitchCost's C_parallel prices. Tearing them down
       at once left a job's traffic waiting at the gateway through the new ladder's cold start
       (on hetero-3h about a fifth of a swapped job's requests in that tick were dropped).

    A scale starts from the replicas the rank holds (``capacity.held_replicas``: a degraded
    rank only its ready ones), as the executor's scale does and as C1 counts: its wave (a
    release when it shrinks below that, else an addition) and the instances it takes from
    the pool (which decide whether a swap in place can hand over) follow from that count,
    and keep-all's undo returns the rank to it. Starting from the requested size made a
    degraded rank's scale-up look smaller than it was: S6 judged a pool roomy, kept a swap's
    old rank there for a handover, and the executor refused the swap's launch (hetero-12h,
    tick 122).
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
                    continue
                d = current[rid]
                held = held_replicas(d)  # a degraded rank holds its ready replicas only
                if d.rank.n_replicas == r.n_replicas and held >= r.n_replicas:
                    continue
                detail: dict[str, Any] = {"action": a.type.value}
                if d.rank.n_replicas == r.n_replicas:
                    # replicas that failed to materialise (or were lost) are not retried by the
                    # executor: the plan asking for this rank at its size again means "recover them"
                    detail["recover"] = True
                op = Op("scale", a.job_id, r, rid, _key(cluster_id, tick, a.job_id, rid, "scale", epoch),
                        n_replicas=r.n_replicas, prev_replicas=held, detail=detail)
                (first if r.n_replicas < held else ups).append(op)
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
    index = PoolIndex(snapshot.resources)
    deficit = _pool_deficits(index, ups)
    for job_id, d, action in in_place:
        p = index.pool_of(d.rank)
        short = deficit.get(p.pool_id, 0) if p is not None else None
        if short is None:  # a pool the resource map does not know: release first, as C1 cannot say
            first.append(teardown(job_id, d, action, 0.0))
            continue
        held = held_replicas(d)
        k = release_for(d.rank.config.gpus, held, p.gpus_per_instance, short)
        if k >= held:
            first.append(teardown(job_id, d, action, 0.0))
        else:
            if k > 0:  # rolling replacement: give back only what the launches lack, hand the rest over
                first.append(Op("scale", job_id, d.rank.model_copy(update={"n_replicas": held - k}), d.rank_id,
                                _key(cluster_id, tick, job_id, d.rank_id, "scale", epoch), n_replicas=held - k,
                                prev_replicas=held, detail={"action": action, "release": "partial"}))
            last.append(teardown(job_id, d, action, drain_s, handover=True))
        g, per = d.rank.config.gpus, p.gpus_per_instance
        deficit[p.pool_id] = max(short - (instances_for(g, held, per) - instances_for(g, held - k, per)), 0)
    return first + ups + last


def release_for(gpus_per_chain: int, held: int, gpus_per_instance: int, short: int) -> int:
    """The fewest replicas of a rank holding ``held`` to stop so that ``short`` instances come free
    (``held`` itself when even all of them do not free that many; 0 when nothing is short).

    Counted with C1's packing (:func:`koi.planning.capacity.instances_for`); the executor's scale-in
    stops whole instances first, so it frees what this counts."""
    if short <= 0 or held <= 0:
        return 0
    have = instances_for(gpus_per_chain, held, gpus_per_instance)
    for k in range(1, held):
        if have - instances_for(gpus_per_chain, held - k, gpus_per_instance) >= short:
            return k
    return held


def _pool_deficits(index: Any, ups: list[Op]) -> dict[str, int]:
    """Per pool, the instances the plan's launches and scale-ups there need beyond the pool's free
    ones (0: a swap in place there can be make-before-break in full). Releases of the first wave
    other than in-place swaps (preemptions, scale-downs, departures) are not counted: the deficit
    is an upper bound, so a rolling replacement never starves its own launch."""
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
    return {pid: max(need.get(pid, 0) - p.free_instances, 0) for pid, p in index.by_id.items()}


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
        if reported is not None:  # the world's state and replicas; the launch tick is ours
            rep = {d.rank_id: d for d in carry_since(reported, list(by_rank.values()))}
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

