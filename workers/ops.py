"""Operations on a running cluster: submit, cancel, status, tick history, reset a tick, start, stop.

The ``koi`` CLI (``workers/commands/ops.py``) calls these; tests call them directly. Every
function takes a connected :class:`temporalio.client.Client`.

Resetting a tick (``koi reset-tick <n>``): a tick whose stage failed ended as
``fallback`` after keep-all compensation. Temporal's reset starts a new run of the
tick workflow from a chosen point of its history, replaying everything before it.
The point must be the ``WorkflowTaskCompleted`` event that *scheduled* the failed
activity: resetting there re-runs that activity. (A reset to ``LastWorkflowTask``
would replay the recorded failure and end the same way.) The deploy fence keeps a
reset honest: if a newer tick has committed since, the re-run S6 is refused and the
reset tick falls back again, leaving the newer plan in place.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import Any

from temporalio.api.common.v1 import WorkflowExecution
from temporalio.api.enums.v1 import EventType
from temporalio.api.workflowservice.v1 import ResetWorkflowExecutionRequest
from temporalio.client import Client, WorkflowExecutionStatus, WorkflowHandle
from temporalio.service import RPCError, RPCStatusCode

from koi.config import Settings, get_settings
from koi.pipeline.messages import TICK_STAGES, TickResult
from workflows.cluster import ClusterWorkflow
from workflows.types import ClusterInput, ClusterStatus, CurrentPlan, JobView, SubmitResult, TickOptions

#: Stages a reset may target (the tick's own; not compensation or bookkeeping).
RESETTABLE = tuple(s.value for s in TICK_STAGES) + ("s4_propose", "s4_select")


def tick_workflow_id(cluster_id: str, tick: int) -> str:
    return f"{cluster_id}-tick-{tick}"


# ---- jobs -------------------------------------------------------------------------------------------------
async def submit(client: Client, cluster_id: str, job: dict[str, Any], *, wait: bool = False) -> SubmitResult:
    """Signal a job (fire and forget), or with ``wait`` send the update and return accepted/rejected."""
    from temporalio.client import WorkflowUpdateFailedError

    h = client.get_workflow_handle(cluster_id)
    if not wait:
        await h.signal("submit_job", job)
        return SubmitResult(accepted=True, job_id=job.get("job_id"), reason="signalled (not validated yet)")
    try:
        return await h.execute_update("submit_job", job, result_type=SubmitResult)
    except WorkflowUpdateFailedError as err:
        cause = err.cause
        msg = getattr(cause, "message", None) or str(cause or err)
        return SubmitResult(accepted=False, job_id=job.get("job_id"), reason=msg)


async def cancel(client: Client, cluster_id: str, job_id: str) -> None:
    await client.get_workflow_handle(cluster_id).signal("cancel_job", job_id)


async def status(client: Client, cluster_id: str) -> ClusterStatus:
    return await client.get_workflow_handle(cluster_id).query("status", result_type=ClusterStatus)


async def jobs(client: Client, cluster_id: str) -> list[JobView]:
    return await client.get_workflow_handle(cluster_id).query("jobs", result_type=list[JobView])


async def current_plan(client: Client, cluster_id: str) -> CurrentPlan:
    return await client.get_workflow_handle(cluster_id).query("current_plan", result_type=CurrentPlan)


# ---- the cluster workflow ---------------------------------------------------------------------------------
async def start_cluster(
    client: Client,
    settings: Settings | None = None,
    *,
    cluster_id: str | None = None,
    mode: str = "simulated",
    scenario: str | None = None,
    interval_s: float | None = None,
    max_ticks: int | None = None,
    sim_pace_s: float = 0.0,
    proposer: str | None = None,
    search_attributes: bool | None = None,
    tick_options: TickOptions | None = None,
    seed: int | None = None,
) -> WorkflowHandle[Any, Any]:
    """Start the cluster workflow unless it already runs; returns its handle."""
    from workers.client import has_search_attributes

    s = settings or get_settings()
    cid = cluster_id or s.cluster_id
    h = client.get_workflow_handle(cid)
    try:
        desc = await h.describe()
        if desc.status == WorkflowExecutionStatus.RUNNING:
            return h
    except RPCError as err:
        if err.status != RPCStatusCode.NOT_FOUND:
            raise
    if search_attributes is None:
        search_attributes = await has_search_attributes(client)
    opts = tick_options or TickOptions(plan_task_queue=s.plan_task_queue)
    inp = ClusterInput(
        cluster_id=cid,
        mode=mode,  # type: ignore[arg-type]
        interval_s=interval_s or s.tick_interval_s,
        scenario=scenario,
        seed=seed,
        proposer=proposer,
        max_ticks=max_ticks,
        sim_pace_s=sim_pace_s,
        tick_task_queue=s.tick_task_queue,
        tick_options=opts,
        search_attributes=search_attributes,
    )
    return await client.start_workflow(ClusterWorkflow.run, inp, id=cid, task_queue=s.tick_task_queue)


async def stop_cluster(client: Client, cluster_id: str) -> None:
    await client.get_workflow_handle(cluster_id).signal("stop")


# ---- tick history -----------------------------------------------------------------------------------------
@dataclass
class TickRecord:
    tick: int
    outcome: str
    reason: str = ""
    workflow_id: str = ""
    run_id: str = ""
    status: str = ""
    started: str | None = None
    closed: str | None = None
    reset: bool = False

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


_STATUS_OUTCOME = {
    WorkflowExecutionStatus.FAILED: "failed",
    WorkflowExecutionStatus.TERMINATED: "failed",
    WorkflowExecutionStatus.TIMED_OUT: "failed",
    WorkflowExecutionStatus.CANCELED: "failed",
    WorkflowExecutionStatus.RUNNING: "running",
}


async def list_tick_records(client: Client, cluster_id: str, *, limit: int = 20) -> list[TickRecord]:
    """Recent ticks, newest first: outcome from the workflow's memo (committed, fallback), or
    ``failed`` when the tick workflow itself failed, ``running`` while it runs."""
    q = f"WorkflowType = 'TickWorkflow' AND WorkflowId STARTS_WITH '{cluster_id}-tick-'"
    out: dict[int, TickRecord] = {}
    async for wf in client.list_workflows(q, limit=limit * 3):
        try:
            n = int(wf.id.rsplit("-", 1)[1])
        except ValueError:
            continue
        memo = await wf.memo()
        outcome = _STATUS_OUTCOME.get(wf.status) or str(memo.get("outcome", "unknown"))  # type: ignore[arg-type]
        rec = TickRecord(
            tick=n,
            outcome=outcome,
            reason=str(memo.get("reason", "")),
            workflow_id=wf.id,
            run_id=wf.run_id,
            status=wf.status.name if wf.status else "",
            started=wf.start_time.isoformat() if wf.start_time else None,
            closed=wf.close_time.isoformat() if wf.close_time else None,
        )
        prev = out.get(n)
        if prev is None:
            out[n] = rec
        else:  # a reset tick has several runs: show the newest, flagged
            newer = rec if (rec.started or "") > (prev.started or "") else prev
            newer.reset = True
            out[n] = newer
    return sorted(out.values(), key=lambda r: r.tick, reverse=True)[:limit]


# ---- reset --------------------------------------------------------------------------------------------------
@dataclass
class ResetPoint:
    event_id: int  # the WorkflowTaskCompleted event that scheduled the activity
    activity: str
    scheduled_event_id: int
    failed: bool


async def find_reset_point(handle: WorkflowHandle[Any, Any], *, stage: str | None = None) -> ResetPoint:
    """Where to reset a tick so its failed step re-runs.

    Default: the last tick-stage activity that failed or timed out (after its retries).
    With ``stage``: the last scheduling of that stage's activity, failed or not (e.g. an
    invalid plan: ``--stage s4_plan`` re-plans).
    """
    scheduled: dict[int, tuple[str, int]] = {}
    failed: list[int] = []
    async for e in handle.fetch_history_events():
        if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED:
            a = e.activity_task_scheduled_event_attributes
            scheduled[e.event_id] = (a.activity_type.name, a.workflow_task_completed_event_id)
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_FAILED:
            failed.append(e.activity_task_failed_event_attributes.scheduled_event_id)
        elif e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_TIMED_OUT:
            failed.append(e.activity_task_timed_out_event_attributes.scheduled_event_id)
    if stage is not None:
        if stage not in RESETTABLE:
            raise ValueError(f"--stage must be one of {', '.join(RESETTABLE)}")
        hits = [sid for sid, (name, _) in scheduled.items() if name == stage]
        if not hits:
            raise LookupError(f"{handle.id}: stage {stage} never ran")
        sid = max(hits)
        return ResetPoint(event_id=scheduled[sid][1], activity=stage, scheduled_event_id=sid, failed=sid in failed)
    hits = [sid for sid in failed if sid in scheduled and scheduled[sid][0] in RESETTABLE]
    if not hits:
        raise LookupError(
            f"{handle.id} has no failed stage activity to re-run; pass --stage (e.g. s4_plan) or --event-id"
        )
    sid = max(hits)
    name, wft = scheduled[sid]
    return ResetPoint(event_id=wft, activity=name, scheduled_event_id=sid, failed=True)


async def reset_tick(
    client: Client,
    cluster_id: str,
    tick: int,
    *,
    stage: str | None = None,
    event_id: int | None = None,
    reason: str = "koi reset-tick",
    wait: bool = False,
    dry_run: bool = False,
) -> dict[str, Any]:
    """Reset tick ``tick`` so its failed stage runs again; returns the new run (and its result with ``wait``).

    ``dry_run``: only find the reset point and return the equivalent ``temporal workflow reset`` command.
    """
    wid = tick_workflow_id(cluster_id, tick)
    handle = client.get_workflow_handle(wid)
    desc = await handle.describe()
    if event_id is None:
        point = await find_reset_point(client.get_workflow_handle(wid, run_id=desc.run_id), stage=stage)
        event_id, activity = point.event_id, point.activity
    else:
        activity = "?"
    command = (f"temporal workflow reset --workflow-id {wid} --run-id {desc.run_id} --event-id {event_id} "
               f"--reason '{reason}'")
    if dry_run:
        return {"workflow_id": wid, "run_id": desc.run_id, "event_id": event_id, "activity": activity,
                "command": command}
    resp = await client.workflow_service.reset_workflow_execution(
        ResetWorkflowExecutionRequest(
            namespace=client.namespace,
            workflow_execution=WorkflowExecution(workflow_id=wid, run_id=desc.run_id),
            reason=reason,
            workflow_task_finish_event_id=event_id,
            request_id=str(uuid.uuid4()),
        )
    )
    out: dict[str, Any] = {
        "workflow_id": wid, "previous_run_id": desc.run_id, "run_id": resp.run_id, "event_id": event_id,
        "activity": activity,
    }
    if wait:
        res: TickResult = await client.get_workflow_handle(wid, run_id=resp.run_id, result_type=TickResult).result()
        out["outcome"] = res.outcome.value
        out["reason"] = res.reason
    return out
