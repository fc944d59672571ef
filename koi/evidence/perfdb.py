"""PerfDB: what each serving rank did in ``(t−1, t]`` against the physics (S1 writes it).

The surrogate's residual learner (:meth:`koi.surrogate.Surrogate.from_records`) and the slow
loop's outcome and DRO-coverage inputs read these records. S1 writes them right after the
telemetry, so S3 of the same tick sees them (the spec's order: observe, validate, update).

One :class:`koi.store.PerfRecord` per rank that served the whole window (:func:`served_windows`):
the window's mean of every V and Y (``observed_v``/``observed_y``) and ``predicted`` = the
**base** surrogate (physics alone, nothing learned), which is what ``ResidualModel.fit`` inverts.

Choice: the base prediction is made at the rank's *observed* served rate (throughput / mean
output length, with the replicas that were up), the load at which the residual learner probes
the physics for that record (``koi.surrogate.residual.physics_curves``), so the speed inversion
compares like with like. A window without output (throughput 0) or without a finished request
(p99 TPOT 0) carries no speed evidence and is skipped. Records are keyed by (cluster, tick,
rank), so writing a tick twice changes nothing.

Choice: an online rank that was *overloaded* in the window (:func:`overloaded`: its engines'
waiting queue at least a quarter of ``max_num_seqs``, or any queue behind a full batch) gives
no record. Offered more than it can serve, it has no steady state: its p99 TTFT grows with the
time the overload has lasted and its TPOT with the preemption storms of a full KV pool, not
with the chain. Inverted, such windows read as a GPU three times slower and a job whose TTFT
is three times the physics' (the clip), and those effects follow the GPU and the job to every
other chain. Measured on hetero-3h (Koi, seed 2): a split ladder that lost a spot node to a
reclaim overloaded its other rank; its windows taught the learner that every ladder of that
job breaches, and the job kept the overloaded ladder for the rest of the run (15% of its
requests on time). The planner sees such a rank through its degraded replicas and the demand it
cannot carry, not through PerfDB. Batch ranks run saturated by design and are kept.

Choice: a batch rank's record leaves out p99 TTFT (:data:`koi.variables.NOT_COMPARABLE`), as
``koi learn`` always did: its telemetry counts a batch request's TTFT from the job's submission
(hetero-3h: 13–28 minutes observed against the physics' steady state, ratios 0.6–39×), and the
output learner would carry that, clipped at ×3, into the GPU- and environment-level TTFT
corrections of every online job on the same hardware.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from koi import variables
from koi.domain import ClusterSnapshot, Deployment, JobClass, JobState, TelemetryWindow

#: Full windows a rank must have served before its window becomes a record (:func:`served_windows`).
SETTLED_WINDOWS = 2
#: Quantities a record keeps (what PerfRecord accepts).
_ALLOWED = frozenset(variables.V_NAMES + variables.Y_NAMES)


@dataclass(frozen=True)
class Served:
    """One rank's telemetry window of ``(t−1, t]`` from a rank that served the whole window."""

    window: TelemetryWindow
    deployment: Deployment  # as of tick t
    job: JobState  # as of tick t − 1 (the job may have finished since)
    replicas: int  # replicas that were up at both ends of the window


def previous_snapshot(session: Any, cluster_id: str, tick: int) -> ClusterSnapshot | None:
    from koi.store import Stage, load_stage_model

    if tick <= 0:
        return None
    return load_stage_model(session, cluster_id, tick - 1, Stage.S0_SNAPSHOT, ClusterSnapshot)


def served_windows(session: Any, cluster_id: str, tick: int, snapshot: ClusterSnapshot, *,
                   settled: int = 1) -> list[Served]:
    """This tick's windows (S1 stored them under ``tick``) of ranks that were serving at t − 1 and
    still are at t, with the same chain. A rank launched during the window spent part of it
    booting (its gauges hold 0 until the first request), so its first full window is the next one:
    the rule ``koi learn`` uses. Sorted by rank id.

    ``settled`` > 1 also asks the rank to have been serving at t − 2 … t − settled: its first
    full window still carries the launch's transient (the requests that queued while it booted
    or while its ladder was swapped, and the telemetry's 120-s trailing p99 window reaching back
    into the boot). Measured on hetero-3h (Koi, seed 0, 2.5 h): the p90 of log(observed/predicted)
    p99 TTFT is 1.59 on ranks' first full windows against 0.57 on later ones, and the median of
    second windows 0.16 against 0.055 — a learner fed first windows marks every fresh deployment
    as slow, so the ladder it just chose looks worse than untried ones (PerfDB uses 2).

    A rank the last plan **resized** (the same chain and id, another replica count) whose model loads
    for longer than :data:`HANDOVER_S` (the switching model's cold start: weights per node over the
    load bandwidth, plus warm-up) is skipped for that window: it holds the handover. On homo-12h (Koi,
    seed 3) agent-235b's shared rank went 6 → 3 replicas in a swap and carried the job alone while the
    new rank loaded a 235B model (~5 min); its window (p99 TTFT ~100 s) made the next keep's observed
    risk 1, the plan swapped back, and the two ladders alternated every tick for the last 12 (23
    swaps undone by the next tick in that run, `benchmarks/undone_swaps.py`). A model that loads in a
    minute or two has no such window: the one after its resize is the resize's own effect, and not
    reading it cost hetero-3h 0.17–0.32 (skipping every resized rank, for one window or two).
    """
    from koi.domain.cluster import DeploymentState
    from koi.store import get_telemetry

    prev = previous_snapshot(session, cluster_id, tick)
    if prev is None:
        return []
    up = (DeploymentState.SERVING, DeploymentState.DEGRADED)
    before = {d.rank_id: d for d in prev.deployments if d.state in up and d.replicas_ready >= 1}
    for back in range(2, max(settled, 1) + 1):
        older = previous_snapshot(session, cluster_id, tick - back + 1) if tick - back >= 0 else None
        if older is None:
            return []
        live = {d.rank_id for d in older.deployments if d.state in up and d.replicas_ready >= 1}
        before = {k: v for k, v in before.items() if k in live}
    now = {d.rank_id: d for d in snapshot.deployments if d.state in up and d.replicas_ready >= 1}
    jobs = {js.job.job_id: js for js in prev.jobs}
    out = []
    for w in sorted(get_telemetry(session, cluster_id, tick), key=lambda w: w.rank_id):
        d0, d1 = before.get(w.rank_id), now.get(w.rank_id)
        if d0 is None or d1 is None or w.n_samples == 0 or w.job_id not in jobs:
            continue
        if d0.rank.n_replicas != d1.rank.n_replicas and _long_handover(jobs[w.job_id].job.model, d1):
            continue  # resized by the last plan while a model that loads for most of a window: a handover
        out.append(Served(window=w, deployment=d1, job=jobs[w.job_id],
                          replicas=min(d0.replicas_ready, d1.replicas_ready)))
    return out


