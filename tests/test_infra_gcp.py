"""The GCE executor through the real google-cloud-compute REST client against an in-memory Compute Engine
on loopback (tests/fakes/gce_server.py): labels, metadata, capacity, idempotency, restarts, preemption."""

from __future__ import annotations

import re
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
from google.api_core.client_options import ClientOptions
from google.api_core.exceptions import ServiceUnavailable
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1

from infra.gcp import (
    M_SPEC,
    GceFleet,
    gce_reason,
    instance_name,
    label_hash,
    label_value,
    rank_from_metadata,
    request_id,
    spec_value,
)
from koi.domain import ChainConfig, DeploymentState, Environment, Pool, Rank, ResourceMap
from koi.ports import LaunchStatus
from tests.fakes.gce_server import FakeGceServer
from tests.fakes.jobs import chat_job

PROJECT = "koi-test"
ZONE_A, ZONE_B = "us-central1-a", "us-central1-b"
IMAGE = "projects/deeplearning-platform-release/global/images/family/common-cu124-debian-11-py310"
ON_DEMAND = Environment(cloud="gcp", region="us-central1", zone=ZONE_A, market="on_demand", gpu_type="A100")
SPOT = Environment(cloud="gcp", region="us-central1", zone=ZONE_B, market="spot", gpu_type="L4")
_NAME = r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?"


@pytest.fixture(scope="module")
def server() -> Iterator[FakeGceServer]:
    with FakeGceServer(zones=(ZONE_A, ZONE_B)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: FakeGceServer) -> compute_v1.InstancesClient:
    return compute_v1.InstancesClient(transport="rest", client_options=ClientOptions(api_endpoint=server.url),
                                      credentials=AnonymousCredentials())


@pytest.fixture
def cluster() -> str:
    return f"c-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def fleet(cluster: str, client) -> GceFleet:
    return GceFleet(cluster, pools(), project=PROJECT, client=client, image=IMAGE, clock=lambda: 1234.5,
                    insert_args={"metadata": {"startup-script": "#!/bin/sh\necho vllm"}, "labels": {"team": "ml"}})


def pools(a2: int = 6, g2: int = 4) -> ResourceMap:
    return ResourceMap(pools=[
        Pool(env=ON_DEMAND, instance_type="a2-highgpu-8g", gpus_per_instance=8, total_instances=a2,
             free_instances=a2, hourly_price=29.39),
        Pool(env=SPOT, instance_type="g2-standard-4", gpus_per_instance=1, total_instances=g2, free_instances=g2,
             hourly_price=0.28),
    ])


job = chat_job  # tests/fakes/jobs.py


def big(n: int = 1, **kw: Any) -> Rank:
    """16 GPUs per replica on 8-GPU a2 instances: two instances per replica."""
    return Rank(env=ON_DEMAND, config=ChainConfig(instance_type="a2-highgpu-8g", tp=8, pp=2), n_replicas=n, **kw)


def small(n: int = 1) -> Rank:
    return Rank(env=SPOT, config=ChainConfig(instance_type="g2-standard-4"), n_replicas=n)


def md(inst: dict[str, Any]) -> dict[str, str]:
    return {i["key"]: i["value"] for i in inst["metadata"]["items"]}


def instances(server: FakeGceServer, cluster: str, live: bool = True) -> list[dict[str, Any]]:
    return [i for i in server.all_instances() if md(i).get("koi-cluster") == cluster
            and (not live or i["status"] in ("PROVISIONING", "STAGING", "RUNNING"))]


def free(fleet: GceFleet, instance_type: str = "a2-highgpu-8g", env: Environment = ON_DEMAND) -> int:
    return fleet.capacity().pool(f"{env.env_id}/{instance_type}").free_instances


