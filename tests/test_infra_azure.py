"""The Azure executor through the real azure-mgmt-compute / azure-mgmt-network clients against an in-memory Azure
Resource Manager on loopback (tests/fakes/azure_server.py): tags, VM bodies, capacity, idempotency, restarts,
refusals, evictions. What every cloud must do is in tests/test_infra_fleet_contract.py, run on this one too."""

from __future__ import annotations

import base64
import math
import re
import uuid
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from infra.azure import AzureFleet, image_reference, rank_from_tags
from infra.backstop import RELEASE_GRACE_S
from infra.engine import EngineSpec
from koi.domain import ChainConfig, DeploymentState, Environment, Pool, Rank, ResourceMap
from koi.ports import LaunchStatus
from tests.fakes.azure_server import FakeArmServer
from tests.fakes.jobs import chat_job

SUB, RG = "00000000-0000-0000-0000-000000000001", "koi-fleet"
SUBNET = f"/subscriptions/{SUB}/resourceGroups/{RG}/providers/Microsoft.Network/virtualNetworks/v/subnets/engines"
ON_DEMAND = Environment(cloud="azure", region="eastus", zone="1", market="on_demand", gpu_type="A100")
SPOT = Environment(cloud="azure", region="eastus", zone="2", market="spot", gpu_type="A10")
_NAME = re.compile(r"koi-[0-9a-f]{8}-[0-9a-f]{10}-[0-9a-f]{6}-g\d+-r\d+-n\d+")


class _Token:
    def get_token(self, *scopes: str, **kw: Any) -> Any:  # never asked: the tests' auth policy sends no token
        raise AssertionError("no token in tests")


@pytest.fixture(scope="module")
def arm() -> Iterator[tuple[FakeArmServer, Any, Any]]:
    """The fake ARM and the real clients pointed at it (HTTP: the bearer policy, which refuses it, is replaced)."""
    from azure.core.pipeline.policies import SansIOHTTPPolicy
    from azure.mgmt.compute import ComputeManagementClient
    from azure.mgmt.network import NetworkManagementClient

    with FakeArmServer() as server:
        kw = {"base_url": server.url, "authentication_policy": SansIOHTTPPolicy(), "retry_total": 0,
              "polling_interval": 0}
        yield server, ComputeManagementClient(_Token(), SUB, **kw), NetworkManagementClient(_Token(), SUB, **kw)


def pools(big: int = 6, small: int = 4) -> ResourceMap:
    return ResourceMap(pools=[
        Pool(env=ON_DEMAND, instance_type="Standard_ND96asr_v4", gpus_per_instance=8, total_instances=big,
             free_instances=big, hourly_price=27.2),
        Pool(env=SPOT, instance_type="Standard_NV36ads_A10_v5", gpus_per_instance=1, total_instances=small,
             free_instances=small, hourly_price=0.9),
    ])


def make_fleet(arm: Any, cluster: str, clock: Any = lambda: 1234.5, **kw: Any) -> AzureFleet:
    _, compute, network = arm
    return AzureFleet(cluster, pools(), resource_group=RG, subnet_id=SUBNET, compute=compute, network=network,
                      ssh_public_key="ssh-ed25519 AAAA koi", clock=clock, **kw)


def big(n: int = 1, **kw: Any) -> Rank:
    """16 GPUs per replica on 8-GPU VMs: two VMs per replica."""
    return Rank(env=ON_DEMAND, config=ChainConfig(instance_type="Standard_ND96asr_v4", tp=8, pp=2), n_replicas=n, **kw)


def small(n: int = 1) -> Rank:
    return Rank(env=SPOT, config=ChainConfig(instance_type="Standard_NV36ads_A10_v5"), n_replicas=n)


def vms(server: FakeArmServer, cluster: str, live: bool = True) -> list[dict[str, Any]]:
    return [v for v in server.all_vms() if v["tags"].get("koi:cluster") == cluster
            and (not live or v["properties"]["provisioningState"] != "Deleting")]


def free(fleet: AzureFleet, instance_type: str = "Standard_ND96asr_v4", env: Environment = ON_DEMAND) -> int:
    return fleet.capacity().pool(f"{env.env_id}/{instance_type}").free_instances


@pytest.fixture
def cluster() -> str:
    return f"c-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def fleet(arm, cluster) -> AzureFleet:
    return make_fleet(arm, cluster)