#: A resize whose model loads for longer than this (the switching model's cold start) leaves a handover window.
HANDOVER_S = 150.0


def _long_handover(model: str, d: Deployment) -> bool:
    from koi import catalog
    from koi.scoring.switching import SwitchParams, cold_start_seconds

    try:
        arch = catalog.model(model)
    except catalog.CatalogError:
        return False
    return cold_start_seconds(arch, d.rank, SwitchParams()) > HANDOVER_S


def window_means(w: TelemetryWindow) -> tuple[dict[str, float], dict[str, float]]:
    """(observed V, observed Y): the window's mean of every series, split by kind."""
    from koi import variables

    v: dict[str, float] = {}
    y: dict[str, float] = {}
    for name, xs in sorted(w.series.items()):
        if xs:
            (v if variables.kind_of(name) is variables.Kind.V else y)[name] = float(np.mean(xs))
    return v, y



#: An online rank's window is overloaded when its engines' mean waiting queue is at least this
#: share of ``max_num_seqs`` (or a queue of at least one behind a batch ≥ FULL_BATCH of it).
OVERLOAD_QUEUE_SHARE = 0.25
FULL_BATCH = 0.9


def overloaded(observed_v: dict[str, float], max_num_seqs: int) -> bool:
    """Was a rank's window past its steady state (module docstring)? Per-engine means."""
    q = observed_v.get("queue_depth", 0.0)
    b = observed_v.get("live_batch_size", 0.0)
    return q >= max(4.0, OVERLOAD_QUEUE_SHARE * max_num_seqs) or (q >= 1.0 and b >= FULL_BATCH * max_num_seqs)


def _tick_recorded(session: Any, cluster_id: str, tick: int) -> bool:
    from koi.store import query_perf

    return any(r.tick == tick for r in query_perf(session, cluster_id=cluster_id, since_tick=tick))


def build_records(session: Any, cluster_id: str, tick: int, snapshot: ClusterSnapshot) -> list[Any]:
    """The PerfRecords of ``tick`` (not saved)."""
    from koi.store import PerfRecord
    from koi.surrogate import default_surrogate

    sur = default_surrogate()
    out = []
    for sv in served_windows(session, cluster_id, tick, snapshot, settled=SETTLED_WINDOWS):
        ov, oy = window_means(sv.window)
        thr = oy.get("throughput_tokens_per_sec", 0.0)
        tpot = oy.get("p99_tpot_ms", 0.0)
        job = sv.job.job
        if thr <= 0 or tpot <= 0 or sv.replicas < 1:
            continue
        if job.job_class is JobClass.ONLINE and overloaded(ov, sv.deployment.rank.config.max_num_seqs):
            continue
        rank = sv.deployment.rank.model_copy(update={"n_replicas": sv.replicas})
        lam = thr / max(float(job.workload.osl), 1.0)
        try:
            b = sur.predict_many(job, [rank.chain], offered_rps=lam, n_replicas=rank.n_replicas, with_capacity=False)
        except Exception:  # noqa: BLE001 - a rank the physics cannot replay contributes no record
            continue
        if not bool(b.feasible[0]):
            continue
        drop = variables.NOT_COMPARABLE.get(job.job_class, frozenset())
        oy = {k: v for k, v in oy.items() if k not in drop}
        base = {k: float(v[0]) for k, v in b.base_values.items()
                if k in _ALLOWED and k not in drop and math.isfinite(float(v[0]))}
        out.append(PerfRecord.of(cluster_id, tick, job, rank, observed_v=ov, observed_y=oy, predicted=base,
                                 n_samples=sv.window.n_samples))
    return out


def record_perf(session: Any, cluster_id: str, tick: int, snapshot: ClusterSnapshot | None = None) -> int:
    """Write tick ``tick``'s PerfDB records unless the tick already has some; returns how many were written."""
    from koi.store import Stage, load_stage_model, save_perf_records

    if tick <= 0 or _tick_recorded(session, cluster_id, tick):
        return 0
    if snapshot is None:
        snapshot = load_stage_model(session, cluster_id, tick, Stage.S0_SNAPSHOT, ClusterSnapshot)
        if snapshot is None:
            return 0
    records = build_records(session, cluster_id, tick, snapshot)
    if records:
        save_perf_records(session, records)
    return len(records)