def test_launch_inserts_whole_replicas_with_labels_and_metadata(fleet, cluster, server):
    rank = big(2, route_weight=3.5)
    res = fleet.launch(job(), rank, "k-launch/tick#1")
    assert res.status is LaunchStatus.LAUNCHED and res.replicas_launched == 2
    insts = instances(server, cluster)
    assert len(insts) == 4  # 2 replicas x ceil(16 GPUs / 8 per instance)
    assert {i["machineType"] for i in insts} == {f"zones/{ZONE_A}/machineTypes/a2-highgpu-8g"}
    assert {i["zone"].rsplit("/", 1)[-1] for i in insts} == {ZONE_A}
    assert {i["scheduling"]["provisioningModel"] for i in insts} == {"STANDARD"}
    assert {i["scheduling"]["onHostMaintenance"] for i in insts} == {"TERMINATE"}
    assert {d["initializeParams"]["sourceImage"] for i in insts for d in i["disks"]} == {IMAGE}

    assert all(re.fullmatch(_NAME, i["name"]) for i in insts) and len({i["name"] for i in insts}) == 4
    labels = [i["labels"] for i in insts]
    assert all(len(k) <= 63 and len(v) <= 63 for x in labels for k, v in x.items())
    assert {x["koi_cluster"] for x in labels} == {cluster}  # a legal label value stays readable
    assert {x["koi_rank"] for x in labels} == {label_hash(rank.rank_id("job-1"))}
    assert {x["koi_key"] for x in labels} == {label_hash("k-launch/tick#1")}
    assert {x["team"] for x in labels} == {"ml"}
    m = [md(i) for i in insts]
    assert {x["koi-job"] for x in m} == {"job-1"} and {x["koi-rank-id"] for x in m} == {rank.rank_id("job-1")}
    assert {x["koi-env"] for x in m} == {rank.env.env_id}  # for Prometheus' GCE discovery
    assert {x["koi-key"] for x in m} == {"k-launch/tick#1"} and {x["koi-launch-key"] for x in m} == {"k-launch/tick#1"}
    assert Counter((x["koi-replica"], x["koi-node"]) for x in m) == {("0", "0"): 1, ("0", "1"): 1,
                                                                   ("1", "0"): 1, ("1", "1"): 1}
    assert {x["startup-script"] for x in m} == {"#!/bin/sh\necho vllm"}
    assert rank_from_metadata(m[0]) == rank
    [dep] = fleet.deployments()
    assert dep.rank == rank and dep.job_id == "job-1" and dep.idempotency_key == "k-launch/tick#1"
    assert dep.state is DeploymentState.SERVING and dep.replicas_ready == 2
    assert free(fleet) == 6 - 4


def test_a_spot_pool_launches_spot_vms_that_delete_on_preemption(fleet, cluster, server):
    assert fleet.launch(job(), small(3), "k-spot").status is LaunchStatus.LAUNCHED
    insts = instances(server, cluster)
    assert len(insts) == 3 and {i["zone"].rsplit("/", 1)[-1] for i in insts} == {ZONE_B}
    assert {i["scheduling"]["provisioningModel"] for i in insts} == {"SPOT"}
    assert {i["scheduling"]["instanceTerminationAction"] for i in insts} == {"DELETE"}
    assert {i["scheduling"].get("automaticRestart") for i in insts} == {False}
    assert free(fleet, "g2-standard-4", SPOT) == 1 and free(fleet) == 6


def test_a_repeated_key_is_duplicate_and_a_retried_insert_creates_nothing(fleet, cluster, server, client):
    assert fleet.launch(job(), big(1), "k-once").status is LaunchStatus.LAUNCHED
    again = fleet.launch(job(), big(1), "k-once")
    assert again.status is LaunchStatus.DUPLICATE and again.replicas_launched == 1
    assert len(instances(server, cluster)) == 2
    other = fleet.launch(job(), big(1), "k-other")  # the same rank under a new key: it already runs
    assert other.status is LaunchStatus.FAILED and "already runs" in other.reason
    assert len(instances(server, cluster)) == 2
    # at the client level: the same request id twice (a retry after a lost response) makes one instance
    rid = request_id(cluster, "k-raw", 0, 0)
    assert rid == request_id(cluster, "k-raw", 0, 0) != request_id(cluster, "k-raw", 0, 1)
    inst = compute_v1.Instance(name=f"raw-{cluster}", machine_type=f"zones/{ZONE_A}/machineTypes/n1-standard-1",
                               metadata=compute_v1.Metadata(items=[compute_v1.Items(key="koi-cluster", value=cluster)]))
    ops = [client.insert(request=compute_v1.InsertInstanceRequest(project=PROJECT, zone=ZONE_A,
                                                                  instance_resource=inst, request_id=rid))
           for _ in range(2)]
    assert ops[0].name == ops[1].name and ops[1].result(timeout=5) is None
    assert sum(i["name"] == f"raw-{cluster}" for i in server.all_instances()) == 1


