"""TickWorkflow: one planning tick, S0–S6, with keep-all compensation.

    S0 snapshot → S1 observe → S2 validate → S3 slow update
    → S4 plan → S5 validate plan (invalid and repairable: S4 again, once) → S6 deploy
    any failure in S0–S6 (after the stage's retries), or a plan still invalid
    → compensate_keep_all (a partial deploy is rolled back) → outcome "fallback"
    finally → finish_tick records the outcome in the store

S4 is one activity for the deterministic proposer; the RLM planner's trajectories (and
any multi-proposal S4) run as child ``TrajectoryWorkflow``s (``workflows/trajectory.py``)
followed by the ``s4_select`` activity.

Each stage is an activity called by name (the activities live in ``activities/``),
with its own timeout and retry policy (:class:`workflows.types.StagePolicy`). The
outcome is the workflow's result (:class:`koi.pipeline.messages.TickResult`), its
memo (``outcome``, ``reason``) and — when the server has them registered — the
search attributes ``KoiOutcome`` and ``KoiTick``, so ticks show their outcome in the UI.

A reset run (``koi reset-tick``) reports its result to the cluster workflow with the
``tick_reset_result`` signal, since the parent already consumed the first run's.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributeKey
from temporalio.exceptions import ApplicationError, FailureError

with workflow.unsafe.imports_passed_through():
    from koi.pipeline.messages import (
        CompensationSummary,
        DeploySummary,
        EvidenceSummary,
        FinishInput,
        FinishSummary,
        ObserveSummary,
        PlanSummary,
        SlowSummary,
        SnapshotSummary,
        StageName,
        StageRef,
        TickOutcome,
        TickResult,
        ValidationSummary,
    )
    from workflows.trajectory import TrajectoryWorkflow, is_rlm
    from workflows.types import TickInput, TickOptions, TrajectoryInput

OUTCOME_KEY = SearchAttributeKey.for_keyword("KoiOutcome")
TICK_KEY = SearchAttributeKey.for_int("KoiTick")
CLUSTER_KEY = SearchAttributeKey.for_keyword("KoiCluster")


def activity_options(options: TickOptions, name: str) -> dict[str, Any]:
    p = options.policy(name)
    return {
        "start_to_close_timeout": timedelta(seconds=p.start_to_close_s),
        "heartbeat_timeout": timedelta(seconds=p.heartbeat_s) if p.heartbeat_s else None,
        "retry_policy": RetryPolicy(
            initial_interval=timedelta(seconds=p.initial_interval_s),
            backoff_coefficient=p.backoff,
            maximum_interval=timedelta(seconds=max(p.max_interval_s, p.initial_interval_s)),
            maximum_attempts=p.max_attempts,
        ),
    }


def failure_message(err: BaseException) -> str:
    """The innermost message of a Temporal failure chain (the activity's own error)."""
    parts: list[str] = []
    cur: BaseException | None = err
    while cur is not None:
        msg = getattr(cur, "message", None) or str(cur)
        kind = getattr(cur, "type", None)
        if isinstance(cur, ApplicationError) and kind:
            parts.append(f"{kind}: {msg}")
        elif msg and not parts:
            parts.append(msg)
        cur = cur.__cause__
    return parts[-1] if parts else type(err).__name__


class PlanInvalidError(ApplicationError):
    pass


@workflow.defn
class TickWorkflow:
    def __init__(self) -> None:
        self._stage: str = "pending"
        self._result: TickResult | None = None

    @workflow.query
    def stage(self) -> str:
        return self._stage

    async def _activity(self, inp: TickInput, name: str, arg: Any, result_type: type, *, queue: str | None = None) -> Any:
        self._stage = name
        workflow.set_current_details(f"tick {inp.tick}: **{name}**")
        return await workflow.execute_activity(
            name,
            arg,
            result_type=result_type,
            task_queue=queue or workflow.info().task_queue,
            summary=name,
            **activity_options(inp.options, name),
        )

    async def _plan(self, inp: TickInput, ref: StageRef) -> PlanSummary:
        queue = inp.options.plan_task_queue
        if inp.options.trajectories <= 1 and not is_rlm(inp.proposer):
            return await self._activity(inp, StageName.S4_PLAN.value, ref, PlanSummary, queue=queue)
        # planner trajectories (the RLM planner, or several proposals), each a child workflow on the
        # planning queue; then one selection among their candidates (deterministic code decides)
        self._stage = StageName.S4_PLAN.value
        handles = []
        for k in range(inp.options.trajectories):
            handles.append(
                await workflow.start_child_workflow(
                    TrajectoryWorkflow.run,
                    TrajectoryInput(
                        cluster_id=inp.cluster_id, tick=inp.tick, attempt=ref.attempt, index=k,
                        proposer=inp.proposer, options=inp.options,
                    ),
                    id=f"{workflow.info().workflow_id}-a{ref.attempt}-traj-{k}",
                    task_queue=queue or workflow.info().task_queue,
                    static_summary=f"tick {inp.tick} trajectory {k}",
                )
            )
        candidates: list[int] = []
        for k, h in enumerate(handles):
            try:
                await h
                candidates.append(k)
            except FailureError as err:  # one failed trajectory is not a failed tick
                workflow.logger.warning("trajectory %d of tick %d failed: %s", k, inp.tick, failure_message(err))
        if not candidates:
            raise ApplicationError("every planner trajectory failed", type="PlannerFailed", non_retryable=True)
        return await workflow.execute_activity(
            "s4_select",
            args=[ref, candidates],
            result_type=PlanSummary,
            task_queue=queue or workflow.info().task_queue,
            summary="s4_select",
            **activity_options(inp.options, StageName.S4_PLAN.value),
        )

    @workflow.run
    async def run(self, inp: TickInput) -> TickResult:
        ref = StageRef(cluster_id=inp.cluster_id, tick=inp.tick, proposer=inp.proposer)
        res = TickResult(cluster_id=inp.cluster_id, tick=inp.tick, outcome=TickOutcome.RUNNING, proposer=inp.proposer)
        timings: dict[str, float] = {}
        started = workflow.now()

        async def timed(key: str, coro: Any) -> Any:
            t0 = workflow.now()
            try:
                return await coro
            finally:
                timings[key] = round((workflow.now() - t0).total_seconds(), 3)

        try:
            res.snapshot = await timed("s0_snapshot", self._activity(inp, "s0_snapshot", ref, SnapshotSummary))
            res.observe = await timed("s1_observe", self._activity(inp, "s1_observe", ref, ObserveSummary))
            res.evidence = await timed("s2_validate", self._activity(inp, "s2_validate", ref, EvidenceSummary))
            await timed("s3_slow_update", self._activity(inp, "s3_slow_update", ref, SlowSummary))
            for attempt in range(inp.options.max_repairs + 1):
                r = ref.model_copy(update={"attempt": attempt})
                sfx = "" if attempt == 0 else f".{attempt}"
                res.plan = await timed("s4_plan" + sfx, self._plan(inp, r))
                res.validation = await timed(
                    "s5_validate_plan" + sfx, self._activity(inp, "s5_validate_plan", r, ValidationSummary)
                )
                if res.validation.valid or not res.validation.repairable:
                    break
            if res.validation is None or not res.validation.valid:
                v = res.validation
                raise PlanInvalidError(
                    f"plan invalid after {(v.attempt + 1) if v else 0} attempt(s): "
                    + "; ".join((v.violations if v else [])[:5]),
                    type="PlanInvalid",
                    non_retryable=True,
                )
            res.deploy = await timed("s6_deploy", self._activity(inp, "s6_deploy", ref, DeploySummary))
            res.outcome = TickOutcome.COMMITTED
        except FailureError as err:  # an activity's final failure, or an invalid plan: keep-all
            res.failed_stage = self._stage
            res.reason = f"{self._stage}: {failure_message(err)}"[:2000]
            workflow.logger.warning("tick %d falls back to keep-all: %s", inp.tick, res.reason)
            self._stage = "compensate_keep_all"
            workflow.set_current_details(f"tick {inp.tick}: **keep-all compensation**\n\n{res.reason[:500]}")
            res.compensation = await timed(
                "compensate_keep_all",
                workflow.execute_activity(
                    "compensate_keep_all",
                    args=[ref, res.reason],
                    result_type=CompensationSummary,
                    summary="compensate_keep_all",
                    **activity_options(inp.options, "compensate_keep_all"),
                ),
            )
            res.outcome = TickOutcome.FALLBACK
        timings["total"] = round((workflow.now() - started).total_seconds(), 3)
        res.timings = timings
        self._stage = "finish_tick"
        fin: FinishSummary = await self._activity(
            inp,
            "finish_tick",
            FinishInput(cluster_id=inp.cluster_id, tick=inp.tick, outcome=res.outcome, reason=res.reason, timings=timings),
            FinishSummary,
        )
        res.deployments, res.job_status, res.world_now = fin.deployments, fin.job_status, fin.world_now
        self._stage = "done"
        self._publish(inp, res)
        await self._report_reset(res)
        self._result = res
        return res

    def _publish(self, inp: TickInput, res: TickResult) -> None:
        workflow.upsert_memo({"outcome": res.outcome.value, "reason": res.reason[:500], "tick": inp.tick})
        detail = f"tick {inp.tick}: **{res.outcome.value}**"
        if res.reason:
            detail += f"\n\n{res.reason[:500]}"
        if res.deploy is not None:
            detail += f"\n\nlaunched {res.deploy.launched}, scaled {res.deploy.scaled}, torn down {res.deploy.torn_down}"
        workflow.set_current_details(detail)
        if inp.search_attributes:
            workflow.upsert_search_attributes(
                [
                    OUTCOME_KEY.value_set(res.outcome.value),
                    TICK_KEY.value_set(inp.tick),
                    CLUSTER_KEY.value_set(inp.cluster_id),
                ]
            )

    async def _report_reset(self, res: TickResult) -> None:
        info = workflow.info()
        if info.parent is None or info.run_id == info.original_execution_run_id:
            return
        try:
            await workflow.get_external_workflow_handle(info.parent.workflow_id).signal("tick_reset_result", res)
        except FailureError as err:  # the cluster may have moved on (continued-as-new, finished)
            workflow.logger.info("could not report the reset tick to the cluster: %s", failure_message(err))