def test_launch_creates_whole_replicas_with_tags_nics_and_disks_that_go_with_them(arm, fleet, cluster):
    server = arm[0]
    rank = big(2, route_weight=3.5)
    res = fleet.launch(chat_job(), rank, "k-launch/tick#1")
    assert res.status is LaunchStatus.LAUNCHED and res.replicas_launched == 2
    got = vms(server, cluster)
    assert len(got) == 4 and all(_NAME.fullmatch(v["name"]) for v in got)  # 2 replicas x 2 VMs
    p = [v["properties"] for v in got]
    assert {x["hardwareProfile"]["vmSize"] for x in p} == {"Standard_ND96asr_v4"}
    assert {(v["location"], tuple(v["zones"])) for v in got} == {("eastus", ("1",))}
    assert {x["storageProfile"]["osDisk"]["deleteOption"] for x in p} == {"Delete"}
    nic_cfg = [x["networkProfile"]["networkInterfaceConfigurations"][0] for x in p]
    assert {c["properties"]["deleteOption"] for c in nic_cfg} == {"Delete"}
    assert {c["properties"]["ipConfigurations"][0]["properties"]["subnet"]["id"] for c in nic_cfg} == {SUBNET}
    assert {x["osProfile"]["linuxConfiguration"]["disablePasswordAuthentication"] for x in p} == {True}
    assert all("priority" not in x for x in p)
    t = [v["tags"] for v in got]
    assert all(len(v) <= 256 for x in t for v in x.values()) and all(len(x) <= 50 for x in t)
    assert {x["koi:job"] for x in t} == {"job-1"} and {x["koi:rank"] for x in t} == {rank.rank_id("job-1")}
    assert {x["koi:env"] for x in t} == {rank.env.env_id} and {x["koi:model"] for x in t} == {"llama-3.1-8b"}
    assert Counter((x["koi:replica"], x["koi:node"]) for x in t) == {("0", "0"): 1, ("0", "1"): 1, ("1", "0"): 1,
                                                                     ("1", "1"): 1}
    assert rank_from_tags(t[0]) == rank
    [dep] = fleet.deployments()
    assert (dep.rank, dep.job_id, dep.idempotency_key) == (rank, "job-1", "k-launch/tick#1")
    assert dep.state is DeploymentState.SERVING and dep.replicas_ready == 2 and free(fleet) == 2
    [(job, rid, env, hosts)] = fleet.engine_hosts()  # each replica's node 0, by its NIC's private address
    assert (job, rid, env) == ("job-1", rank.rank_id("job-1"), ON_DEMAND.env_id) and len(hosts) == 2
    heads = {v["name"] for v in got if v["tags"]["koi:node"] == "0"}
    assert {server.nics[(SUB, RG, f"{n}-nic")]["properties"]["ipConfigurations"][0]["properties"]["privateIPAddress"]
            for n in heads} == set(hosts)


def test_a_launch_lists_the_resource_group_once(arm, fleet, cluster):
    """The key, the rank and the pool's use come from one listing (they were three, one per question)."""
    server = arm[0]
    start = len(server.requests)
    assert fleet.launch(chat_job(), big(1), "k-once").status is LaunchStatus.LAUNCHED
    lists = [p for m, p in server.requests[start:] if m == "GET" and p.endswith("/virtualMachines")]
    assert len(lists) == 1
    start = len(server.requests)
    assert fleet.launch(chat_job(), big(1), "k-once").status is LaunchStatus.DUPLICATE
    assert [m for m, _ in server.requests[start:]] == ["GET"]


def test_a_nics_address_is_asked_of_arm_once(arm, fleet, cluster):
    """Every read of the fleet (the sweep, the gateway, each tick) needs the replicas' addresses: ARM is asked once
    per NIC, not once per read."""
    server = arm[0]
    assert fleet.launch(chat_job(), big(2), "k-nic").status is LaunchStatus.LAUNCHED

    def nic_gets(since: int) -> int:
        return sum(m == "GET" and "/networkInterfaces/" in p for m, p in server.requests[since:])

    start = len(server.requests)
    first = fleet.routes()
    assert nic_gets(start) == 2  # one per replica head
    start = len(server.requests)
    assert make_fleet(arm, cluster).routes() == first and fleet.engine_hosts()  # another world, same process
    assert nic_gets(start) == 0