def test_a_gce_error_is_a_failed_launch_with_its_reason_and_nothing_is_left(fleet, cluster, server):
    server.fail_next_insert()  # on the operation, as GCE reports a stockout
    res = fleet.launch(job(), big(2), "k-stockout")  # four inserts: the first fails, three succeed
    assert res.status is LaunchStatus.FAILED and res.reason.startswith("ZONE_RESOURCE_POOL_EXHAUSTED: ")
    assert instances(server, cluster, live=False) == [] and fleet.deployments() == []  # rolled back
    server.fail_next_insert("QUOTA_EXCEEDED", "Quota 'NVIDIA_A100_GPUS' exceeded.", code=403, http=True)
    res = fleet.launch(job(), big(1), "k-quota")
    assert res.status is LaunchStatus.FAILED and res.reason == "QUOTA_EXCEEDED: Quota 'NVIDIA_A100_GPUS' exceeded."
    assert instances(server, cluster, live=False) == []
    assert fleet.launch(job(), big(1), "k-next-tick").status is LaunchStatus.LAUNCHED


def test_teardown_deletes_the_rank_and_capacity_comes_back(fleet, cluster, server):
    a, b = big(2), small(2)
    fleet.launch(job(1), a, "k-a")
    fleet.launch(job(2), b, "k-b")
    assert free(fleet) == 2
    assert fleet.teardown("job-1", a.rank_id("job-1"), "k-td", drain_s=0.0) is True  # draining: the contract tests
    assert free(fleet) == 6
    assert [d.job_id for d in fleet.deployments()] == ["job-2"]
    assert all(md(i)["koi-job"] == "job-2" for i in instances(server, cluster, live=False))
    assert fleet.teardown("job-1", a.rank_id("job-1"), "k-td") is False  # gone: nothing to tear down
    assert fleet.teardown("job-2", a.rank_id("job-1"), "k-td3") is False
    assert fleet.teardown("job-2", b.rank_id("job-2"), "k-td4") is True
    assert instances(server, cluster, live=False) == [] and free(fleet, "g2-standard-4", SPOT) == 4


def test_a_teardown_key_on_instances_still_stopping_is_not_applied_twice(fleet, cluster, server):
    a = big(1)
    fleet.launch(job(), a, "k-a")
    server.delete_lingers = True  # as GCE shows a deleting instance: still listed, STOPPING
    try:
        assert fleet.teardown("job-1", a.rank_id("job-1"), "k-td") is True
        stopping = instances(server, cluster, live=False)
        assert {i["status"] for i in stopping} == {"STOPPING"} and len(stopping) == 2
        assert {md(i)["koi-teardown-key"] for i in stopping} == {"k-td"}
        assert fleet.teardown("job-1", a.rank_id("job-1"), "k-td") is False
        assert fleet.deployments() == [] and free(fleet) == 6 - 2  # stopping instances still hold their GPUs
        assert fleet.launch(job(), a, "k-a2").status is LaunchStatus.LAUNCHED  # the rank may start anew
    finally:
        server.delete_lingers = False
        server.finish_deletes()
    assert free(fleet) == 6 - 2 and fleet.deployments()[0].idempotency_key == "k-a2"


def test_a_restarted_worker_sees_what_the_cloud_holds(fleet, cluster, client):
    fleet.launch(job(1), big(2, route_weight=1.5), "k-1")
    fleet.launch(job(2), small(1), "k-2")
    fleet.scale("job-2", small(1).rank_id("job-2"), 2, "k-2up")
    fresh = GceFleet(cluster, pools(), project=PROJECT, client=client, image=IMAGE)
    assert fresh.deployments() == fleet.deployments()
    assert [(d.job_id, d.rank.n_replicas) for d in fresh.deployments()] == [("job-1", 2), ("job-2", 2)]
    assert fresh.capacity() == fleet.capacity()
    assert fresh.launch(job(1), big(2, route_weight=1.5), "k-1").status is LaunchStatus.DUPLICATE
    assert fresh.scale("job-2", small(1).rank_id("job-2"), 2, "k-2up").status is LaunchStatus.DUPLICATE
    other = GceFleet(f"{cluster}-other", pools(), project=PROJECT, client=client, image=IMAGE)
    assert other.deployments() == [] and free(other) == 6
    elsewhere = GceFleet(cluster, pools(), project="another-project", client=client, image=IMAGE)
    assert elsewhere.deployments() == []


