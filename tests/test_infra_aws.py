"""The EC2 executor against moto's real HTTP server on loopback: tags, capacity, idempotency, restarts."""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest

from infra.aws import T_SPEC, Ec2Fleet, client_token, rank_from_tags, spec_tags, tag_value
from koi.domain import ChainConfig, DeploymentState, Environment, Pool, Rank, ResourceMap
from koi.ports import LaunchStatus
from tests.fakes.jobs import chat_job

REGION = "us-east-1"
IMAGE = "ami-0123456789abcdef0"
ON_DEMAND = Environment(cloud="aws", region=REGION, zone="us-east-1a", market="on_demand", gpu_type="H100")
SPOT = Environment(cloud="aws", region=REGION, zone="use1-az1", market="spot", gpu_type="L4")  # an AZ id
BAD_ZONE = Environment(cloud="aws", region=REGION, zone="us-east-1z", market="on_demand", gpu_type="L4")


@pytest.fixture(scope="module")
def client_factory(ec2_factory) -> Callable[[str], Any]:
    return ec2_factory  # moto's server on loopback (tests/conftest.py)


@pytest.fixture
def cluster() -> str:
    return f"c-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def fleet(cluster: str, client_factory) -> Ec2Fleet:
    return Ec2Fleet(cluster, pools(), client_factory=client_factory, image_id=IMAGE, clock=lambda: 1234.5)


def pools(p5: int = 6, g6: int = 4) -> ResourceMap:
    return ResourceMap(pools=[
        Pool(env=ON_DEMAND, instance_type="p5.48xlarge", gpus_per_instance=8, total_instances=p5,
             free_instances=p5, hourly_price=55.04),
        Pool(env=SPOT, instance_type="g6.xlarge", gpus_per_instance=1, total_instances=g6, free_instances=g6,
             hourly_price=0.35),
        Pool(env=BAD_ZONE, instance_type="g6.xlarge", gpus_per_instance=1, total_instances=4, free_instances=4,
             hourly_price=0.8),
    ])


job = chat_job  # tests/fakes/jobs.py


def big(n: int = 1, **kw: Any) -> Rank:
    """16 GPUs per replica on 8-GPU p5 instances: two instances per replica."""
    return Rank(env=ON_DEMAND, config=ChainConfig(instance_type="p5.48xlarge", tp=8, pp=2), n_replicas=n, **kw)


def small(n: int = 1, env: Environment = SPOT) -> Rank:
    return Rank(env=env, config=ChainConfig(instance_type="g6.xlarge"), n_replicas=n)


def instances(factory, cluster: str, live: bool = True) -> list[dict[str, Any]]:
    filters = [{"Name": "tag:koi:cluster", "Values": [cluster]}]
    if live:
        filters.append({"Name": "instance-state-name", "Values": ["pending", "running"]})
    pages = factory(REGION).get_paginator("describe_instances").paginate(Filters=filters)
    return [i for p in pages for r in p["Reservations"] for i in r["Instances"]]


def tags(inst: dict[str, Any]) -> dict[str, str]:
    return {t["Key"]: t["Value"] for t in inst.get("Tags", [])}


def free(fleet: Ec2Fleet, instance_type: str = "p5.48xlarge", env: Environment = ON_DEMAND) -> int:
    return fleet.capacity().pool(f"{env.env_id}/{instance_type}").free_instances


def test_launch_runs_whole_replicas_of_the_pool_shape_with_tags(fleet, cluster, client_factory):
    rank = big(2, route_weight=3.5)
    res = fleet.launch(job(), rank, "k-launch")
    assert res.status is LaunchStatus.LAUNCHED and res.replicas_launched == 2
    insts = instances(client_factory, cluster)
    assert len(insts) == 4  # 2 replicas x ceil(16 GPUs / 8 per instance)
    assert {i["InstanceType"] for i in insts} == {"p5.48xlarge"}
    assert {i["Placement"]["AvailabilityZone"] for i in insts} == {"us-east-1a"}
    assert all(i.get("InstanceLifecycle") != "spot" for i in insts)
    assert {i["ClientToken"] for i in insts} == {client_token(cluster, "k-launch")}
    assert all(len(i["ClientToken"]) <= 64 for i in insts)
    t = [tags(i) for i in insts]
    assert {x["koi:cluster"] for x in t} == {cluster}
    assert {x["koi:job"] for x in t} == {"job-1"}
    assert {x["koi:rank"] for x in t} == {rank.rank_id("job-1")}
    assert {x["koi:env"] for x in t} == {rank.env.env_id}  # for Prometheus' EC2 discovery
    assert {x["koi:key"] for x in t} == {"k-launch"}
    assert Counter(x["koi:replica"] for x in t) == {"0": 2, "1": 2}
    assert all(len(v) <= 256 for x in t for v in x.values())
    assert rank_from_tags(t[0]) == rank  # the spec survives EC2's 256-character tag values
    [dep] = fleet.deployments()
    assert dep.rank == rank and dep.job_id == "job-1" and dep.idempotency_key == "k-launch"
    assert dep.state is DeploymentState.SERVING and dep.replicas_ready == 2
    assert free(fleet) == 6 - 4


