"""What every cloud executor must do, run on each (EC2 on moto's server, Compute Engine on its loopback fake).
Cloud-specific behaviour (tags, labels, metadata, errors) stays in ``test_infra_aws.py`` / ``test_infra_gcp.py``."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from koi.domain import DeploymentState, Rank
from koi.ports import LaunchStatus
from tests.fakes.jobs import chat_job


@dataclass
class Cloud:
    fleet: Any
    big: Callable[[int], Rank]  # a rank of n replicas, two instances each
    small: Callable[[int], Rank]  # a rank of n single-instance replicas
    replicas: Callable[[], list[str]]  # the replica index of each live instance of the cluster
    weights: Callable[[], set[str]]  # the route weights the live instances carry
    free: Callable[[], int]  # free instances in the big rank's pool


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


@pytest.fixture(params=["aws", "gcp"])
def cloud(request) -> Cloud:
    cluster = f"c-{uuid.uuid4().hex[:10]}"
    if request.param == "aws":
        from infra.aws import Ec2Fleet
        from tests import test_infra_aws as t

        factory = request.getfixturevalue("ec2_factory")
        fleet = Ec2Fleet(cluster, t.pools(), client_factory=factory, image_id=t.IMAGE, clock=lambda: 1234.5)
        def tag(k: str) -> list[str]:
            return [t.tags(i).get(k, "") for i in t.instances(factory, cluster)]

        return Cloud(fleet, t.big, t.small, lambda: tag("koi:replica"), lambda: set(tag("koi:route-weight")),
                     lambda: t.free(fleet))
    from infra.gcp import GceFleet
    from tests import test_infra_gcp as t

    server, client = request.getfixturevalue("gce")
    fleet = GceFleet(cluster, t.pools(), project=t.PROJECT, client=client, image=t.IMAGE, clock=lambda: 1234.5)
    def item(k: str) -> list[str]:
        return [t.md(i).get(k, "") for i in t.instances(server, cluster)]

    return Cloud(fleet, t.big, t.small, lambda: item("koi-replica"), lambda: set(item("koi-route-weight")),
                 lambda: t.free(fleet))


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
