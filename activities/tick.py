"""The tick's activities: thin wrappers over :mod:`koi.pipeline.stages` and :mod:`koi.pipeline.deploy`.

Each activity takes a small reference (cluster, tick, attempt), lets the stage load
its inputs from the store, run, and persist its output, and returns the stage's small
summary. Errors are translated once here: an input error (missing stage output, a
stale tick, a refused launch, a pydantic validation error) becomes a non-retryable
``ApplicationError`` whose type names the error; anything else is raised as is and
retried by the stage's retry policy.

Activities are synchronous (the stages are CPU and database work) and run in the
worker's thread pool; long ones heartbeat through ``Runtime.heartbeat``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar

from temporalio import activity
from temporalio.exceptions import ApplicationError

from infra.metrics import METRICS, KoiMetrics
from koi.logging import get_logger
from koi.pipeline import deploy, stages
from koi.pipeline.errors import InputError, describe, is_retryable
from koi.pipeline.messages import (
    AdvanceInput,
    CompensationSummary,
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
    ValidationSummary,
    WorldSummary,
)
from koi.pipeline.runtime import Runtime

log = get_logger(__name__)
T = TypeVar("T")


def heartbeat(*details: Any) -> None:
    """Heartbeat when running inside an activity; a no-op elsewhere."""
    if activity.in_activity():
        activity.heartbeat(*details)


def translate(fn: Callable[..., T]) -> Callable[..., T]:
    """Run a stage; raise input errors as non-retryable ApplicationErrors."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> T:
        info = activity.info() if activity.in_activity() else None
        bound = log.bind(activity=fn.__name__, attempt=info.attempt if info else None)
        try:
            return fn(*args, **kwargs)
        except ApplicationError:
            raise
        except Exception as exc:
            kind = getattr(exc, "kind", None) if isinstance(exc, InputError) else type(exc).__name__
            message = describe(exc)
            if not is_retryable(exc):
                bound.warning("activity.input_error", error=message[:1000], kind=kind)
                raise ApplicationError(message[:4000], type=kind, non_retryable=True) from exc
            bound.warning("activity.error", error=message[:1000], kind=kind, exc_info=exc)
            raise ApplicationError(message[:4000], type=kind) from exc  # retryable

    return wrapper


class TickActivities:
    """The activities of a worker, bound to one :class:`Runtime`."""

    def __init__(self, runtime: Runtime, metrics: KoiMetrics = METRICS) -> None:
        self.rt, self.metrics = runtime, metrics
        runtime.heartbeat = heartbeat

    @activity.defn(name="sync_jobs")
    @translate
    def sync_jobs(self, inp: SyncJobsInput) -> SyncJobsSummary:
        return stages.sync_jobs(self.rt, inp)

    @activity.defn(name="ensure_world")
    @translate
    def ensure_world(self, inp: EnsureWorldInput) -> WorldSummary:
        return stages.ensure_world(self.rt, inp)

    @activity.defn(name="advance_world")
    @translate
    def advance_world(self, inp: AdvanceInput) -> WorldSummary:
        return stages.advance_world(self.rt, inp)

    @activity.defn(name="s0_snapshot")
    @translate
    def s0_snapshot(self, ref: StageRef) -> SnapshotSummary:
        return stages.s0_snapshot(self.rt, ref)

    @activity.defn(name="s1_observe")
    @translate
    def s1_observe(self, ref: StageRef) -> ObserveSummary:
        out = stages.s1_observe(self.rt, ref)
        self.metrics.record("s1_observe", lambda: self.metrics.observed(ref.cluster_id, out))
        return out

    @activity.defn(name="s2_validate")
    @translate
    def s2_validate(self, ref: StageRef) -> EvidenceSummary:
        return stages.s2_validate(self.rt, ref)

    @activity.defn(name="s3_slow_update")
    @translate
    def s3_slow_update(self, ref: StageRef) -> SlowSummary:
        return stages.s3_slow_update(self.rt, ref)

    @activity.defn(name="s5_validate_plan")
    @translate
    def s5_validate_plan(self, ref: StageRef) -> ValidationSummary:
        return stages.s5_validate_plan(self.rt, ref)

    @activity.defn(name="s6_deploy")
    @translate
    def s6_deploy(self, ref: StageRef) -> DeploySummary:
        out = deploy.s6_deploy(self.rt, ref)
        self.metrics.record("s6_deploy", lambda: self.metrics.deployed(ref.cluster_id, out))
        return out

    @activity.defn(name="compensate_keep_all")
    @translate
    def compensate_keep_all(self, ref: StageRef, reason: str) -> CompensationSummary:
        return deploy.compensate_keep_all(self.rt, ref, reason)

    @activity.defn(name="finish_tick")
    @translate
    def finish_tick(self, inp: FinishInput) -> FinishSummary:
        out = stages.finish_tick(self.rt, inp)
        self.metrics.record("finish_tick", lambda: self.metrics.finished(inp, out))
        return out

    def all(self) -> list[Callable[..., Any]]:
        return [
            self.sync_jobs, self.ensure_world, self.advance_world, self.s0_snapshot, self.s1_observe,
            self.s2_validate, self.s3_slow_update, self.s5_validate_plan, self.s6_deploy,
            self.compensate_keep_all, self.finish_tick,
        ]


class PlanningActivities:
    """S4 — the planner — on its own task queue (LLM calls are slow and rate-limited)."""

    def __init__(self, runtime: Runtime) -> None:
        self.rt = runtime
        runtime.heartbeat = heartbeat

    @activity.defn(name="s4_plan")
    @translate
    def s4_plan(self, ref: StageRef) -> PlanSummary:
        return stages.s4_plan(self.rt, ref)

    @activity.defn(name="s4_propose")
    @translate
    def s4_propose(self, ref: StageRef, index: int) -> PlanSummary:
        return stages.s4_propose(self.rt, ref, index)

    @activity.defn(name="s4_select")
    @translate
    def s4_select(self, ref: StageRef, candidates: list[int]) -> PlanSummary:
        return stages.s4_select(self.rt, ref, candidates)

    def all(self) -> list[Callable[..., Any]]:
        return [self.s4_plan, self.s4_propose, self.s4_select]
