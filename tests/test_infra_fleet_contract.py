"""What every cloud executor must do, run on each (EC2 on moto's server, Compute Engine and Azure on loopback fakes).
Cloud-specific behaviour (tags, labels, metadata, errors) stays in ``test_infra_aws.py`` / ``test_infra_gcp.py`` /
``test_infra_azure.py``."""

from __future__ import annotations

import math
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from infra.backstop import RELEASE_GRACE_S
from infra.drain import HANDOVER_TIMEOUT_S
from koi.domain import DeploymentState, Rank
from koi.ports import Executor, LaunchStatus, Observer
from tests.fakes.jobs import chat_job
from tests.test_infra_azure import arm  # noqa: F401 - the fake ARM fixture


@dataclass
class Cloud:
    fleet: Any
    big: Callable[[int], Rank]  # a rank of n replicas, two instances each
    small: Callable[[int], Rank]  # a rank of n single-instance replicas
    replicas: Callable[[], list[str]]  # the replica index of each live instance of the cluster
    weights: Callable[[], set[str]]  # the route weights the live instances carry
    free: Callable[[], int]  # free instances in the big rank's pool
    now: dict[str, float]  # the fleet's clock: now["t"]
    release: Callable[[], list[str]]  # the release backstop's time on each live instance ("" for none)


@pytest.fixture(scope="module")
def gce() -> Iterator[tuple[Any, Any]]:
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import compute_v1

    from tests.fakes.gce_server import FakeGceServer
    from tests.test_infra_gcp import ZONE_A, ZONE_B

    with FakeGceServer(zones=(ZONE_A, ZONE_B)) as server:
        yield server, compute_v1.InstancesClient(transport="rest", client_options=ClientOptions(api_endpoint=server.url),
                                                 credentials=AnonymousCredentials())


@pytest.fixture(params=["aws", "gcp", "azure"])
def cloud(request) -> Cloud:
    cluster = f"c-{uuid.uuid4().hex[:10]}"
    now = {"t": 1234.5}
    if request.param == "azure":
        from tests import test_infra_azure as z

        server = request.getfixturevalue("arm")[0]
        fleet = z.make_fleet(request.getfixturevalue("arm"), cluster, clock=lambda: now["t"])

        def tag(k: str) -> list[str]:
            return [v["tags"].get(k, "") for v in z.vms(server, cluster)]

        return Cloud(fleet, z.big, z.small, lambda: tag("koi:replica"), lambda: set(tag("koi:route-weight")),
                     lambda: z.free(fleet), now, lambda: tag("koi:release-by"))
    if request.param == "aws":
        from infra.aws import Ec2Fleet
        from tests import test_infra_aws as t

        factory = request.getfixturevalue("ec2_factory")
        fleet = Ec2Fleet(cluster, t.pools(), client_factory=factory, image_id=t.IMAGE, clock=lambda: now["t"])
        def tag(k: str) -> list[str]:
            return [t.tags(i).get(k, "") for i in t.instances(factory, cluster)]

        return Cloud(fleet, t.big, t.small, lambda: tag("koi:replica"), lambda: set(tag("koi:route-weight")),
                     lambda: t.free(fleet), now, lambda: tag("koi:release-by"))
    from infra.gcp import GceFleet
    from tests import test_infra_gcp as t

    server, client = request.getfixturevalue("gce")
    fleet = GceFleet(cluster, t.pools(), project=t.PROJECT, client=client, image=t.IMAGE, clock=lambda: now["t"])
    def item(k: str) -> list[str]:
        return [t.md(i).get(k, "") for i in t.instances(server, cluster)]

    return Cloud(fleet, t.big, t.small, lambda: item("koi-replica"), lambda: set(item("koi-route-weight")),
                 lambda: t.free(fleet), now, lambda: item("koi-release-by"))


def test_the_fleet_is_an_executor_and_an_observer_and_starts_empty(cloud: Cloud) -> None:
    fleet = cloud.fleet
    assert isinstance(fleet, Executor) and isinstance(fleet, Observer)
    assert fleet.now() == 1234.5 and fleet.telemetry(0.0, 60.0, cluster_id=fleet.cluster_id, tick=1) == []
    assert fleet.deployments() == [] and fleet.engine_hosts() == [] and fleet.routes() == [] and cloud.free() == 6


