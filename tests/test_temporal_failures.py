"""Failures on a real dev server: retries, keep-all, reset of a failed deploy, the fence, continue-as-new."""

from __future__ import annotations

import asyncio
import json
import shlex
import threading

import pytest
from temporalio import activity
from test_temporal_harness import (  # noqa: F401 - fixtures
    TEMPORAL,
    client,
    cluster_input,
    edit_ledger,
    koi_cli,
    ledger_runtime,
    ledger_world,
    make_job,
    place_all,
    rank,
    running_worker,
    temporal_address,
    temporal_env,
    unique,
    wait_for,
)

from koi.pipeline import Verdict, stages
from koi.pipeline.messages import EvidenceSummary, StageRef, TickOutcome, TickResult
from koi.store import get_fence, get_plan_row, list_deploys, list_ticks, session_scope
from workers import ops
from workflows.cluster import ClusterWorkflow
from workflows.types import ClusterState, ClusterStatus, JobView

pytestmark = pytest.mark.temporal


@pytest.fixture
def rt(tmp_path):
    r = ledger_runtime(f"sqlite:///{tmp_path / 'koi.db'}")
    yield r
    r.engine.dispose()


def outcomes(rt, cid) -> list[str]:
    with session_scope(rt.engine) as s:
        return [t.status for t in list_ticks(s, cid)]


async def test_an_activity_failing_twice_is_retried_and_the_tick_commits(client, rt):  # noqa: F811 - pytest fixtures
    cid, queue = unique("c"), unique("q")
    calls = {"n": 0}
    lock = threading.Lock()

    @activity.defn(name="s2_validate")
    def flaky_s2(ref: StageRef) -> EvidenceSummary:
        with lock:
            calls["n"] += 1
            n = calls["n"]
        if n <= 2:
            raise RuntimeError(f"transient failure {n}")
        return stages.s2_validate(rt, ref)

    async with running_worker(client, rt, queue, overrides=[flaky_s2]):
        h = await client.start_workflow(ClusterWorkflow.run, cluster_input(cid, queue, max_ticks=1), id=cid,
                                        task_queue=queue)
        await h.signal("submit_job", make_job(0))
        status: ClusterStatus = await h.result()
    assert calls["n"] == 3 and status.committed == 1
    tick = await client.get_workflow_handle(f"{cid}-tick-0", result_type=TickResult).result()
    assert tick.outcome is TickOutcome.COMMITTED
    # the retries happened inside one activity: one scheduled event, attempt 3 started
    events = [e async for e in client.get_workflow_handle(f"{cid}-tick-0").fetch_history_events()]
    started = [e.activity_task_started_event_attributes.attempt for e in events
               if e.HasField("activity_task_started_event_attributes")]
    assert 3 in started


async def test_a_raising_or_invalid_planner_falls_back_and_the_cluster_keeps_ticking(client, rt):  # noqa: F811 - pytest fixtures
    cid, queue = unique("c"), unique("q")
    s4_calls: dict[int, int] = {}

    def flaky_planner(ctx):
        s4_calls[ctx.tick] = s4_calls.get(ctx.tick, 0) + 1
        if ctx.tick == 1:
            raise RuntimeError("planner exploded")
        return place_all(ctx)

    def picky(session, cluster_id, tick, snapshot, plan):
        if tick == 2:
            return Verdict(valid=False, plan=plan, violations=["C2: rank does not fit"])
        return Verdict(valid=True, plan=plan)

    rt.proposers["flaky"] = flaky_planner
    rt.validator = picky
    async with running_worker(client, rt, queue):
        h = await client.start_workflow(
            ClusterWorkflow.run, cluster_input(cid, queue, max_ticks=4, proposer="flaky"), id=cid, task_queue=queue
        )
        await h.signal("submit_job", make_job(0))
        await h.signal("submit_job", make_job(1, submitted_at=60.0))   # arrives at tick 1
        await h.signal("submit_job", make_job(2, submitted_at=120.0))  # arrives at tick 2
        status: ClusterStatus = await h.result()
    assert outcomes(rt, cid) == ["committed", "fallback", "fallback", "committed"]
    assert (status.committed, status.fallback) == (2, 2)
    r1 = await client.get_workflow_handle(f"{cid}-tick-1", result_type=TickResult).result()
    r2 = await client.get_workflow_handle(f"{cid}-tick-2", result_type=TickResult).result()
    assert r1.failed_stage == "s4_plan" and "planner exploded" in r1.reason
    assert r2.failed_stage == "s5_validate_plan" and "C2" in r2.reason and s4_calls[2] == 2  # one repair round
    assert "s4_plan.1" in r2.timings
    w = ledger_world(rt, cid)
    assert sorted(w.launches) == sorted(rank().rank_id(f"job-{i}") for i in range(3))  # tick 3 placed jobs 1, 2
    with session_scope(rt.engine) as s:
        assert get_fence(s, cid) == 3


