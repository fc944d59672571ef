"""End to end on a real dev server with the real stages: 5 ticks over the simulator; replay of recorded histories.

The histories of one cluster workflow and one tick workflow are kept under
``tests/fixtures/histories``; the replay test runs the current workflow code over them
(``temporalio.worker.Replayer``), so a change that breaks determinism of running
workflows fails here. Re-record them with ``KOI_RECORD_HISTORIES=1``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.worker import Replayer
from test_temporal_harness import (  # noqa: F401 - fixtures
    client,
    cluster_input,
    running_worker,
    temporal_env,
    unique,
)

from infra.sim import load_scenario, sim_world_provider
from koi.pipeline import Runtime
from koi.pipeline.messages import TickOutcome, TickResult
from koi.store import (
    get_evidence,
    get_plan_row,
    get_telemetry,
    init_db,
    list_ticks,
    make_engine,
    session_scope,
)
from workers.main import workflow_runner
from workflows import WORKFLOWS
from workflows.cluster import ClusterWorkflow
from workflows.types import ClusterStatus

pytestmark = [pytest.mark.temporal, pytest.mark.slow]

HISTORIES = Path(__file__).parent / "fixtures" / "histories"
STAGES = ["s0_snapshot", "s1_observe", "s2_validate", "s3_slow_update", "s4_plan", "s5_validate_plan", "s6_deploy",
          "finish_tick"]


@pytest.fixture
def sim_rt(tmp_path):
    eng = make_engine(f"sqlite:///{tmp_path / 'koi.db'}")
    init_db(eng)
    rt = Runtime(engine=eng, world=sim_world_provider(), interval_s=300.0)
    yield rt
    eng.dispose()


async def test_five_ticks_over_the_simulator(client, sim_rt):  # noqa: F811 - pytest fixtures
    cid, queue = unique("sim"), unique("q")
    jobs = sorted((j.job for j in load_scenario("demo").jobs), key=lambda j: j.submitted_at)
    async with running_worker(client, sim_rt, queue):
        h = await client.start_workflow(
            ClusterWorkflow.run,
            cluster_input(cid, queue, scenario="demo", interval_s=300.0, max_ticks=5, continue_as_new_every=3),
            id=cid, task_queue=queue,
        )
        for j in jobs:  # the workflow holds jobs whose arrival lies ahead of the cluster clock
            await h.signal("submit_job", j.model_dump(mode="json"))
        status: ClusterStatus = await client.get_workflow_handle(cid, result_type=ClusterStatus).result()
        results = [await client.get_workflow_handle(f"{cid}-tick-{n}", result_type=TickResult).result() for n in range(5)]
        if os.environ.get("KOI_RECORD_HISTORIES"):
            HISTORIES.mkdir(parents=True, exist_ok=True)
            first = client.get_workflow_handle(cid, run_id=h.result_run_id)
            (HISTORIES / "cluster_workflow.json").write_text((await first.fetch_history()).to_json())
            tick = client.get_workflow_handle(f"{cid}-tick-1")
            (HISTORIES / "tick_workflow.json").write_text((await tick.fetch_history()).to_json())
    assert status.ticks_done == 5 and status.committed == 5 and status.runs == 2
    assert [r.outcome for r in results] == [TickOutcome.COMMITTED] * 5
    assert results[0].deploy.launched >= 4  # the four jobs present at t=0 are placed
    assert all(r.observe.n_windows > 0 and r.observe.n_samples > 0 for r in results[1:])  # telemetry observed
    assert all(r.evidence.n_rows > 0 for r in results[1:])  # evidence written
    with session_scope(sim_rt.engine) as s:
        assert [t.status for t in list_ticks(s, cid)] == ["committed"] * 5
        assert all(get_plan_row(s, cid, n).committed for n in range(5))
        assert len(get_telemetry(s, cid, tick=2)) > 0 and len(get_evidence(s, cid, tick=2)) > 0
    # visible in the workflow history: every stage ran as its own activity, the outcome is in the memo
    events = [e async for e in client.get_workflow_handle(f"{cid}-tick-2").fetch_history_events()]
    names = [e.activity_task_scheduled_event_attributes.activity_type.name for e in events
             if e.HasField("activity_task_scheduled_event_attributes")]
    assert names == STAGES
    desc = await client.get_workflow_handle(f"{cid}-tick-2").describe()
    assert (await desc.memo())["outcome"] == "committed"
    # the cluster's history shows one child workflow per tick with deterministic ids
    events = [e async for e in client.get_workflow_handle(cid, run_id=h.result_run_id).fetch_history_events()]
    children = [e.start_child_workflow_execution_initiated_event_attributes.workflow_id for e in events
                if e.HasField("start_child_workflow_execution_initiated_event_attributes")]
    assert children == [f"{cid}-tick-{n}" for n in range(3)]


def _histories() -> list[Path]:
    return sorted(HISTORIES.glob("*.json"))


@pytest.mark.parametrize("path", _histories(), ids=lambda p: p.stem)
async def test_recorded_histories_replay_without_nondeterminism(path: Path):
    data = json.loads(path.read_text())
    workflow_id = data.get("events", [{}])[0].get("workflowExecutionStartedEventAttributes", {}).get(
        "workflowId", path.stem)
    history = WorkflowHistory.from_json(workflow_id, data)
    replayer = Replayer(workflows=WORKFLOWS, data_converter=pydantic_data_converter, workflow_runner=workflow_runner())
    result = await replayer.replay_workflow(history, raise_on_replay_failure=False)
    assert result.replay_failure is None, result.replay_failure


def test_history_fixtures_are_present():
    assert {p.stem for p in _histories()} >= {"cluster_workflow", "tick_workflow"}