def test_launch_beyond_the_pool_fails_naming_it_and_launches_nothing(cloud: Cloud) -> None:
    fleet, rank = cloud.fleet, cloud.big(4)  # 8 instances, the pool has 6
    res = fleet.launch(chat_job(), rank, "k-big")
    assert res.status is LaunchStatus.FAILED and f"{rank.env.env_id}/{rank.config.instance_type}" in res.reason
    assert "8 instance(s)" in res.reason and "6 of 6 free" in res.reason
    stray = rank.model_copy(update={"config": rank.config.model_copy(update={"instance_type": "no-such-shape"})})
    res = fleet.launch(chat_job(), stray, "k-stray")
    assert res.status is LaunchStatus.FAILED and "no pool" in res.reason and "no-such-shape" in res.reason
    assert cloud.replicas() == []
    # a FAILED launch left nothing in the cloud, so its key may try again once capacity allows
    assert fleet.launch(chat_job(), cloud.big(3), "k-big").status is LaunchStatus.LAUNCHED


def test_scale_adds_and_removes_replicas_and_repeats_nothing(cloud: Cloud) -> None:
    fleet, rank = cloud.fleet, cloud.big(1)
    rid = rank.rank_id("job-1")
    fleet.launch(chat_job(), rank, "k-l")
    up = fleet.scale("job-1", rid, 3, "k-up")
    assert up.status is LaunchStatus.LAUNCHED and up.replicas_launched == 3
    assert len(cloud.replicas()) == 6
    [dep] = fleet.deployments()
    assert dep.rank.n_replicas == 3 and dep.replicas_ready == 3 and dep.state is DeploymentState.SERVING
    assert dep.idempotency_key == "k-l"
    assert fleet.scale("job-1", rid, 3, "k-up").status is LaunchStatus.DUPLICATE
    assert len(cloud.replicas()) == 6
    over = fleet.scale("job-1", rid, 4, "k-over")  # 2 more instances, none free
    assert over.status is LaunchStatus.FAILED and "0 of 6 free" in over.reason
    assert fleet.scale("job-1", rid, 1, "k-down", drain_s=0.0).status is LaunchStatus.LAUNCHED
    assert sorted(cloud.replicas()) == ["0", "0"]  # the highest replicas went, both nodes of each
    assert fleet.scale("job-1", rid, 1, "k-down").status is LaunchStatus.DUPLICATE
    [dep] = fleet.deployments()
    assert dep.rank.n_replicas == 1 and dep.replicas_ready == 1
    assert cloud.free() == 4
    assert fleet.scale("job-1", "job-1/nope", 2, "k-x").status is LaunchStatus.FAILED
    assert fleet.scale("job-1", rid, 0, "k-zero").status is LaunchStatus.FAILED


def test_reweight_marks_the_running_rank_and_new_replicas_inherit_it(cloud: Cloud) -> None:
    fleet, rank = cloud.fleet, cloud.small(2)
    rid = rank.rank_id("job-1")
    assert fleet.reweight("job-1", rid, 2.5, "k-w0") is False  # nothing runs yet
    fleet.launch(chat_job(), rank, "k-l")
    assert fleet.reweight("job-1", rid, 2.5, "k-w1") is True
    assert cloud.weights() == {"2.5"} and fleet.deployments()[0].rank.route_weight == 2.5
    assert fleet.reweight("job-1", rid, 9.0, "k-w1") is False  # repeated key
    assert fleet.deployments()[0].rank.route_weight == 2.5
    fleet.scale("job-1", rid, 3, "k-up")
    assert cloud.weights() == {"2.5"} and len(cloud.replicas()) == 3


