"""TrajectoryWorkflow on a real Temporal dev server: every turn is a pair of activities.

The model is a scripted policy (in-process); the trajectory runs ``rlm_start`` →
(``rlm_think`` → ``rlm_act``)× → ``rlm_finish`` on a worker, and the history shows the
code the model wrote (``rlm_act``'s input and summary) and what it printed (its result).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import uuid

import pytest
from temporalio.api.enums.v1 import EventType
from temporalio.worker import Worker
from test_temporal_harness import client, temporal_env  # noqa: F401 - fixtures

from activities import agent as agent_acts
from activities.agent import AgentActivities, candidate_stage, scripted_factory
from koi.agent import demo, scripted
from koi.agent.backend import ToolBackend
from koi.agent.messages import TrajectoryHandle
from koi.agent.planner import RlmReport
from koi.agent.sandbox import SandboxLimits
from koi.agent.trajectory import RlmConfig, TrajectoryState
from koi.config import Settings
from koi.domain import Plan
from koi.pipeline import Runtime
from koi.pipeline.messages import PlanSummary
from koi.store import init_db, make_engine, session_scope
from koi.store.repos.stages import Stage, load_stage_model, save_stage_output
from workers.main import workflow_runner
from workflows.trajectory import TrajectoryWorkflow
from workflows.types import TrajectoryInput

pytestmark = pytest.mark.temporal


def factory(session, cluster_id, tick, snapshot):
    return ToolBackend(snapshot, demo.context(tick))


@pytest.fixture
def rt(tmp_path):
    eng = make_engine(f"sqlite:///{tmp_path / 'koi.db'}")
    init_db(eng)
    snap = demo.snapshot(tick=3)
    with session_scope(eng) as s:
        save_stage_output(s, snap.cluster_id, snap.tick, Stage.S0_SNAPSHOT, snap, input_digest="")
    yield Runtime(engine=eng, world=None, seed=5)  # type: ignore[arg-type] - the trajectory needs no world
    eng.dispose()


async def run_trajectory(client, rt, policy, *, config=None, index=0):  # noqa: F811
    queue = f"agent-{uuid.uuid4().hex[:8]}"
    acts = AgentActivities(rt, model_factory=scripted_factory(policy), backend_factory=factory, settings=Settings(),
                           config=config or RlmConfig(sandbox=SandboxLimits(turn_timeout_s=10)))
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=4)
    worker = Worker(client, task_queue=queue, workflows=[TrajectoryWorkflow], activities=acts.all(),
                    activity_executor=pool, workflow_runner=workflow_runner(),
                    workflow_failure_exception_types=[Exception])
    async with worker:
        handle = await client.start_workflow(
            TrajectoryWorkflow.run,
            TrajectoryInput(cluster_id=demo.CLUSTER_ID, tick=3, attempt=0, index=index, proposer="rlm"),
            id=f"traj-{uuid.uuid4().hex[:8]}", task_queue=queue,
        )
        result = await asyncio.wait_for(handle.result(), timeout=180)
        history = await handle.fetch_history()
    pool.shutdown(wait=False)
    return result, history


async def test_each_turn_is_an_activity_showing_the_code_and_the_output(client, rt):  # noqa: F811
    result, history = await run_trajectory(client, rt, scripted.baseline_policy)
    assert isinstance(result, PlanSummary) and result.proposer == "rlm" and result.n_actions == 3
    scheduled = [e for e in history.events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_SCHEDULED]
    names = [e.activity_task_scheduled_event_attributes.activity_type.name for e in scheduled]
    assert names == ["rlm_start", "rlm_think", "rlm_act", "rlm_think", "rlm_act", "rlm_finish"]
    summaries = [e.user_metadata.summary.data.decode() for e in scheduled if e.user_metadata.summary.data]
    assert any("state = get_cluster_state()" in s for s in summaries)  # the code's first line
    act_inputs = [e.activity_task_scheduled_event_attributes.input.payloads[0].data.decode()
                  for e in scheduled if e.activity_task_scheduled_event_attributes.activity_type.name == "rlm_act"]
    assert "propose_baseline()" in act_inputs[1]  # the whole code is the activity's input
    completed = [e.activity_task_completed_event_attributes.result.payloads[0].data.decode()
                 for e in history.events if e.event_type == EventType.EVENT_TYPE_ACTIVITY_TASK_COMPLETED]
    assert any("capacity 44 of 48 GPUs free" in c for c in completed)  # what it printed
    with session_scope(rt.engine) as s:
        plan = load_stage_model(s, demo.CLUSTER_ID, 3, candidate_stage(0, 0), Plan)
        report = load_stage_model(s, demo.CLUSTER_ID, 3, "S4_rlm/a0/t0", RlmReport)
    assert plan is not None and factory(None, demo.CLUSTER_ID, 3, demo.snapshot(3)).validate(plan)["valid"]
    assert report.trajectories[0].status == "committed" and report.usage.calls == 2


async def test_a_lost_repl_is_rebuilt_from_the_stored_state(client, rt):  # noqa: F811
    """A turn that lands on a worker without the trajectory's REPL replays the code that ran."""

    def two_step(messages, meta):
        if scripted.turn_of(messages) == 0:
            return "```python\nbase = propose_baseline()\n```"
        agent_acts._RUNNERS.clear()  # the worker "restarted" between turns: no live REPL
        return "```python\nFINAL_VAR(base['plan'])\n```"

    result, _ = await run_trajectory(client, rt, two_step, index=1)
    assert result.n_actions == 3
    with session_scope(rt.engine) as s:
        state = load_stage_model(s, demo.CLUSTER_ID, 3, TrajectoryHandle(cluster_id=demo.CLUSTER_ID, tick=3,
                                                                         index=1).state_stage, TrajectoryState)
    assert state.status == "committed" and state.turns[1].error is None and state.turns[1].committed


async def test_the_invalid_policy_is_anchored_by_the_deterministic_plan(client, rt):  # noqa: F811
    result, _ = await run_trajectory(client, rt, scripted.invalid_policy, index=2)
    with session_scope(rt.engine) as s:
        report = load_stage_model(s, demo.CLUSTER_ID, 3, "S4_rlm/a0/t2", RlmReport)
    assert report.trajectories[0].status == "committed_invalid" and report.chosen_source == "deterministic"
    assert result.proposer == "deterministic"