def test_a_spot_pool_launches_spot_in_the_zone_its_id_names(fleet, cluster, client_factory):
    res = fleet.launch(job(), small(3), "k-spot")
    assert res.status is LaunchStatus.LAUNCHED
    insts = instances(client_factory, cluster)
    assert len(insts) == 3 and {i["InstanceLifecycle"] for i in insts} == {"spot"}
    [az] = client_factory(REGION).describe_availability_zones(ZoneIds=["use1-az1"])["AvailabilityZones"]
    assert {i["Placement"]["AvailabilityZone"] for i in insts} == {az["ZoneName"]}
    assert free(fleet, "g6.xlarge", SPOT) == 1


def test_a_repeated_key_is_duplicate_and_launches_nothing(fleet, cluster, client_factory):
    assert fleet.launch(job(), big(1), "k-once").status is LaunchStatus.LAUNCHED
    again = fleet.launch(job(), big(1), "k-once")
    assert again.status is LaunchStatus.DUPLICATE and again.replicas_launched == 1
    assert len(instances(client_factory, cluster)) == 2
    # the same rank under a new key is refused: it already runs
    other = fleet.launch(job(), big(1), "k-other")
    assert other.status is LaunchStatus.FAILED and "already runs" in other.reason
    assert len(instances(client_factory, cluster)) == 2


def test_an_aws_error_is_a_failed_launch_with_its_code(fleet, cluster, client_factory):
    res = fleet.launch(job(), small(1, env=BAD_ZONE), "k-zone")  # us-east-1z does not exist
    assert res.status is LaunchStatus.FAILED and res.reason.startswith("InvalidParameterValue")
    assert instances(client_factory, cluster, live=False) == []


def test_teardown_terminates_the_rank_and_capacity_comes_back(fleet, cluster, client_factory):
    a, b = big(2), small(2)
    fleet.launch(job(1), a, "k-a")
    fleet.launch(job(2), b, "k-b")
    assert free(fleet) == 2
    assert fleet.teardown("job-1", a.rank_id("job-1"), "k-td", drain_s=0.0) is True  # draining: the contract tests
    assert free(fleet) == 6
    assert [d.job_id for d in fleet.deployments()] == ["job-2"]
    assert all(tags(i)["koi:job"] == "job-2" for i in instances(client_factory, cluster))
    assert fleet.teardown("job-1", a.rank_id("job-1"), "k-td") is False  # repeated key
    assert fleet.teardown("job-1", a.rank_id("job-1"), "k-td2") is False  # already gone
    # a stale rerun of an old teardown key does not kill the rank launched again since
    fleet.launch(job(1), a, "k-a2")
    assert fleet.teardown("job-1", a.rank_id("job-1"), "k-td") is False
    assert free(fleet) == 2


def test_a_restarted_worker_sees_what_the_cloud_holds(fleet, cluster, client_factory):
    fleet.launch(job(1), big(2, route_weight=1.5), "k-1")
    fleet.launch(job(2), small(1), "k-2")
    fleet.scale("job-2", small(1).rank_id("job-2"), 2, "k-2up")
    fresh = Ec2Fleet(cluster, pools(), client_factory=client_factory, image_id=IMAGE)
    assert fresh.deployments() == fleet.deployments()
    assert [(d.job_id, d.rank.n_replicas) for d in fresh.deployments()] == [("job-1", 2), ("job-2", 2)]
    assert fresh.capacity() == fleet.capacity()
    assert fresh.launch(job(1), big(2, route_weight=1.5), "k-1").status is LaunchStatus.DUPLICATE
    assert fresh.scale("job-2", small(1).rank_id("job-2"), 2, "k-2up").status is LaunchStatus.DUPLICATE
    # another cluster on the same account sees none of it
    other = Ec2Fleet(f"{cluster}-other", pools(), client_factory=client_factory, image_id=IMAGE)
    assert other.deployments() == [] and free(other) == 6


