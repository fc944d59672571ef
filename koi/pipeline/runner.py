"""The in-process tick runner: the TickWorkflow's semantics without Temporal.

Benchmarks and tests call :func:`run_tick` (one tick) or :func:`run_ticks` (a
cluster's loop: sync jobs, tick, advance the world). The control flow mirrors
``workflows/tick.py`` exactly:

    S0 snapshot → S1 observe → S2 validate → S3 slow update
    → S4 plan → S5 validate plan (not valid and repairable: S4 again with S5's
      objections, once) → S6 deploy → committed
    any failure in S0–S6, or a plan still invalid after the repair round
    → keep-all compensation → fallback (reason recorded)

Transient errors are retried in place like the workflow's retry policies
(``retries`` extra attempts, no back-off); input errors are not.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from koi.domain import Job
from koi.logging import get_logger
from koi.pipeline import deploy, stages
from koi.pipeline.errors import InputError, describe, is_retryable
from koi.pipeline.messages import (
    AdvanceInput,
    EnsureWorldInput,
    FinishInput,
    StageName,
    StageRef,
    SyncJobsInput,
    TickOutcome,
    TickResult,
)
from koi.pipeline.runtime import Proposer, Runtime

log = get_logger(__name__)

#: How many repair rounds S5 may send back to S4 (the spec: one).
MAX_REPAIRS = 1


class PlanInvalid(InputError):
    kind = "PlanInvalid"


def _call(fn: Callable[..., Any], *args: Any, retries: int) -> Any:
    attempt = 0
    while True:
        try:
            return fn(*args)
        except Exception as exc:
            if attempt >= retries or not is_retryable(exc):
                raise
            attempt += 1
            log.warning("stage.retry", stage=getattr(fn, "__name__", "?"), attempt=attempt, error=str(exc)[:200])


def run_tick(
    rt: Runtime,
    cluster_id: str,
    tick: int,
    *,
    proposer: str | Proposer | None = None,
    retries: int = 2,
) -> TickResult:
    """Run one tick in this process; never raises for a stage failure (the tick falls back)."""
    name: str | None
    if callable(proposer):
        name = getattr(proposer, "__name__", "custom")
        rt.proposers[name] = proposer
    else:
        name = proposer
    ref = StageRef(cluster_id=cluster_id, tick=tick, proposer=name)
    res = TickResult(cluster_id=cluster_id, tick=tick, outcome=TickOutcome.RUNNING, proposer=name or rt.default_proposer)
    timings: dict[str, float] = {}
    current = StageName.S0_SNAPSHOT

    def step(stage: StageName, fn: Callable[..., Any], r: StageRef) -> Any:
        nonlocal current
        current = stage
        t0 = time.perf_counter()
        try:
            return _call(fn, rt, r, retries=retries)
        finally:
            key = stage.value if r.attempt == 0 else f"{stage.value}.{r.attempt}"
            timings[key] = round(time.perf_counter() - t0, 6)

    t_start = time.perf_counter()
    try:
        res.snapshot = step(StageName.S0_SNAPSHOT, stages.s0_snapshot, ref)
        res.observe = step(StageName.S1_OBSERVE, stages.s1_observe, ref)
        res.evidence = step(StageName.S2_VALIDATE, stages.s2_validate, ref)
        step(StageName.S3_SLOW_UPDATE, stages.s3_slow_update, ref)
        for attempt in range(MAX_REPAIRS + 1):
            r = ref.model_copy(update={"attempt": attempt})
            res.plan = step(StageName.S4_PLAN, stages.s4_plan, r)
            res.validation = step(StageName.S5_VALIDATE_PLAN, stages.s5_validate_plan, r)
            if res.validation.valid or not res.validation.repairable:
                break
        assert res.validation is not None
        if not res.validation.valid:
            current = StageName.S5_VALIDATE_PLAN
            raise PlanInvalid(
                f"plan invalid after {res.validation.attempt + 1} attempt(s): " + "; ".join(res.validation.violations[:5])
            )
        res.deploy = step(StageName.S6_DEPLOY, deploy.s6_deploy, ref)
        res.outcome = TickOutcome.COMMITTED
    except Exception as exc:  # any failure in S0–S6: keep-all
        res.failed_stage = current.value
        res.reason = f"{current.value}: {type(exc).__name__}: {describe(exc)}"[:2000]
        log.warning("tick.fallback", cluster=cluster_id, tick=tick, stage=current.value, error=str(exc)[:500])
        t0 = time.perf_counter()
        res.compensation = _call(deploy.compensate_keep_all, rt, ref, res.reason, retries=retries)
        timings[StageName.COMPENSATE.value] = round(time.perf_counter() - t0, 6)
        res.outcome = TickOutcome.FALLBACK
    timings["total"] = round(time.perf_counter() - t_start, 6)
    res.timings = timings
    fin = _call(
        stages.finish_tick,
        rt,
        FinishInput(cluster_id=cluster_id, tick=tick, outcome=res.outcome, reason=res.reason, timings=timings),
        retries=retries,
    )
    res.deployments, res.job_status, res.world_now = fin.deployments, fin.job_status, fin.world_now
    return res


def run_ticks(
    rt: Runtime,
    cluster_id: str,
    n_ticks: int,
    *,
    jobs: Iterable[Job | dict[str, Any]] = (),
    start_tick: int = 0,
    scenario: str | None = None,
    seed: int | None = None,
    proposer: str | Proposer | None = None,
    on_tick: Callable[[TickResult], None] | None = None,
) -> list[TickResult]:
    """A cluster's loop in this process: ensure the world, store the jobs, tick, advance.

    Jobs may be given up front: S0 only shows a job once the world's clock reaches
    its ``submitted_at`` (its arrival). Tick n runs at world time t0 + n·interval.
    """
    w = stages.ensure_world(rt, EnsureWorldInput(cluster_id=cluster_id, scenario=scenario, seed=seed))
    payload = [j.model_dump(mode="json") if isinstance(j, Job) else dict(j) for j in jobs]
    if payload:
        stages.sync_jobs(rt, SyncJobsInput(cluster_id=cluster_id, tick=start_tick, jobs=payload))
    t0 = w.now - w.tick * rt.interval_s  # tick n runs at t0 + n·interval
    out: list[TickResult] = []
    for n in range(start_tick, start_tick + n_ticks):
        res = run_tick(rt, cluster_id, n, proposer=proposer)
        out.append(res)
        if on_tick is not None:
            on_tick(res)
        stages.advance_world(rt, AdvanceInput(cluster_id=cluster_id, tick=n + 1, t_target=t0 + (n + 1) * rt.interval_s))
    return out
