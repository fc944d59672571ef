"""Scale-downs that release at once, and launches that replace a rank with nothing left working:
what S6's capacity model (C1) assumes of the executor."""

from __future__ import annotations

from koi.domain import ChainConfig, DeploymentState, Job, Rank
from koi.ports import LaunchStatus
from koi.sim.testing import batch_job, chat_job, tiny_scenario
from koi.sim.world import World


def rank_on(world: World, pool: str, n: int = 1, **cfg) -> Rank:
    p = world.scenario.pools[world.scenario.pool_index(pool)]
    return Rank(env=world.scenario.environment(p), config=ChainConfig(instance_type=p.instance_type, **cfg), n_replicas=n)


def job(world: World, job_id: str) -> Job:
    return world.jobs[world.job_index[job_id]].job


def _shrink_then_place(drain_s: float | None) -> LaunchStatus:
    w = World(tiny_scenario(jobs=[chat_job(rate=3.0), batch_job(n=50, submitted_at=0)]))
    chat = w.launch(job(w, "chat"), rank_on(w, "l40s", n=2, tp=4), "k-chat")  # both 4-GPU instances
    assert chat.status is LaunchStatus.LAUNCHED
    w.advance(120)
    assert w.scale("chat", chat.rank_id, 1, "k-shrink", drain_s=drain_s).status is LaunchStatus.LAUNCHED
    return w.launch(job(w, "batch"), rank_on(w, "l40s", n=1, tp=4), "k-batch").status


def test_a_scale_down_without_drain_frees_its_instance_for_another_launch_at_once():
    assert _shrink_then_place(0.0) is LaunchStatus.LAUNCHED
    # by default the removed replica drains first, so its instance is not free yet
    assert _shrink_then_place(None) is LaunchStatus.FAILED


def test_a_launch_replaces_a_rank_whose_replicas_never_came_up():
    w = World(tiny_scenario(jobs=[chat_job(rate=3.0)], lifecycle={"provision_s": 5, "load_gbps": 20.0,
                                                                  "warmup_s": 5, "materialize_fail_prob": 1.0}))
    first = w.launch(job(w, "chat"), rank_on(w, "h100", n=2), "k1")
    assert first.status is LaunchStatus.LAUNCHED
    w.advance(120)
    [dep] = w.deployments()
    assert dep.state is DeploymentState.FAILED and not dep.is_live
    w.scenario.lifecycle.materialize_fail_prob = 0.0  # the cause is fixed; the planner relaunches the chain
    again = w.launch(job(w, "chat"), rank_on(w, "h100", n=2), "k2")
    assert again.status is LaunchStatus.LAUNCHED and again.rank_id == first.rank_id
    assert any(e["kind"] == "rank_replaced" for e in w.events())
    w.advance(240)
    [dep] = w.deployments()
    assert dep.state is DeploymentState.SERVING and dep.replicas_ready == 2


def test_a_launch_onto_a_serving_rank_is_still_refused():
    w = World(tiny_scenario(jobs=[chat_job(rate=3.0)]))
    first = w.launch(job(w, "chat"), rank_on(w, "h100", n=1), "k1")
    w.advance(120)
    again = w.launch(job(w, "chat"), rank_on(w, "h100", n=1), "k2")
    assert again.status is LaunchStatus.FAILED and "use scale" in again.reason
    assert again.rank_id == first.rank_id