def test_a_spot_pool_launches_spot_vms_deleted_on_eviction_and_scale_repairs(arm, fleet, cluster):
    server = arm[0]
    rank = small(3)
    assert fleet.launch(chat_job(), rank, "k-spot").status is LaunchStatus.LAUNCHED
    got = vms(server, cluster)
    assert {(v["properties"]["priority"], v["properties"]["evictionPolicy"]) for v in got} == {("Spot", "Delete")}
    assert {v["properties"]["billingProfile"]["maxPrice"] for v in got} == {-1}
    server.evict(got[0]["name"])
    [dep] = fleet.deployments()
    assert dep.state is DeploymentState.DEGRADED and dep.replicas_ready == 2
    assert fleet.scale("job-1", rank.rank_id("job-1"), 3, "k-heal").status is LaunchStatus.LAUNCHED
    [dep] = fleet.deployments()
    assert dep.state is DeploymentState.SERVING and dep.replicas_ready == 3 and len(vms(server, cluster)) == 3


def test_a_repeated_key_is_duplicate_and_a_retried_put_makes_no_second_vm(arm, fleet, cluster):
    server = arm[0]
    assert fleet.launch(chat_job(), big(1), "k-once").status is LaunchStatus.LAUNCHED
    again = fleet.launch(chat_job(), big(1), "k-once")
    assert again.status is LaunchStatus.DUPLICATE and again.replicas_launched == 1
    other = fleet.launch(chat_job(), big(1), "k-other")
    assert other.status is LaunchStatus.FAILED and "already runs" in other.reason
    # a PUT retried after a lost answer lands on the VM the first one made (the name comes from the key)
    body = {"location": "eastus", "tags": {"koi:cluster": cluster}, "properties": {"hardwareProfile": {"vmSize": "x"}}}
    for _ in range(2):
        arm[1].virtual_machines.begin_create_or_update(RG, f"raw-{cluster}", body).result()
    assert sum(v["name"] == f"raw-{cluster}" for v in server.all_vms()) == 1
    arm[1].virtual_machines.begin_delete(RG, f"raw-{cluster}")


def test_a_refused_vm_fails_the_launch_with_azures_reason_and_nothing_is_left(arm, fleet, cluster):
    server = arm[0]
    server.fail_next_create()
    res = fleet.launch(chat_job(), big(2), "k-quota")
    assert res.status is LaunchStatus.FAILED and res.reason.startswith("OperationNotAllowed: ")
    assert "quota" in res.reason and vms(server, cluster, live=False) == []  # the VMs made before it were deleted
    res = fleet.launch(chat_job(), big(4), "k-big")
    assert res.status is LaunchStatus.FAILED and "8 instance(s), 6 of 6 free" in res.reason
    assert fleet.launch(chat_job(), big(1), "k-next-tick").status is LaunchStatus.LAUNCHED


def test_a_restarted_worker_sees_what_azure_holds_and_deleting_vms_still_hold_the_pool(arm, fleet, cluster):
    server = arm[0]
    fleet.launch(chat_job(1), big(1, route_weight=1.5), "k-1")
    fleet.launch(chat_job(2), small(1), "k-2")
    fresh = make_fleet(arm, cluster)
    assert sorted((d.job_id, d.rank.route_weight) for d in fresh.deployments()) == [("job-1", 1.5), ("job-2", None)]
    assert fresh.scale("job-2", small(1).rank_id("job-2"), 2, "k-2up").status is LaunchStatus.LAUNCHED
    assert fresh.scale("job-2", small(1).rank_id("job-2"), 2, "k-2up").status is LaunchStatus.DUPLICATE
    server.delete_lingers = True
    try:
        assert fleet.teardown("job-1", big(1).rank_id("job-1"), "k-td") is True
        assert [d.job_id for d in fleet.deployments()] == ["job-2"] and free(fleet) == 4  # Deleting holds its place
        assert fleet.teardown("job-1", big(1).rank_id("job-1"), "k-td") is False
    finally:
        server.delete_lingers = False
        server.finish_deletes()
    assert free(fleet) == 6


