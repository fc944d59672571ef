"""S3 on the store: Beta fan-out then the slow loop, persisted per tick.

``run_s3(session, cluster_id, tick)`` is what the S3 Temporal activity calls (through
``koi.pipeline``). Beliefs at t are computed from the stored beliefs as of t − 1 and the
stored evidence of t, and written as the rows that changed; the slow state at t from
the stored slow state as of t − 1. Re-running S3 for t therefore recomputes the same
values and upserts the same rows (whitepaper "Tick Algorithm": S3 idempotent).

Slow-loop inputs resolved from the store when the caller does not pass them:
- outcomes: PerfDB records of the last ``w_window`` ticks (observed Y of each rank), with
  the job's class from the jobs table;
- swaps: ladder-carrying actions for jobs that were active at t − 1 in the plan committed
  at t − 1, over the active jobs of t − 1's snapshot (no committed plan: zero swaps);
- coverage: each PerfDB record of t is checked against the DRO bands the plan of t − 1 was made
  with, at ε_{t−1}: the surrogate fitted on the records before t, its corrected prediction and its
  prequential residuals; an online job's latencies, a batch job's throughput
  (:mod:`koi.calibration.coverage`). A planner that keeps its own band checks should pass them
  in instead.
"""

from __future__ import annotations

from typing import Any

from sqlmodel import Session

from koi.calibration.coverage import band_coverage
from koi.calibration.slow import OutcomeObservation, SlowInputs, initial_slow_state, slow_update
from koi.calibration.state import CoveragePoint, SlowConfig, SlowState, SwapPoint
from koi.causal.graph import CausalGraph
from koi.causal.updates import BeliefState, UpdateTables, apply_evidence
from koi.domain.cluster import ClusterSnapshot
from koi.domain.common import JobClass
from koi.logging import get_logger

log = get_logger(__name__)

def load_slow(session: Session, cluster_id: str, tick: int, config: SlowConfig | None = None) -> SlowState:
    """The slow state after ``tick`` (the initial state before the first one)."""
    from koi.store import load_slow_state_as

    if tick >= 0:
        st = load_slow_state_as(session, cluster_id, SlowState, tick)
        if st is not None:
            return st
    return initial_slow_state(cluster_id, config)


def load_outcomes(session: Session, cluster_id: str, tick: int, window: int) -> list[OutcomeObservation]:
    from koi.store import get_jobs, query_perf

    classes = {j.job.job_id: j.job.job_class for j in get_jobs(session, cluster_id)}
    out = []
    for r in query_perf(session, cluster_id=cluster_id, since_tick=max(0, tick - window + 1)):
        if r.tick > tick or not r.observed_y:
            continue
        out.append(OutcomeObservation(tick=r.tick, job_id=r.job_id, job_class=classes.get(r.job_id, JobClass.ONLINE),
                                      values=dict(r.observed_y)))
    return out


def load_swaps(session: Session, cluster_id: str, tick: int) -> SwapPoint | None:
    from koi.store import Stage, get_plan, get_plan_row, load_stage_model

    if tick <= 0:
        return None
    snap = load_stage_model(session, cluster_id, tick - 1, Stage.S0_SNAPSHOT, ClusterSnapshot)
    if snap is None:
        return None
    active = {j.job.job_id for j in snap.active_jobs}
    row = get_plan_row(session, cluster_id, tick - 1)
    n = 0
    if row is not None and row.committed:
        plan = get_plan(session, cluster_id, tick - 1)
        n = sum(1 for a in plan.actions if a.carries_ladder and a.job_id in active) if plan else 0
    return SwapPoint(tick=tick, n_swapped=n, n_active=len(active))


def load_coverage(session: Session, cluster_id: str, tick: int, eps: float) -> CoveragePoint | None:
    """κ_t's band check of the records of ``tick`` (:mod:`koi.calibration.coverage`) against the surrogate
    fitted on the records before it — the one the plan of t − 1 was made with (S4 of t − 1 fitted the
    same records, so :func:`koi.planning.tick.predictor_for_records` usually has it)."""
    from koi.planning.tick import predictor_for_records
    from koi.store import get_jobs, query_perf

    records = query_perf(session, cluster_id=cluster_id)
    now = [r for r in records if r.tick == tick]
    if not now:
        return None
    surrogate = predictor_for_records([r for r in records if r.tick < tick]).surrogate  # type: ignore[attr-defined]
    batch = {j.job.job_id for j in get_jobs(session, cluster_id) if j.job.job_class is JobClass.BATCH}
    return band_coverage(surrogate.residuals, now, tick, eps, batch)


def run_beliefs(session: Session, cluster_id: str, tick: int, *, tables: UpdateTables | None = None,
                graph: CausalGraph | None = None) -> tuple[BeliefState, BeliefState]:
    """The Beta fan-out of S3: (beliefs as of t − 1, beliefs after t), the changed rows persisted."""
    from koi.causal.store import load_beliefs, load_registry, save_beliefs
    from koi.store import get_evidence

    registry = load_registry(session, cluster_id, tick - 1)
    prev = load_beliefs(session, cluster_id, tick - 1, registry, graph)
    rows = get_evidence(session, cluster_id, tick)
    new = apply_evidence(prev, rows, tick=tick, mechanisms=registry, tables=tables, graph=graph)
    save_beliefs(session, prev, new, registry)
    return prev, new


def run_slow(
    session: Session,
    cluster_id: str,
    tick: int,
    *,
    config: SlowConfig | None = None,
    swaps: SwapPoint | None = None,
    coverage: CoveragePoint | None = None,
    outcomes: list[OutcomeObservation] | None = None,
) -> SlowState:
    """The slow loop of S3 for ``tick``, persisted."""
    from koi.store import get_evidence, save_slow_state

    cfg = config or SlowConfig()
    prev = load_slow(session, cluster_id, tick - 1, cfg)
    if outcomes is None:
        outcomes = load_outcomes(session, cluster_id, tick, cfg.w_window)
    if swaps is None:
        swaps = load_swaps(session, cluster_id, tick)
    if coverage is None:
        coverage = load_coverage(session, cluster_id, tick, prev.epsilon)
    inputs = SlowInputs(tick=tick, evidence=get_evidence(session, cluster_id, tick), outcomes=outcomes,
                        swaps=swaps, coverage=coverage)
    state = slow_update(prev, inputs, cfg)
    save_slow_state(session, cluster_id, tick, state)
    return state


def run_s3(session: Session, cluster_id: str, tick: int, **kwargs: Any) -> dict[str, Any]:
    """S3: Beta fan-out (every decided row × mechanism), then the slow loop. Returns a small summary."""
    belief_kw = {k: kwargs.pop(k) for k in ("tables", "graph") if k in kwargs}
    prev, new = run_beliefs(session, cluster_id, tick, **belief_kw)
    state = run_slow(session, cluster_id, tick, **kwargs)
    n_e = sum(1 for k, b in new.edges.items() if prev.edges.get(k) != b)
    n_m = sum(1 for k, b in new.mechanisms.items() if prev.mechanisms.get(k) != b)
    return {
        "tick": tick, "edges_updated": n_e, "mechanisms_updated": n_m,
        "q1_rate": state.q if state.q is not None else 0.0, "regret": state.regret if state.regret is not None else 1.0,
        "beta": state.beta, "swap_budget": state.swap_budget, "lambda_swit": state.lambda_swit, "epsilon": state.epsilon,
    }