def test_a_teardown_hands_over_then_drains_then_releases(cloud: Cloud) -> None:
    """make before break on a real fleet (infra/drain.py): the old rank keeps serving (routed, DRAINING to the
    planner, still in its pool) until a rank of the job serves, then drains for drain_s out of the routes, then the
    cloud releases it — each step by the sweep, the state in the cloud's own records."""
    fleet, now = cloud.fleet, cloud.now
    old = cloud.big(1)
    rid = old.rank_id("job-1")
    fleet.launch(chat_job(), old, "k-old")
    free = cloud.free()
    assert cloud.release() == ["", ""]  # a live rank releases itself never
    assert fleet.teardown("job-1", rid, "k-td", drain_s=30.0, handover=True) is True
    # the backstop's time: after the longest handover and the drain, plus the grace (infra/backstop.py)
    assert cloud.release() == [str(math.ceil(1234.5 + HANDOVER_TIMEOUT_S + 30.0 + RELEASE_GRACE_S))] * 2
    [dep] = fleet.deployments()
    assert dep.state is DeploymentState.DRAINING
    assert [r.rank_id(j) for j, r, _ in fleet.routes()] == [rid]  # handing over: still routed
    assert len(cloud.replicas()) == 2 and cloud.free() == free
    assert fleet.teardown("job-1", rid, "k-td", drain_s=30.0, handover=True) is False  # repeated key
    assert fleet.teardown("job-1", rid, "k-td2", drain_s=30.0, handover=True) is False  # already leaving
    now["t"] += 600.0
    assert fleet.sweep() == 0 and [r.rank_id(j) for j, r, _ in fleet.routes()] == [rid]  # no replacement yet

    new = cloud.small(1)  # the replacement, another chain of the job
    assert fleet.launch(chat_job(), new, "k-new").status is LaunchStatus.LAUNCHED
    now["t"] += 1.0
    assert fleet.sweep() == 1  # the replacement serves: the drain starts
    assert [r.rank_id(j) for j, r, _ in fleet.routes()] == [new.rank_id("job-1")]
    assert {d.rank_id for d in fleet.deployments()} == {rid, new.rank_id("job-1")}
    assert rid in {r for _, r, _, _ in fleet.engine_hosts()}  # still scraped while it drains
    now["t"] += 29.0
    assert fleet.sweep() == 0 and cloud.free() == free
    now["t"] += 1.0
    assert fleet.sweep() == 1  # drained: released
    assert [d.rank_id for d in fleet.deployments()] == [new.rank_id("job-1")]
    assert cloud.free() == free + 2 and len(cloud.replicas()) == 1
    assert fleet.sweep() == 0


def test_a_teardown_without_drain_or_handover_releases_at_once(cloud: Cloud) -> None:
    fleet, rank = cloud.fleet, cloud.big(1)
    fleet.launch(chat_job(), rank, "k-a")
    free = cloud.free()
    assert fleet.teardown("job-1", rank.rank_id("job-1"), "k-td", drain_s=0.0) is True
    assert fleet.deployments() == [] and cloud.free() == free + 2 and fleet.sweep() == 0


def test_a_scale_in_drains_the_replicas_it_removes(cloud: Cloud) -> None:
    """The removed replicas leave the rank (count, routes) at once but keep running and their place in the pool for
    drain_s; the sweep then releases them. A scale-up meanwhile launches fresh replicas beside them."""
    fleet, now, rank = cloud.fleet, cloud.now, cloud.big(1)
    rid = rank.rank_id("job-1")
    fleet.launch(chat_job(), rank, "k-l")
    assert fleet.scale("job-1", rid, 3, "k-up").status is LaunchStatus.LAUNCHED
    free = cloud.free()
    assert fleet.scale("job-1", rid, 1, "k-down", drain_s=30.0).status is LaunchStatus.LAUNCHED
    assert sorted(cloud.release()) == [""] * 2 + [str(math.ceil(1234.5 + 30.0 + RELEASE_GRACE_S))] * 4
    [dep] = fleet.deployments()
    assert dep.rank.n_replicas == 1 and dep.replicas_ready == 1 and dep.state is DeploymentState.SERVING
    [(_, _, hosts)] = fleet.routes()
    assert len(hosts) == 1
    assert len(cloud.replicas()) == 6 and cloud.free() == free  # still running: draining
    assert fleet.scale("job-1", rid, 1, "k-down", drain_s=30.0).status is LaunchStatus.DUPLICATE
    now["t"] += 29.0
    assert fleet.sweep() == 0 and len(cloud.replicas()) == 6
    now["t"] += 1.0
    assert fleet.sweep() == 2  # the two removed replicas
    assert len(cloud.replicas()) == 2 and cloud.free() == free + 4
    assert fleet.scale("job-1", rid, 2, "k-up2").status is LaunchStatus.LAUNCHED
    [dep] = fleet.deployments()
    assert dep.rank.n_replicas == 2 and dep.replicas_ready == 2 and fleet.sweep() == 0


