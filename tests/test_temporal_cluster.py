"""The cluster workflow on a real dev server: ticks, messages, keep-all, retries, continue-as-new."""

from __future__ import annotations

import pytest
from temporalio.client import WorkflowUpdateFailedError
from test_temporal_harness import (  # noqa: F401 - fixtures
    client,
    cluster_input,
    ledger_runtime,
    ledger_world,
    make_job,
    running_worker,
    temporal_env,
    unique,
    wait_for,
)

from koi.pipeline.messages import TickOutcome, TickResult
from koi.store import get_fence, list_ticks, session_scope
from workflows.cluster import ClusterWorkflow
from workflows.types import ClusterStatus, JobView, SubmitResult

pytestmark = pytest.mark.temporal


@pytest.fixture
def rt(tmp_path):
    r = ledger_runtime(f"sqlite:///{tmp_path / 'koi.db'}")
    yield r
    r.engine.dispose()


async def test_ticks_commit_and_jobs_flow_through_signals_and_updates(client, rt):  # noqa: F811 - pytest fixtures
    cid, queue = unique("c"), unique("q")
    async with running_worker(client, rt, queue):
        h = await client.start_workflow(
            ClusterWorkflow.run, cluster_input(cid, queue, max_ticks=3, sim_pace_s=0.5), id=cid, task_queue=queue
        )
        await h.signal("submit_job", make_job(0))
        res = await h.execute_update("submit_job", make_job(1), result_type=SubmitResult)
        assert res.accepted and res.job_id == "job-1"
        status: ClusterStatus = await h.result()
    assert status.ticks_done == 3 and status.committed == 3 and status.fallback == 0
    assert status.jobs == {"active": 2} and status.deployments == 2
    w = ledger_world(rt, cid)
    assert all(n == 1 for n in w.launches.values()) and len(w.launches) == 2
    with session_scope(rt.engine) as s:
        assert [t.status for t in list_ticks(s, cid)] == ["committed"] * 3
        assert get_fence(s, cid) == 2
    tick0 = await client.get_workflow_handle(f"{cid}-tick-0", result_type=TickResult).result()
    assert tick0.outcome is TickOutcome.COMMITTED


async def test_bad_update_is_rejected_and_bad_signal_dropped(client, rt):  # noqa: F811 - pytest fixtures
    cid, queue = unique("c"), unique("q")
    async with running_worker(client, rt, queue):
        h = await client.start_workflow(
            ClusterWorkflow.run, cluster_input(cid, queue, max_ticks=2, sim_pace_s=1.0), id=cid, task_queue=queue
        )
        bad = make_job("bad")
        bad["slo"] = {"p99_ttft_ms": -1}
        with pytest.raises(WorkflowUpdateFailedError) as info:
            await h.execute_update("submit_job", bad, result_type=SubmitResult)
        assert "p99_ttft_ms" in str(info.value.cause)
        await h.signal("submit_job", {"job_id": "x", "model": "no-such-model"})
        await h.signal("submit_job", make_job(2))
        await h.signal("cancel_job", "nope")
        with pytest.raises(WorkflowUpdateFailedError):  # a duplicate is rejected too
            await h.execute_update("submit_job", make_job(2), result_type=SubmitResult)
        status: ClusterStatus = await h.result()
        jobs = await h.query("jobs", result_type=list[JobView])
    assert status.dropped_signals == 2 and status.committed == 2
    assert [j.job_id for j in jobs] == ["job-2"] and jobs[0].status == "active"
    # the rejected update left no trace in history
    events = [e async for e in h.fetch_history_events()]
    accepted = [e for e in events if e.HasField("workflow_execution_update_accepted_event_attributes")]
    assert accepted == []