def test_a_lost_instance_degrades_its_rank_and_scale_replaces_the_replica(fleet, cluster, client_factory):
    rank = big(2)
    rid = rank.rank_id("job-1")
    fleet.launch(job(), rank, "k-l")
    victim = next(i for i in instances(client_factory, cluster) if tags(i)["koi:replica"] == "1")
    client_factory(REGION).terminate_instances(InstanceIds=[victim["InstanceId"]])  # a spot reclaim, say
    [dep] = fleet.deployments()
    assert dep.state is DeploymentState.DEGRADED and dep.replicas_ready == 1
    assert fleet.scale("job-1", rid, 2, "k-heal").status is LaunchStatus.LAUNCHED
    [dep] = fleet.deployments()
    assert dep.state is DeploymentState.SERVING and dep.replicas_ready == 2
    live = instances(client_factory, cluster)
    assert len(live) == 4 and Counter(tags(i)["koi:replica"] for i in live) == {"0": 2, "2": 2}


def test_tag_helpers():
    long_key = "k" * 300
    assert tag_value(long_key).startswith("sha256:") and len(tag_value(long_key)) <= 256
    assert tag_value("a*b") != "a*b" and tag_value("c/1/job#e1") == "c/1/job#e1"
    assert len(client_token("c", long_key)) <= 64 and client_token("c", "k") != client_token("d", "k")
    t = spec_tags(big(1, mechanism_id="m" * 300))
    assert len(t) > 1 and all(len(v) <= 256 for v in t.values()) and T_SPEC in t
    assert rank_from_tags({**t, "koi:replicas": "3"}) == big(3, mechanism_id="m" * 300)


def test_a_rank_whose_every_replica_broke_is_rebuilt_by_scale(fleet, cluster, client_factory):
    rank = big(2)  # two replicas of two p5 nodes each
    rid = rank.rank_id("job-1")
    fleet.launch(job(), rank, "k-b")
    by_replica: dict[str, list[str]] = {}
    for i in instances(client_factory, cluster):
        by_replica.setdefault(tags(i)["koi:replica"], []).append(i["InstanceId"])
    client_factory(REGION).terminate_instances(InstanceIds=[ids[0] for ids in by_replica.values()])  # one node each
    [dep] = fleet.deployments()
    assert dep.state is DeploymentState.DEGRADED and dep.replicas_ready == 0
    assert fleet.scale("job-1", rid, 2, "k-rebuild").status is LaunchStatus.LAUNCHED
    [dep] = fleet.deployments()
    assert dep.state is DeploymentState.SERVING and dep.replicas_ready == 2 and dep.rank.n_replicas == 2
    live = instances(client_factory, cluster)
    assert len(live) == 4 and {tags(i)["koi:replica"] for i in live} == {"2", "3"}  # the half replicas are gone


def test_the_shipped_iam_policy_allows_every_call_the_fleet_makes(cluster, client_factory):
    """infra/aws-iam-policy.json against the EC2 operations a whole lifecycle calls (recorded with botocore's
    events): a new call in the code without the policy following fails here."""
    import json
    from pathlib import Path

    called: set[str] = set()
    hooked: list[Any] = []

    def record(model: Any, **_: Any) -> None:
        called.add(f"ec2:{model.name}")

    def factory(region: str) -> Any:
        c = client_factory(region)  # the process's shared client: the hook comes off at the end
        if c not in hooked:
            c.meta.events.register("before-call.ec2", record, unique_id="iam-policy-test")
            hooked.append(c)
        return c

    fleet = Ec2Fleet(cluster, pools(), client_factory=factory, image_id=IMAGE, clock=lambda: 1234.5)
    s = small(1)  # the spot pool names an AZ id: DescribeAvailabilityZones
    fleet.launch(job(1), s, "k-l")
    rid = s.rank_id("job-1")
    fleet.scale("job-1", rid, 2, "k-up")
    fleet.scale("job-1", rid, 1, "k-down", drain_s=0.0)
    fleet.scale("job-1", rid, 2, "k-up2")
    fleet.scale("job-1", rid, 1, "k-down2", drain_s=30.0)
    fleet.reweight("job-1", rid, 2.0, "k-w")
    fleet.capacity(), fleet.deployments(), fleet.engine_hosts(), fleet.routes()
    fleet.teardown("job-1", rid, "k-td", drain_s=30.0, handover=True)
    fleet._clock = lambda: 1234.5 + 2000.0
    fleet.sweep(), fleet.sweep()
    fleet.preflight()  # koi fleet check, with the workers' credentials
    for c in hooked:
        c.meta.events.unregister("before-call.ec2", unique_id="iam-policy-test")
    assert {"ec2:RunInstances", "ec2:CreateTags", "ec2:TerminateInstances", "ec2:DescribeInstances",
            "ec2:DescribeAvailabilityZones"} <= called
    policy = json.loads((Path(__file__).resolve().parents[1] / "infra/aws-iam-policy.json").read_text())
    allowed = set()
    for st in policy["Statement"]:
        acts = st["Action"]
        allowed |= {acts} if isinstance(acts, str) else set(acts)
    assert called <= allowed, called - allowed