class Engines:
    """A readiness probe whose engines answer as the test says (the HTTP probe itself: tests/test_infra_health.py)."""

    def __init__(self) -> None:
        self.up: set[str] = set()
        self.served: set[str] = set()  # once ready
        self.never: set[str] = set()  # past the ready timeout without an answer

    def ready(self, hosts: Any) -> set[str]:
        ok = set(hosts) & self.up
        self.served |= ok
        return ok

    def lost(self, hosts: Any) -> set[str]:
        return ((set(hosts) & self.served) - self.up) | (set(hosts) & self.never - self.up)


def test_with_engines_probed_a_replica_is_ready_once_its_engine_answers(cloud: Cloud) -> None:
    """infra/health.py: running instances are not a serving replica. Until its engine answers a replica is not
    ready (the rank LAUNCHING, out of the routes); one whose engine stopped is lost (DEGRADED); and a handover waits
    for the replacement's engine, not its instances."""
    fleet, now = cloud.fleet, cloud.now
    fleet.health = engines = Engines()
    rank = cloud.big(2)
    rid = rank.rank_id("job-1")
    fleet.launch(chat_job(), rank, "k-a")
    [(_, _, _, heads)] = fleet.engine_hosts()  # the running heads, probed or not (the scrape targets)
    assert len(heads) == 2
    [dep] = fleet.deployments()
    assert (dep.replicas_ready, dep.state) == (0, DeploymentState.LAUNCHING) and fleet.routes() == []
    engines.up.add(heads[0])
    [dep] = fleet.deployments()
    assert (dep.replicas_ready, dep.state) == (1, DeploymentState.LAUNCHING)
    assert [hosts for _, _, hosts in fleet.routes()] == [(heads[0],)]
    engines.up.add(heads[1])
    [dep] = fleet.deployments()
    assert (dep.replicas_ready, dep.state) == (2, DeploymentState.SERVING)
    engines.up.discard(heads[1])  # its engine died; the instances still run
    [dep] = fleet.deployments()
    assert (dep.replicas_ready, dep.state) == (1, DeploymentState.DEGRADED)

    new = cloud.small(1)  # the replacement: its instance runs at once, its engine not yet
    fleet.launch(chat_job(), new, "k-new")
    assert fleet.teardown("job-1", rid, "k-td", drain_s=30.0, handover=True) is True
    now["t"] += 60.0
    assert fleet.sweep() == 0  # the replacement's engine does not answer: the old rank keeps serving
    assert {r.rank_id(j) for j, r, _ in fleet.routes()} == {rid}
    [new_head] = [h for _, r, _, hs in fleet.engine_hosts() if r == new.rank_id("job-1") for h in hs]
    engines.up.add(new_head)
    now["t"] += 1.0
    assert fleet.sweep() == 1  # now it serves: the drain starts
    assert {r.rank_id(j) for j, r, _ in fleet.routes()} == {new.rank_id("job-1")}


def test_a_replica_whose_engine_never_answers_is_replaced_by_the_next_scale(cloud: Cloud) -> None:
    """The simulator's replica that fails to materialize, on a real fleet (infra/health.py choice 5): its instances
    run, its engine never answers within the ready timeout — the rank is DEGRADED and a scale to the same count
    releases it and launches a fresh one."""
    fleet = cloud.fleet
    fleet.health = engines = Engines()
    rank = cloud.big(2)
    rid = rank.rank_id("job-1")
    fleet.launch(chat_job(), rank, "k-a")
    [(_, _, _, heads)] = fleet.engine_hosts()
    engines.up.add(heads[0])
    engines.never.add(heads[1])
    [dep] = fleet.deployments()
    assert (dep.replicas_ready, dep.state) == (1, DeploymentState.DEGRADED)
    assert fleet.scale("job-1", rid, 2, "k-repair").status is LaunchStatus.LAUNCHED
    assert sorted(cloud.replicas()) == ["0", "0", "2", "2"]  # replica 1's two instances released, replica 2 new
    [(_, _, _, now_heads)] = fleet.engine_hosts()
    assert heads[0] in now_heads and heads[1] not in now_heads
    engines.up.update(now_heads)
    [dep] = fleet.deployments()
    assert (dep.replicas_ready, dep.state) == (2, DeploymentState.SERVING)