def test_the_engine_start_script_rides_in_custom_data(arm, cluster):
    server = arm[0]
    fleet = make_fleet(arm, cluster, engine=EngineSpec(prelude="source /opt/vllm/bin/activate"))
    assert fleet.launch(chat_job(), small(1), "k-e").status is LaunchStatus.LAUNCHED
    (vm,) = vms(server, cluster)
    script = base64.b64decode(server.custom_data(vm["name"])).decode()
    assert script.startswith("#!/bin/bash") and "exec vllm serve meta-llama/Llama-3.1-8B" in script
    assert "customData" not in vm["properties"]["osProfile"]  # as ARM: never returned
    assert "koi_watchdog" not in script and "identity" not in vm  # no identity: no backstop (infra/backstop.py)
    # two VMs per replica: each its own script, finding node 0 by its name (Azure's DNS in the VNet)
    assert fleet.launch(chat_job(2), big(1), "k-b").status is LaunchStatus.LAUNCHED
    two = sorted((v for v in vms(server, cluster) if v["tags"]["koi:job"] == "job-2"), key=lambda v: v["tags"]["koi:node"])
    for n, v in enumerate(two):
        lines = base64.b64decode(server.custom_data(v["name"])).decode().splitlines()
        assert f"NODE={n}" in lines and f"HEAD={two[0]['name']}" in lines


def test_with_an_identity_every_vm_carries_it_and_its_script_the_release_backstop(arm, cluster):
    server = arm[0]
    identity = f"/subscriptions/{SUB}/resourceGroups/{RG}/providers/Microsoft.ManagedIdentity/userAssignedIdentities/koi"
    fleet = make_fleet(arm, cluster, engine=EngineSpec(), identity=identity)
    assert fleet.launch(chat_job(), small(1), "k-i").status is LaunchStatus.LAUNCHED
    (vm,) = vms(server, cluster)
    assert vm["identity"]["type"] == "UserAssigned" and list(vm["identity"]["userAssignedIdentities"]) == [identity]
    script = base64.b64decode(server.custom_data(vm["name"])).decode()
    assert f"msi_res_id={identity}" in script and "koi_watchdog </dev/null" in script
    assert script.index("koi_watchdog </dev/null") < script.index("exec vllm serve")
    assert fleet.teardown("job-1", small(1).rank_id("job-1"), "k-td", drain_s=30.0) is True
    (vm,) = vms(server, cluster)
    assert int(vm["tags"]["koi:release-by"]) == math.ceil(1234.5 + 30.0 + RELEASE_GRACE_S)


def test_image_references():
    assert image_reference("Canonical:ubuntu-24_04-lts:server:latest") == {
        "publisher": "Canonical", "offer": "ubuntu-24_04-lts", "sku": "server", "version": "latest"}
    assert image_reference("/subscriptions/s/resourceGroups/g/providers/Microsoft.Compute/images/koi") == {
        "id": "/subscriptions/s/resourceGroups/g/providers/Microsoft.Compute/images/koi"}
    with pytest.raises(ValueError, match="URN"):
        image_reference("ubuntu")


def test_ticks_launch_on_azure_through_the_same_provider_and_a_restarted_worker_adds_nothing(arm, tmp_path):
    """The azure world: the same pipeline and provider (infra/cloud.py), Azure Resource Manager (a fake of it)."""
    from infra.cloud import AzureSpec, CloudWorldProvider, FleetSpec
    from koi.domain import Action, ActionType, Ladder, Plan
    from koi.pipeline import ProposeContext, Runtime, Verdict, run_ticks
    from koi.pipeline.messages import TickOutcome
    from koi.store import init_db, make_engine
    from tests.test_infra_cloud import Clock

    server, compute, network = arm
    spec = FleetSpec(pools=pools().pools, azure=AzureSpec(subscription_id=SUB, resource_group=RG, subnet_id=SUBNET,
                                                          ssh_public_key="ssh-ed25519 AAAA koi"))

    def place(ctx: ProposeContext) -> Plan:
        return Plan(actions=[Action(job_id=js.job.job_id, type=ActionType.PLACE, ladder=Ladder(ranks=[small(1)]))
                             if js.status.value == "pending" else Action(job_id=js.job.job_id, type=ActionType.KEEP)
                             for js in ctx.snapshot.jobs], proposer="place")

    eng = make_engine(f"sqlite:///{tmp_path / 'koi.db'}")
    init_db(eng)

    def rt() -> Runtime:
        return Runtime(engine=eng, world=CloudWorldProvider(spec, cloud="azure", client=(compute, network),
                                                            clock=Clock(), scrape=False),
                       proposers={"p": place}, default_proposer="p",
                       validator=lambda s, c, t, snap, plan: Verdict(valid=True, plan=plan),
                       s2=lambda s, c, t: {}, s3=lambda s, c, t: {}, interval_s=60.0)

    cluster = f"c-{uuid.uuid4().hex[:8]}"
    out = run_ticks(rt(), cluster, 3, jobs=[chat_job(0), chat_job(1)])
    assert [r.outcome for r in out] == [TickOutcome.COMMITTED] * 3
    assert out[0].deploy.launched == 2 and out[1].deploy.launched == out[2].deploy.launched == 0
    assert Counter(v["tags"]["koi:job"] for v in vms(server, cluster)) == {"job-0": 1, "job-1": 1}
    again = run_ticks(rt(), cluster, 2, start_tick=3)  # another worker process: the fleet is read back from Azure
    assert all(r.outcome is TickOutcome.COMMITTED and r.deploy.launched == 0 for r in again)
    assert sorted(d.job_id for d in again[-1].deployments) == ["job-0", "job-1"]
    assert len(vms(server, cluster)) == 2