def test_ec2_clients_are_shared_per_region_made_safely_from_many_threads_and_retry(moto_endpoint):
    """The worker's threads make fleets at once: one client per region in the process (boto3's clients are
    thread-safe, its sessions are not), with botocore's standard retries and bounded timeouts."""
    from concurrent.futures import ThreadPoolExecutor

    from infra.cloud import ec2_client_factory

    kw = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "aws_session_token": "testing"}
    regions = ["us-east-1", "us-west-2", "eu-west-1", "us-east-2"] * 8
    with ThreadPoolExecutor(16) as pool:
        clients = list(pool.map(lambda r: ec2_client_factory(moto_endpoint, **kw)(r), regions))
    by_region = {r: {id(c) for c, rr in zip(clients, regions, strict=True) if rr == r} for r in set(regions)}
    assert all(len(ids) == 1 for ids in by_region.values()) and len({i for v in by_region.values() for i in v}) == 4
    c = clients[0]
    assert c.meta.region_name == "us-east-1" and c.meta.endpoint_url == moto_endpoint
    assert c.meta.config.retries["mode"] == "standard" and c.meta.config.retries["total_max_attempts"] == 6
    assert (c.meta.config.connect_timeout, c.meta.config.read_timeout) == (10, 60)
    assert c.describe_instances()["Reservations"] is not None  # it works


def test_a_spot_instance_given_its_interruption_notice_breaks_its_replica_at_once(cluster, moto_endpoint):
    """EC2's two-minute warning (the spot request marked-for-termination, read through a loopback proxy in front of
    moto, which cannot issue one): the replica is broken now — its rank DEGRADED, out of the routes — and a scale to
    the same count replaces it, instead of the tick after the instance is gone."""
    import infra.aws as aws
    from infra.cloud import ec2_client_factory
    from tests.fakes.http import stop
    from tests.test_infra_preflight import _proxy

    doomed: set[str] = set()

    def answer(q: dict[str, str]) -> str | None:
        if q.get("Action") != "DescribeSpotInstanceRequests":
            return None
        items = "".join(f"<item><spotInstanceRequestId>sir-{i[2:10]}</spotInstanceRequestId><instanceId>{i}"
                        f"</instanceId><state>active</state><status><code>marked-for-termination</code></status>"
                        f"</item>" for i in sorted(doomed))
        return (f'<DescribeSpotInstanceRequestsResponse xmlns="http://ec2.amazonaws.com/doc/2016-11-15/">'
                f"<requestId>r-1</requestId><spotInstanceRequestSet>{items}</spotInstanceRequestSet>"
                f"</DescribeSpotInstanceRequestsResponse>")

    httpd, url = _proxy(moto_endpoint, {}, answer)
    kw = {"aws_access_key_id": "testing", "aws_secret_access_key": "testing", "aws_session_token": "testing"}
    try:
        fleet = Ec2Fleet(cluster, pools(), client_factory=ec2_client_factory(url, **kw), image_id=IMAGE)
        rank = small(2)  # the spot pool
        rid = rank.rank_id("job-1")
        assert fleet.launch(job(1), rank, "k-s").status is LaunchStatus.LAUNCHED
        [dep] = fleet.deployments()
        assert (dep.replicas_ready, dep.state) == (2, DeploymentState.SERVING)
        live = [i for i in instances(ec2_client_factory(moto_endpoint, **kw), cluster)]
        victim = next(i for i in live if tags(i)["koi:replica"] == "1")
        doomed.add(victim["InstanceId"])
        aws._NOTICES.clear()  # the last answer (no notice) would stand for SPOT_NOTICE_TTL_S
        [dep] = fleet.deployments()
        assert (dep.replicas_ready, dep.state) == (1, DeploymentState.DEGRADED)
        [(_, _, hosts)] = fleet.routes()
        assert victim["PrivateIpAddress"] not in hosts and len(hosts) == 1
        assert fleet.scale("job-1", rid, 2, "k-repair").status is LaunchStatus.LAUNCHED
        after = instances(ec2_client_factory(moto_endpoint, **kw), cluster)
        assert victim["InstanceId"] not in {i["InstanceId"] for i in after}  # released, not left to EC2
        assert sorted(tags(i)["koi:replica"] for i in after) == ["0", "2"]
    finally:
        stop(httpd)
        aws._NOTICES.clear()
