"""Live mode: the cluster waits on a timer until t0 + n·interval (no drift), skipped in virtual time.

Uses the time-skipping dev server (``start_time_skipping_v2``): 300-second ticks pass in
a moment of wall time, and the ticks' start times are exactly one interval apart
however long each tick's activities took.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from test_temporal_harness import TEMPORAL, cluster_input, ledger_runtime, make_job, running_worker, unique

from workflows.cluster import ClusterWorkflow
from workflows.types import ClusterState, ClusterStatus

pytestmark = pytest.mark.temporal


async def test_live_mode_ticks_on_a_timer_without_drift(tmp_path):
    env = await WorkflowEnvironment.start_time_skipping_v2(
        dev_server_existing_path=TEMPORAL,
        dev_server_extra_args=["--dynamic-config-value", "frontend.WorkflowTimeSkippingEnabled=true"],
        data_converter=pydantic_data_converter,
    )
    rt = ledger_runtime(f"sqlite:///{tmp_path / 'koi.db'}", interval_s=300.0)
    cid, queue = unique("live"), unique("q")
    try:
        async with running_worker(env.client, rt, queue):
            h = await env.client.start_workflow(
                ClusterWorkflow.run,
                cluster_input(cid, queue, mode="live", interval_s=300.0, max_ticks=4, search_attributes=False),
                id=cid, task_queue=queue,
            )
            await h.signal("submit_job", make_job(0))
            await env.fast_forward(h)  # skip the timers until the workflow completes
            status: ClusterStatus = await env.client.get_workflow_handle(cid, result_type=ClusterStatus).result()
            state = await h.query("state_snapshot", result_type=ClusterState)
    finally:
        await env.shutdown()
        rt.engine.dispose()
    assert status.ticks_done == 4 and status.committed == 4
    starts = [b.started_at for b in state.recent]
    assert all(s is not None for s in starts)
    # tick n starts at t0 + n·interval (plus the seconds its world advance and job sync take),
    # however long the ticks before it took: the offsets do not accumulate
    assert state.epoch is not None
    offsets = [(st - state.epoch - timedelta(seconds=300 * n)).total_seconds() for n, st in enumerate(starts)]
    assert all(0 <= o < 5 for o in offsets), offsets
    gaps = [(b - a).total_seconds() for a, b in zip(starts, starts[1:], strict=False)]
    assert all(295 < g < 305 for g in gaps), gaps