async def test_a_failed_deploy_is_rolled_back_then_reset_and_completes(client, rt, temporal_env):  # noqa: F811 - pytest fixtures
    cid, queue = unique("c"), unique("q")
    # job-3's launch at tick 1 is refused after job-1's and job-2's went through: a partial deploy
    prepare_world(rt, cid, f"{cid}:1:job-3:")
    async with running_worker(client, rt, queue):
        h = await client.start_workflow(ClusterWorkflow.run, cluster_input(cid, queue, max_ticks=2), id=cid,
                                        task_queue=queue)
        await h.signal("submit_job", make_job(0))
        await h.signal("submit_job", make_job(2, submitted_at=60.0))
        await h.signal("submit_job", make_job(1, submitted_at=60.0))
        await h.signal("submit_job", make_job(3, submitted_at=60.0))
        await h.result()
        assert outcomes(rt, cid) == ["committed", "fallback"]
        r1 = await client.get_workflow_handle(f"{cid}-tick-1", result_type=TickResult).result()
        assert r1.failed_stage == "s6_deploy" and "LaunchRefused" in r1.reason
        assert r1.compensation.undone == 2  # job-1 and job-2 launched, then torn down
        w = ledger_world(rt, cid)
        assert sorted(w.ranks) == [rank().rank_id("job-0")]

        # ops fix the cause and reset the tick at the step that failed
        edit_ledger(rt, cid, lambda w: w.fail_launches.clear())
        code, stdout, stderr = await koi_cli(temporal_env, "reset-tick", "1", "--cluster", cid, "--json")
        assert code == 0, stderr
        out = json.loads(stdout)
        assert out["activity"] == "s6_deploy" and out["outcome"] == "committed", out
    w = ledger_world(rt, cid)
    assert sorted(w.ranks) == sorted(rank().rank_id(f"job-{i}") for i in range(4))
    assert all(n <= 2 for n in w.launches.values())  # launched, undone, relaunched at most
    with session_scope(rt.engine) as s:
        assert get_fence(s, cid) == 1 and get_plan_row(s, cid, 1).committed
        keys = [d.idempotency_key for d in list_deploys(s, cid, 1)]
    assert len(keys) == len(set(keys))
    expected = [(1, "committed", True), (0, "committed", False)]

    async def listed() -> bool:  # visibility is eventually consistent
        return [(r.tick, r.outcome, r.reset) for r in await ops.list_tick_records(client, cid)] == expected

    await wait_for(listed, timeout=30)


async def test_a_stale_reset_cannot_overwrite_a_newer_plan(client, rt, temporal_env):  # noqa: F811 - pytest fixtures
    cid, queue = unique("c"), unique("q")
    prepare_world(rt, cid, f"{cid}:1:job-1:")  # only tick 1's launch of job-1 is refused
    async with running_worker(client, rt, queue):
        h = await client.start_workflow(ClusterWorkflow.run, cluster_input(cid, queue, max_ticks=3), id=cid,
                                        task_queue=queue)
        await h.signal("submit_job", make_job(0))
        await h.signal("submit_job", make_job(1, submitted_at=60.0))
        await h.result()
        assert outcomes(rt, cid) == ["committed", "fallback", "committed"]  # tick 2 placed job-1
        # this time with the plain temporal CLI, at the event `koi reset-tick --dry-run` finds
        code, stdout, stderr = await koi_cli(temporal_env, "reset-tick", "1", "--cluster", cid, "--dry-run", "--json")
        assert code == 0, stderr
        point = json.loads(stdout)
        assert point["activity"] == "s6_deploy" and point["command"].startswith("temporal workflow reset")
        argv = shlex.split(point["command"]) + ["--address", temporal_address(temporal_env)]
        proc = await asyncio.create_subprocess_exec(TEMPORAL, *argv[1:], stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.PIPE)
        out_b, err_b = await proc.communicate()
        assert proc.returncode == 0, err_b.decode()
        res = await client.get_workflow_handle(f"{cid}-tick-1", result_type=TickResult).result()
        assert res.outcome is TickOutcome.FALLBACK and "StaleTick" in res.reason, res.reason
    with session_scope(rt.engine) as s:
        assert get_fence(s, cid) == 2 and get_plan_row(s, cid, 2).committed and not get_plan_row(s, cid, 1).committed
    w = ledger_world(rt, cid)
    assert w.launches == {rank().rank_id("job-0"): 1, rank().rank_id("job-1"): 1}


async def test_continue_as_new_carries_jobs_and_deployments(client, rt):  # noqa: F811 - pytest fixtures
    cid, queue = unique("c"), unique("q")
    async with running_worker(client, rt, queue):
        h = await client.start_workflow(
            ClusterWorkflow.run,
            cluster_input(cid, queue, max_ticks=5, continue_as_new_every=2, sim_pace_s=0.3),
            id=cid, task_queue=queue,
        )
        await h.signal("submit_job", make_job(0))
        await h.signal("submit_job", make_job(1, submitted_at=150.0))
        await h.signal("submit_job", make_job(2, submitted_at=230.0))
        status: ClusterStatus = await client.get_workflow_handle(cid, result_type=ClusterStatus).result()
        jobs = await client.get_workflow_handle(cid).query("jobs", result_type=list[JobView])
        state = await client.get_workflow_handle(cid).query("state_snapshot", result_type=ClusterState)
    assert status.runs == 3 and status.ticks_done == 5 and status.committed == 5
    assert {j.job_id: j.status for j in jobs} == {"job-0": "active", "job-1": "active", "job-2": "active"}
    assert sorted(d.job_id for d in state.deployments) == ["job-0", "job-1", "job-2"]
    assert [b.tick for b in state.recent] == [0, 1, 2, 3, 4]
    # the first run ended by continuing as new, carrying the state
    first = client.get_workflow_handle(cid, run_id=h.result_run_id)
    events = [e async for e in first.fetch_history_events()]
    assert events[-1].HasField("workflow_execution_continued_as_new_event_attributes")


def prepare_world(rt, cid: str, refuse: str) -> None:
    """Create the cluster's world before the workflow starts, refusing launches whose key contains ``refuse``."""
    from koi.pipeline.messages import EnsureWorldInput

    stages.ensure_world(rt, EnsureWorldInput(cluster_id=cid))
    edit_ledger(rt, cid, lambda w: w.fail_launches.add(refuse))