def test_a_preempted_instance_degrades_its_rank_and_scale_replaces_the_replica(fleet, cluster, server):
    rank = big(2)
    rid = rank.rank_id("job-1")
    fleet.launch(job(), rank, "k-l")
    victim = next(i for i in instances(server, cluster) if md(i)["koi-replica"] == "1")
    server.set_status(victim["name"], "TERMINATED")
    [dep] = fleet.deployments()
    assert dep.state is DeploymentState.DEGRADED and dep.replicas_ready == 1
    assert free(fleet) == 6 - 3  # a TERMINATED instance holds no GPUs
    assert fleet.scale("job-1", rid, 2, "k-heal").status is LaunchStatus.LAUNCHED
    [dep] = fleet.deployments()
    assert dep.state is DeploymentState.SERVING and dep.replicas_ready == 2
    everything = instances(server, cluster, live=False)
    assert len(everything) == 4 and Counter(md(i)["koi-replica"] for i in everything) == {"0": 2, "2": 2}


def test_provisioning_instances_are_launching_and_not_yet_hosts(fleet, cluster, server):
    server.start_status = "PROVISIONING"
    try:
        fleet.launch(job(), big(1), "k-p")
    finally:
        server.start_status = "RUNNING"
    [dep] = fleet.deployments()
    assert dep.state is DeploymentState.LAUNCHING and dep.replicas_ready == 0
    assert fleet.engine_hosts() == []
    assert fleet.reweight("job-1", big(1).rank_id("job-1"), 2.0, "k-w") is False  # nothing runs yet
    for i in instances(server, cluster):
        server.set_status(i["name"], "RUNNING")
    assert fleet.deployments()[0].state is DeploymentState.SERVING


def test_engine_hosts_are_the_head_nodes_internal_addresses(fleet, cluster, server):
    rank = big(2)
    fleet.launch(job(), rank, "k-h")
    fleet.launch(job(2), small(1), "k-s")
    heads = sorted(i["networkInterfaces"][0]["networkIP"] for i in instances(server, cluster)
                   if md(i)["koi-rank-id"] == rank.rank_id("job-1") and md(i)["koi-node"] == "0")
    hosts = {rid: (j, env, h) for j, rid, env, h in fleet.engine_hosts()}
    assert hosts[rank.rank_id("job-1")][:2] == ("job-1", ON_DEMAND.env_id)
    assert sorted(hosts[rank.rank_id("job-1")][2]) == heads and len(heads) == 2
    assert len(hosts[small(1).rank_id("job-2")][2]) == 1


def test_helpers_keep_gce_limits():
    assert label_value("c-1_x") == "c-1_x"
    for v in ("Cluster/1", "k" * 100, "job-1/abc#e1"):
        assert re.fullmatch(r"[a-z0-9_-]{1,63}", label_value(v)) and re.fullmatch(r"[a-z0-9_-]{1,63}", label_hash(v))
    assert label_hash("a") != label_hash("b")
    name = instance_name("C" * 200, "job/" * 50, "k" * 300, 99, 999, 15)
    assert re.fullmatch(_NAME, name) and len(name) <= 63
    uuid.UUID(request_id("c", "k" * 300, 1, 2))
    err = ServiceUnavailable("SERVICE UNAVAILABLE", errors=[{"reason": "ZONE_RESOURCE_POOL_EXHAUSTED", "message": "m"}])
    assert gce_reason(err) == "ZONE_RESOURCE_POOL_EXHAUSTED: m"
    assert gce_reason(ServiceUnavailable("down")) == "503: down"
    r = big(1, mechanism_id="m" * 300)
    assert rank_from_metadata({M_SPEC: spec_value(r), "koi-replicas": "3"}) == big(3, mechanism_id="m" * 300)
