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
