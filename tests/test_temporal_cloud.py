"""The cluster workflow on a real Temporal dev server driving a real cloud API (EC2 on moto's server): ticks launch
instances, jobs arrive by signal, and the store and the cloud agree."""

from __future__ import annotations

from collections import Counter

import pytest
from test_temporal_harness import (  # noqa: F401 - fixtures
    ENV,
    always_valid,
    client,
    cluster_input,
    make_job,
    place_all,
    running_worker,
    temporal_env,
    unique,
)

from infra.cloud import CloudWorldProvider, FleetSpec
from koi.domain import Pool
from koi.pipeline import Runtime
from koi.store import init_db, list_deploys, make_engine, session_scope
from workflows.cluster import ClusterWorkflow
from workflows.types import ClusterStatus

pytestmark = pytest.mark.temporal


@pytest.fixture
def rt(tmp_path, ec2_factory):
    spec = FleetSpec(pools=[Pool(env=ENV, instance_type="g6.xlarge", gpus_per_instance=1, total_instances=8,
                                 free_instances=8, hourly_price=0.8)], image_id="ami-0123456789abcdef0")
    eng = make_engine(f"sqlite:///{tmp_path / 'koi.db'}")
    init_db(eng)
    r = Runtime(engine=eng, world=CloudWorldProvider(spec, client_factory=ec2_factory, scrape=False),
                proposers={"place_all": place_all}, default_proposer="place_all", validator=always_valid,
                s2=lambda s, c, t: {"rows": 0}, s3=lambda s, c, t: {"updated": 0}, interval_s=60.0)
    yield r
    eng.dispose()


async def test_the_cluster_workflow_launches_on_ec2(client, rt, ec2_factory):  # noqa: F811 - pytest fixtures
    cid, queue = unique("c"), unique("q")
    async with running_worker(client, rt, queue):
        h = await client.start_workflow(
            ClusterWorkflow.run, cluster_input(cid, queue, max_ticks=3, sim_pace_s=0.5), id=cid, task_queue=queue
        )
        await h.signal("submit_job", make_job(0))
        await h.signal("submit_job", make_job(1))
        status: ClusterStatus = await h.result()
    assert status.committed == 3 and status.fallback == 0 and status.deployments == 2
    pages = ec2_factory(ENV.region).get_paginator("describe_instances").paginate(
        Filters=[{"Name": "tag:koi:cluster", "Values": [cid]}, {"Name": "instance-state-name", "Values": ["running"]}])
    tags = [{t["Key"]: t["Value"] for t in i["Tags"]} for p in pages for r in p["Reservations"] for i in r["Instances"]]
    assert Counter(t["koi:job"] for t in tags) == {"job-0": 1, "job-1": 1}  # one launch each, however many ticks
    with session_scope(rt.engine) as s:
        launches = [d for d in list_deploys(s, cid) if d.detail.get("op") == "launch"]
    assert sorted(d.job_id for d in launches) == ["job-0", "job-1"]
    # the worker's own metrics (infra/metrics.py) counted what it ran
    from infra.metrics import METRICS

    def value(name: str, **labels: str) -> float | None:
        return METRICS.registry.get_sample_value(name, {"cluster": cid, **labels})

    assert value("koi_ticks_total", outcome="committed") == 3 and value("koi_tick_last") == 2
    assert value("koi_deploy_ops_total", op="launched") == 2 and value("koi_ranks") == 2
    assert value("koi_gpus_in_use") == 2 and value("koi_tick_stage_seconds_count", stage="s0_snapshot") == 3


async def test_koi_worker_serves_its_metrics(client, rt):  # noqa: F811 - pytest fixtures
    """``run_worker`` with ``metrics_port`` (``koi worker --metrics-port``) serves the process's metrics over HTTP."""
    import asyncio
    import socket

    import httpx

    from koi.config import get_settings
    from workers.main import run_worker

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    s = get_settings().model_copy(update={"metrics_port": port, "metrics_addr": "127.0.0.1",
                                          "tick_task_queue": unique("q"), "plan_task_queue": unique("p")})
    stop = asyncio.Event()
    task = asyncio.create_task(run_worker(rt, queues=("ticks",), settings=s, client=client, stop=stop))
    try:
        async with httpx.AsyncClient() as http:
            for _ in range(100):
                try:
                    r = await http.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
                    break
                except httpx.HTTPError:
                    await asyncio.sleep(0.1)
        assert r.status_code == 200 and "# TYPE koi_ticks_total counter" in r.text
    finally:
        stop.set()
        await task
