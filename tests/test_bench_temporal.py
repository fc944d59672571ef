"""A benchmark run through Temporal equals the same run in process (issue 8, ``--via temporal``).

The demo scenario for three ticks under a learning policy (the pipeline's deterministic proposer with
S2 and S3 on): once with :func:`koi.bench.runner.run_one` (an in-process world, no checkpoints), once
with :func:`workers.bench.run_via_temporal` on the shared dev server (a worker in this process, the
ClusterWorkflow in simulated mode with the scenario's jobs in its queue, the world checkpointed in the
store between activities). Same seed, same cluster id: the committed plan of every tick, the trace and
every metric are identical.
"""

from __future__ import annotations

import pytest
from test_bench_runner import DET
from test_temporal_harness import client, temporal_env, unique  # noqa: F401 - fixtures

from koi.bench.cache import RunCache
from koi.bench.runner import run_one
from workers.bench import run_via_temporal

pytestmark = [pytest.mark.temporal, pytest.mark.slow]

HOURS = 0.25  # three ticks of the demo scenario


async def test_the_temporal_path_equals_the_in_process_path(client, tmp_path):  # noqa: F811 - fixtures
    cid = unique("bench-eq")
    via = await run_via_temporal("demo", DET, 2, hours=HOURS, client=client, cluster_id=cid, cache_dir=tmp_path)
    local = run_one("demo", DET, 2, hours=HOURS, cache_dir=tmp_path, fresh=True, cluster_id=cid)
    assert via.meta.via == "temporal" and local.meta.via == "in-process"
    assert via.meta.n_ticks == local.meta.n_ticks == 3
    assert via.meta.ticks_committed == 3 and local.meta.ticks_committed == 3
    assert all(p is not None for p in via.plans)
    assert via.plans == local.plans  # the committed plan of every tick
    assert via.trace == local.trace
    assert via.metrics == local.metrics
    assert via.jobs == local.jobs
    # cached apart: the Temporal run under runs-temporal/, the in-process one under runs/
    assert RunCache(tmp_path, via="temporal").load(via.key) is not None
    assert RunCache(tmp_path).load(local.key) is not None