def test_the_shipped_role_allows_every_call_the_fleet_makes(arm, cluster):
    """infra/azure-role.json against the ARM requests a whole lifecycle sends (recorded by the fake): a new call
    in the code without the role following fails here."""
    import json
    from pathlib import Path

    server = arm[0]
    now = {"t": 1234.5}
    fleet = make_fleet(arm, cluster, clock=lambda: now["t"])
    start = len(server.requests)
    s = small(1)
    fleet.launch(chat_job(), s, "k-l")
    rid = s.rank_id("job-1")
    fleet.scale("job-1", rid, 2, "k-up")
    fleet.scale("job-1", rid, 1, "k-down", drain_s=30.0)
    fleet.reweight("job-1", rid, 2.0, "k-w")
    fleet.capacity(), fleet.deployments(), fleet.engine_hosts(), fleet.routes()
    fleet.teardown("job-1", rid, "k-td", drain_s=30.0, handover=True)
    now["t"] += 2000.0
    fleet.sweep(), fleet.sweep()
    fleet.preflight()  # koi fleet check, with the workers' credentials
    verbs = {"GET": "read", "PUT": "write", "PATCH": "write", "DELETE": "delete"}
    needed = set()
    for method, path in server.requests[start:]:
        namespace, *rest = path.split("/providers/", 1)[1].split("/")  # Microsoft.Compute, type, name, type, ...
        needed.add("/".join([namespace, *rest[0::2], verbs[method]]))  # the resource types, without their names
    assert {"Microsoft.Compute/virtualMachines/write", "Microsoft.Compute/virtualMachines/delete",
            "Microsoft.Network/networkInterfaces/read", "Microsoft.Compute/skus/read",
            "Microsoft.Compute/locations/publishers/artifacttypes/offers/skus/versions/read"} <= needed
    role = json.loads((Path(__file__).resolve().parents[1] / "infra/azure-role.json").read_text())
    assert needed <= set(role["Actions"]), needed - set(role["Actions"])


def test_the_default_clients_are_built_from_the_fleet_file_without_calling_azure():
    """``azure_clients``: the subscription and (a sovereign cloud's) Resource Manager endpoint from the fleet file,
    credentials from the default chain — nothing is asked of Azure until a call is made."""
    from infra.cloud import AzureSpec, FleetError, FleetSpec, azure_clients, make_fleet

    spec = FleetSpec(pools=pools().pools, endpoint_url="https://management.usgovcloudapi.net",
                     azure=AzureSpec(subscription_id=SUB, resource_group=RG, subnet_id=SUBNET, ssh_public_key="k"))
    compute, network = azure_clients(spec)
    assert compute._config.subscription_id == SUB == network._config.subscription_id
    assert azure_clients(spec) == (compute, network)  # one pair (one credential, one token) per process
    assert compute._config.base_url == "https://management.usgovcloudapi.net"
    fleet = make_fleet(spec, "c1", "azure", client=(compute, network))
    assert isinstance(fleet, AzureFleet) and fleet.rg == RG and fleet.subnet_id == SUBNET
    assert fleet.identity is None
    ident = f"/subscriptions/{SUB}/resourceGroups/{RG}/providers/Microsoft.ManagedIdentity/userAssignedIdentities/k"
    assert make_fleet(FleetSpec.model_validate({**spec.model_dump(), "azure": {**spec.azure.model_dump(),
                                                "identity": ident}}), "c1", "azure",
                      client=(compute, network)).identity == ident
    with pytest.raises(ValueError, match="identity"):  # a client id is not a resource id
        AzureSpec(subscription_id=SUB, resource_group=RG, subnet_id=SUBNET, ssh_public_key="k",
                  identity="0000-1111")
    with pytest.raises(FleetError, match="'azure' section"):
        make_fleet(spec.model_copy(update={"azure": None}), "c1", "azure")
