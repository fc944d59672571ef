"""A worker process killed (SIGKILL) mid-deploy: another worker finishes the tick, nothing is deployed twice.

Real ``koi worker`` subprocesses share one SQLite store and the dev server; the
simulated world is checkpointed in the store, so the second worker continues from what
the first committed. Each launch takes 1.5 s (``--launch-delay``), so the test can catch
worker A between launches.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from test_temporal_harness import (  # noqa: F401 - fixtures
    client,
    cluster_input,
    env_for_subprocess,
    fast_options,
    temporal_env,
    unique,
    wait_for,
)

from infra.sim import load_scenario, restore_world
from koi.pipeline.messages import TickOutcome, TickResult
from koi.pipeline.world import decode_checkpoint, load_checkpoint
from koi.store import init_db, list_deploys, make_engine, session_scope
from workflows.cluster import ClusterWorkflow
from workflows.types import ClusterStatus, StagePolicy

pytestmark = [pytest.mark.temporal, pytest.mark.slow]

KOI = str(Path(sys.executable).parent / "koi")


def spawn_worker(env: dict[str, str], log: Path) -> subprocess.Popen:
    out = open(log, "ab")  # noqa: SIM115 - closed after Popen duplicated it
    try:
        return subprocess.Popen([KOI, "worker", "--launch-delay", "1.5"], env=env, stdout=out, stderr=subprocess.STDOUT)
    finally:
        out.close()


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)


async def test_a_killed_worker_mid_deploy_is_replaced_and_nothing_deploys_twice(client, temporal_env, tmp_path):  # noqa: F811 - pytest fixtures
    cid, queue = unique("kill"), unique("q")
    db = f"sqlite:///{tmp_path / 'koi.db'}"
    eng = make_engine(db)
    init_db(eng)
    env = env_for_subprocess(temporal_env, db, KOI_TICK_TASK_QUEUE=queue, KOI_PLAN_TASK_QUEUE=queue + "-plan",
                             KOI_LOG_LEVEL="INFO", KOI_DATA_DIR=str(tmp_path))
    opts = fast_options(policies={
        "s6_deploy": StagePolicy(start_to_close_s=120, heartbeat_s=10, max_attempts=5, initial_interval_s=0.5),
        "advance_world": StagePolicy(start_to_close_s=120, max_attempts=5, initial_interval_s=0.5),
        "s2_validate": StagePolicy(start_to_close_s=120, max_attempts=5, initial_interval_s=0.5),
    })
    a = spawn_worker(env, tmp_path / "worker-a.log")
    b: subprocess.Popen | None = None
    try:
        h = await client.start_workflow(
            ClusterWorkflow.run,
            cluster_input(cid, queue, scenario="demo", interval_s=300.0, max_ticks=2, tick_options=opts),
            id=cid, task_queue=queue,
        )
        for spec in load_scenario("demo").jobs:
            await h.signal("submit_job", spec.job.model_dump(mode="json"))

        def launched_at_tick0() -> int:
            with session_scope(eng) as s:
                return sum(1 for r in list_deploys(s, cid, 0) if r.status == "launched")

        await wait_for(lambda: launched_at_tick0() >= 1, timeout=120, interval=0.1)
        assert launched_at_tick0() < 4, "worker A finished the deploy before it could be killed"
        os.kill(a.pid, signal.SIGKILL)  # mid-deploy: some launches committed, others not
        a.wait(timeout=10)
        b = spawn_worker(env, tmp_path / "worker-b.log")
        status: ClusterStatus = await asyncio.wait_for(
            client.get_workflow_handle(cid, result_type=ClusterStatus).result(), timeout=240
        )
        tick0 = await client.get_workflow_handle(f"{cid}-tick-0", result_type=TickResult).result()
    finally:
        stop(a)
        if b is not None:
            stop(b)
    assert status.committed == 2 and tick0.outcome is TickOutcome.COMMITTED
    assert tick0.deploy.duplicates >= 1  # the retried S6 found worker A's committed launches
    events = [e async for e in client.get_workflow_handle(f"{cid}-tick-0").fetch_history_events()]
    s6_attempts = [e.activity_task_started_event_attributes.attempt for e in events
                   if e.HasField("activity_task_started_event_attributes")
                   and e.activity_task_started_event_attributes.attempt > 1]
    assert s6_attempts, "S6 was not retried on the second worker"
    log_a = (tmp_path / "worker-a.log").read_text()
    assert "s6_deploy" not in log_a or "activity.error" not in log_a, "worker A's S6 failed before the kill"
    with session_scope(eng) as s:
        rows = list_deploys(s, cid, 0)
        world = restore_world(decode_checkpoint(load_checkpoint(s, cid)[1]))
    assert len(rows) == len({r.idempotency_key for r in rows}) == tick0.deploy.launched + tick0.deploy.duplicates
    launches = Counter(e["rank_id"] for e in world.events() if e["kind"] == "launch")
    assert launches and max(launches.values()) == 1, launches  # nothing launched twice in the world
    eng.dispose()