async def test_ops_cli_submit_status_ticks(client, rt, temporal_env, tmp_path):  # noqa: F811 - pytest fixtures
    import json

    import yaml
    from test_temporal_harness import koi_cli

    cid, queue = unique("c"), unique("q")
    good, bad = tmp_path / "job.yaml", tmp_path / "bad.yaml"
    good.write_text(yaml.safe_dump(make_job("cli")))
    broken = make_job("broken")
    broken["job_class"] = "batch"  # a batch job without a deadline
    bad.write_text(yaml.safe_dump(broken))
    async with running_worker(client, rt, queue):
        h = await client.start_workflow(
            ClusterWorkflow.run, cluster_input(cid, queue, sim_pace_s=1.0), id=cid, task_queue=queue
        )
        code, out, err = await koi_cli(temporal_env, "submit", str(good), "--cluster", cid, "--wait", "--json")
        assert code == 0, err
        assert json.loads(out)[0]["accepted"] is True
        code, out, err = await koi_cli(temporal_env, "submit", str(bad), "--cluster", cid, "--wait", "--no-check", "--json")
        assert code == 1 and "deadline_s" in json.loads(out)[0]["reason"]
        code, out, err = await koi_cli(temporal_env, "submit", str(bad), "--cluster", cid)  # checked locally first
        assert code == 2 and "nothing sent" in err
        while True:  # until a tick has placed the job
            code, out, err = await koi_cli(temporal_env, "status", "--cluster", cid, "--json")
            assert code == 0, err
            if json.loads(out)["jobs"] == {"active": 1}:
                break
        code, out, err = await koi_cli(temporal_env, "cluster", "stop", "--cluster", cid)
        assert code == 0, err
        final: ClusterStatus = await h.result()
        n = final.ticks_done
        assert final.committed == n and final.stopping and final.jobs == {"active": 1}
        expected = [(t, "committed") for t in reversed(range(n))]
        for _ in range(10):  # visibility is eventually consistent
            code, out, err = await koi_cli(temporal_env, "ticks", "--cluster", cid, "--limit", "200", "--json")
            if [(r["tick"], r["outcome"]) for r in json.loads(out)] == expected:
                break
        assert [(r["tick"], r["outcome"]) for r in json.loads(out)] == expected
        code, out, err = await koi_cli(temporal_env, "current-plan", "--cluster", cid, "--json")
        assert code == 0, err
        assert json.loads(out)["tick"] == n - 1 and len(json.loads(out)["deployments"]) == 1


async def test_planner_trajectories_run_as_child_workflows(client, rt):  # noqa: F811 - pytest fixtures
    from test_temporal_harness import fast_options

    cid, queue = unique("c"), unique("q")
    async with running_worker(client, rt, queue):
        h = await client.start_workflow(
            ClusterWorkflow.run, cluster_input(cid, queue, max_ticks=1, tick_options=fast_options(trajectories=3)),
            id=cid, task_queue=queue,
        )
        await h.signal("submit_job", make_job(0))
        status: ClusterStatus = await h.result()
    assert status.committed == 1
    events = [e async for e in client.get_workflow_handle(f"{cid}-tick-0").fetch_history_events()]
    children = [e.start_child_workflow_execution_initiated_event_attributes.workflow_id for e in events
                if e.HasField("start_child_workflow_execution_initiated_event_attributes")]
    assert children == [f"{cid}-tick-0-a0-traj-{k}" for k in range(3)]
    names = [e.activity_task_scheduled_event_attributes.activity_type.name for e in events
             if e.HasField("activity_task_scheduled_event_attributes")]
    assert "s4_select" in names and "s4_plan" not in names


async def test_the_plain_temporal_cli_signals_updates_and_queries(client, rt, temporal_env):  # noqa: F811
    import asyncio
    import json

    from test_temporal_harness import TEMPORAL, temporal_address

    async def temporal(*args: str) -> tuple[int, str, str]:
        proc = await asyncio.create_subprocess_exec(TEMPORAL, *args, "--address", temporal_address(temporal_env),
                                                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        return proc.returncode or 0, out.decode(), err.decode()

    cid, queue = unique("c"), unique("q")
    async with running_worker(client, rt, queue):
        h = await client.start_workflow(
            ClusterWorkflow.run, cluster_input(cid, queue, max_ticks=2, sim_pace_s=4.0), id=cid, task_queue=queue
        )
        code, _, err = await temporal("workflow", "signal", "--workflow-id", cid, "--name", "submit_job",
                                      "--input", json.dumps(make_job("t1")))
        assert code == 0, err
        code, out, err = await temporal("workflow", "update", "execute", "--workflow-id", cid, "--name", "submit_job",
                                        "--input", json.dumps({"job_id": "t2", "model": "llama-3.1-8b"}))
        assert code != 0 and "workload" in (out + err)  # rejected by the validator, with the reason
        await h.result()
        code, out, err = await temporal("workflow", "query", "--workflow-id", cid, "--name", "status", "-o", "json")
        assert code == 0, err

    def find(obj):  # the status document, wherever the CLI's JSON envelope puts it
        if isinstance(obj, dict):
            if "committed" in obj and "next_tick" in obj:
                return obj
            obj = list(obj.values())
        if isinstance(obj, list):
            for v in obj:
                if (hit := find(v)) is not None:
                    return hit
        return None

    status = find(json.loads(out))
    assert status is not None and status["committed"] == 2 and status["jobs"] == {"active": 1}, out
