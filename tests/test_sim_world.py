"""The World's executor/observer surface: launches, idempotency, failures, teardown, scale, telemetry, records, cost."""

from __future__ import annotations

import math

import numpy as np
import pytest

from koi import variables
from koi.domain import ChainConfig, DeploymentState, Job, Rank
from koi.ports import Executor, LaunchStatus, Observer
from koi.sim.records import RECORD_DTYPE, Status
from koi.sim.testing import batch_job, chat_job, tiny_scenario
from koi.sim.world import World


@pytest.fixture
def world() -> World:
    return World(tiny_scenario(jobs=[chat_job(rate=3.0), batch_job(n=100, submitted_at=30)]))


def rank_on(world: World, pool: str, n: int = 1, **cfg) -> Rank:
    p = world.scenario.pools[world.scenario.pool_index(pool)]
    return Rank(env=world.scenario.environment(p), config=ChainConfig(instance_type=p.instance_type, **cfg), n_replicas=n)


def job(world: World, job_id: str) -> Job:
    return world.jobs[world.job_index[job_id]].job


def test_world_satisfies_the_ports(world):
    assert isinstance(world, Executor)
    assert isinstance(world, Observer)
    assert world.now() == 0.0
    assert world.capacity().total_gpus == 16


def test_launch_is_idempotent_and_serves(world):
    r1 = world.launch(job(world, "chat"), rank_on(world, "h100", n=2), "c/1/chat/a")
    assert r1.status is LaunchStatus.LAUNCHED and r1.replicas_launched == 2 and r1.ready_at > 0
    r2 = world.launch(job(world, "chat"), rank_on(world, "h100", n=2), "c/1/chat/a")
    assert r2.status is LaunchStatus.DUPLICATE and r2.rank_id == r1.rank_id
    assert world.capacity().pool(f"{rank_on(world, 'h100').env.env_id}/p5.48xlarge").free_instances == 0
    [dep] = world.deployments()
    assert dep.state is DeploymentState.LAUNCHING
    world.advance(120)
    [dep] = world.deployments()
    assert dep.state is DeploymentState.SERVING and dep.replicas_ready == 2
    p = world.progress("chat")
    assert p.served > 200 and p.tokens_out > 0


def test_impossible_launches_fail_with_the_engines_reason(world):
    r = world.launch(job(world, "chat"), rank_on(world, "l40s", tp=3), "k1")
    assert r.status is LaunchStatus.FAILED and "tp=3 does not divide the 32 attention heads" in r.reason
    big = Job.model_validate({**job(world, "chat").model_dump(), "job_id": "big", "model": "llama-3.1-70b"})
    world.submit(big)
    r = world.launch(big, rank_on(world, "l40s", tp=1), "k2")
    assert r.status is LaunchStatus.FAILED and "does not fit" in r.reason
    r = world.launch(job(world, "chat"), rank_on(world, "h100", tp=1, weight_dtype="fp8", gpu_mem_util=0.15), "k3")
    assert r.status is LaunchStatus.FAILED
    assert [e["kind"] for e in world.events()].count("launch_failed") == 3
    assert world.deployments() == []  # never served
    world.advance(60)
    assert world.records()["rank"].max() == -1  # no request ever reached an engine


def test_tensor_parallel_across_instances_spans_nodes(world):
    r = world.launch(job(world, "chat"), rank_on(world, "l40s", tp=8), "k")
    assert r.status is LaunchStatus.LAUNCHED  # two 4-GPU instances, inter-node links in the step model
    pool = next(p for p in world.capacity().pools if p.instance_type == "g6e.12xlarge")
    assert pool.free_instances == 0
    assert world.engine.stack.tables[0].meta["nodes"] == 2


def test_capacity_limits_replicas_and_unknown_env_fails(world):
    r = world.launch(job(world, "chat"), rank_on(world, "l40s", n=12, tp=1), "k")
    assert r.status is LaunchStatus.LAUNCHED and r.replicas_launched == 8 and "8 of 12" in r.reason
    r = world.launch(job(world, "batch"), rank_on(world, "l40s", n=1, tp=1), "k2")
    assert r.status is LaunchStatus.FAILED and "no free capacity" in r.reason
    other = rank_on(world, "l40s").model_copy(update={"env": rank_on(world, "l40s").env.model_copy(update={"zone": "zz"})})
    r = world.launch(job(world, "chat"), other, "k3")
    assert r.status is LaunchStatus.FAILED and "no pool in environment" in r.reason
    assert world.launch(Job.model_validate({**job(world, "chat").model_dump(), "job_id": "ghost"}),
                        rank_on(world, "h100"), "k4").reason.startswith("unknown job")  # fmt: skip


def test_teardown_drains_then_releases_and_swap_overlaps(world):
    a = world.launch(job(world, "chat"), rank_on(world, "l40s", n=2), "a")
    world.advance(120)
    # swap: launch the new rank, tear the old one down with a drain
    b = world.launch(job(world, "chat"), rank_on(world, "h100", n=1), "b")
    assert world.teardown("chat", a.rank_id, "a-down", drain_s=30)
    assert not world.teardown("chat", a.rank_id, "a-down", drain_s=30)  # repeated key
    assert not world.teardown("chat", "nope", "x")
    states = {d.rank_id: d.state for d in world.deployments()}
    assert states[a.rank_id] is DeploymentState.DRAINING and states[b.rank_id] is DeploymentState.LAUNCHING
    world.advance(200)
    assert {d.rank_id for d in world.deployments()} == {b.rank_id}
    rec = world.records()
    # nothing was lost in the swap: requests queued on the drained rank were retried
    assert np.sum(rec["status"] == Status.FAILED) == 0
    assert set(np.unique(rec["rank"][rec["status"] == Status.SERVED])) == {0, 1}
    # the drained rank's instances are free again and its cost stopped
    pool = next(p for p in world.capacity().pools if p.instance_type == "g6e.12xlarge")
    assert pool.free_instances == 2
    cost_a = world.fleet.instance_cost(world.now(), {0})
    world.advance(400)
    assert world.fleet.instance_cost(world.now(), {0}) == pytest.approx(cost_a)


def _swap_window(world: World, t0: float, t1: float) -> tuple[int, float]:
    """(dropped requests, worst TTFT in s) of the requests that arrived in [t0, t1)."""
    rec = world.records()
    win = rec[(rec["arrival"] >= t0) & (rec["arrival"] < t1)]
    ttft = win["first_token"] - win["arrival"]
    return int(np.sum(win["status"] == Status.DROPPED)), float(np.nanmax(np.where(np.isfinite(ttft), ttft, np.inf)))


def test_handover_keeps_the_old_rank_serving_until_the_new_one_does(world):
    """A swap's make-before-break: the old rank takes traffic through the new rank's cold start,
    then drains; torn down without handover, the same swap leaves requests waiting at the gateway."""
    a = world.launch(job(world, "chat"), rank_on(world, "l40s", n=2), "a")
    world.advance(120)
    t_swap = world.now()
    b = world.launch(job(world, "chat"), rank_on(world, "h100", n=1), "b")
    assert world.teardown("chat", a.rank_id, "a-down", drain_s=30, handover=True)
    states = {d.rank_id: d.state for d in world.deployments()}
    # the planner sees the old rank as leaving (not part of the job's ladder), the router still uses it
    assert states[a.rank_id] is DeploymentState.DRAINING and states[b.rank_id] is DeploymentState.LAUNCHING
    assert [e["kind"] for e in world.events()].count("teardown_deferred") == 1
    world.advance(t_swap + 10)
    served_on_a = world.records()
    assert np.any((served_on_a["rank"] == 0) & (served_on_a["arrival"] > t_swap + 1))
    world.advance(t_swap + 300)
    assert {d.rank_id for d in world.deployments()} == {b.rank_id}
    kinds = [e["kind"] for e in world.events()]
    assert kinds.index("teardown") > kinds.index("replica_ready", kinds.index("teardown_deferred"))
    drops, worst = _swap_window(world, t_swap, t_swap + 300)
    assert drops == 0 and worst < 2.0
    assert np.sum(world.records()["status"] == Status.FAILED) == 0

    plain = World(tiny_scenario(jobs=[chat_job(rate=3.0), batch_job(n=100, submitted_at=30)]))
    a2 = plain.launch(job(plain, "chat"), rank_on(plain, "l40s", n=2), "a")
    plain.advance(120)
    plain.launch(job(plain, "chat"), rank_on(plain, "h100", n=1), "b")
    plain.teardown("chat", a2.rank_id, "a-down", drain_s=30)
    plain.advance(t_swap + 300)
    drops, worst_plain = _swap_window(plain, t_swap, t_swap + 300)
    assert drops > 0 or worst_plain > 10 * worst  # requests waited at the gateway for the cold start


def test_a_rank_replaced_beside_kept_ranks_serves_until_its_replacement_does(world):
    """A swap that keeps one of the job's ranks and replaces the other: the kept rank serves from the start,
    but the replaced rank hands over to what the swap launched, not to it — it takes traffic through the new
    rank's cold start and drains once that rank serves (draining it at once left the kept rank carrying its
    traffic through the cold start)."""
    kept = world.launch(job(world, "chat"), rank_on(world, "l40s", n=1, tp=2), "kept")
    a = world.launch(job(world, "chat"), rank_on(world, "l40s", n=1), "a")
    world.advance(120)
    t_swap = world.now()
    b = world.launch(job(world, "chat"), rank_on(world, "h100", n=1), "b")
    assert world.teardown("chat", a.rank_id, "a-down", drain_s=30, handover=True)
    kinds = [e["kind"] for e in world.events()]
    assert kinds.count("teardown_deferred") == 1 and "teardown" not in kinds
    world.advance(t_swap + 300)
    rec = world.records()
    a_idx = 1  # the second rank launched
    assert np.any((rec["rank"] == a_idx) & (rec["arrival"] > t_swap + 1))  # still in rotation after the swap
    assert {d.rank_id for d in world.deployments()} == {kept.rank_id, b.rank_id}
    kinds = [e["kind"] for e in world.events()]
    assert kinds.index("teardown") > kinds.index("replica_ready", kinds.index("teardown_deferred"))


def test_handover_without_a_replacement_times_out_and_can_be_cancelled(world):
    from koi.sim.world import HANDOVER_TIMEOUT_S

    a = world.launch(job(world, "chat"), rank_on(world, "l40s", n=2), "a")
    world.advance(120)
    # no replacement launched at all: the rank serves until the timeout, then drains and goes
    assert world.teardown("chat", a.rank_id, "a-down", drain_s=30, handover=True)
    world.advance(120 + HANDOVER_TIMEOUT_S - 60)
    assert [d.rank_id for d in world.deployments()] == [a.rank_id]
    world.advance(120 + HANDOVER_TIMEOUT_S + 120)
    assert world.deployments() == []
    # a launch of a rank whose teardown still waits cancels the teardown (no cold start again)
    c = world.launch(job(world, "chat"), rank_on(world, "l40s", n=2), "c")
    world.advance(world.now() + 120)
    assert world.teardown("chat", c.rank_id, "c-down", drain_s=30, handover=True)
    again = world.launch(job(world, "chat"), rank_on(world, "l40s", n=2), "c-again")
    assert again.status is LaunchStatus.LAUNCHED and again.replicas_launched == 2
    [dep] = world.deployments()
    assert dep.state is DeploymentState.SERVING and dep.replicas_ready == 2
    assert "teardown_cancelled" in [e["kind"] for e in world.events()]


def test_scale_up_and_down(world):
    a = world.launch(job(world, "chat"), rank_on(world, "l40s", n=1), "a")
    world.advance(60)
    r = world.scale("chat", a.rank_id, 6, "s1")
    assert r.status is LaunchStatus.LAUNCHED and r.replicas_launched == 6
    assert world.scale("chat", a.rank_id, 6, "s1").status is LaunchStatus.DUPLICATE
    pool = next(p for p in world.capacity().pools if p.instance_type == "g6e.12xlarge")
    assert pool.free_instances == 0
    world.advance(150)
    assert world.deployments()[0].replicas_ready == 6
    world.scale("chat", a.rank_id, 2, "s2")
    world.advance(260)
    assert world.deployments()[0].replicas_ready == 2
    pool = next(p for p in world.capacity().pools if p.instance_type == "g6e.12xlarge")
    assert pool.free_instances == 1
    assert world.scale("chat", "nope", 2, "s3").status is LaunchStatus.FAILED


def test_telemetry_windows_carry_every_series(world):
    a = world.launch(job(world, "chat"), rank_on(world, "h100", n=1), "a")
    world.advance(300)
    wins = world.telemetry(150, 300, cluster_id="c", tick=3)
    assert len(wins) == 1
    w = wins[0]
    assert (w.cluster_id, w.tick, w.job_id, w.rank_id) == ("c", 3, "chat", a.rank_id)
    assert set(w.series) == set(variables.TELEMETRY_SERIES)
    assert 5 <= w.n_samples <= 15  # every 10-30 simulated seconds
    assert all(math.isfinite(x) for xs in w.series.values() for x in xs)
    tput = np.mean(w.series["throughput_tokens_per_sec"])
    assert tput == pytest.approx(3.0 * 150, rel=0.35)  # offered load: rate x mean output
    assert np.mean(w.series["cost_per_token"]) == pytest.approx(55.04 / 3600 / tput, rel=0.35)
    assert 0 < np.mean(w.series["slo_margin"]) <= 1
    assert np.mean(w.series["input_length_observed"]) == pytest.approx(600, rel=0.25)
    assert np.mean(w.series["kvcache_hit_rate"]) == 0.0  # no shared prefix in this workload


def test_records_are_columnar_and_cover_every_request(world):
    world.advance(200)  # nothing deployed: online requests time out at the gateway, batch waits
    rec = world.records()
    assert rec.dtype == RECORD_DTYPE
    chat = rec[rec["job"] == world.job_index["chat"]]
    assert len(chat) == world.progress("chat").arrived
    assert np.all(chat["status"][chat["arrival"] < 200 - 61] == Status.DROPPED)
    batch = rec[rec["job"] == world.job_index["batch"]]
    assert len(batch) == 100 and np.all(batch["status"] == Status.UNFINISHED)
    assert len(world.records(include_unfinished=False)) == np.sum(rec["status"] != Status.UNFINISHED)


def test_batch_job_completes_and_reports_progress(world):
    world.launch(job(world, "batch"), rank_on(world, "h100", n=2), "b")
    world.advance(600)
    p = world.progress("batch")
    assert p.served == 100 and p.finished_at is not None and p.finished_at < 600
    assert [e["kind"] for e in world.events()].count("job_finished") == 1


def test_cost_accrues_for_idle_gpus():
    w = World(tiny_scenario(jobs=[chat_job(rate=0.01)]))
    w.launch(w.jobs[0].job, rank_on(w, "h100", n=1), "a")
    w.advance(3600)
    assert w.cost()["per_job"]["chat"] == pytest.approx(55.04, rel=1e-6)
    assert w.cost()["total"] == pytest.approx(55.04, rel=1e-6)


def test_reserved_capacity_is_paid_even_when_idle():
    pools = [{"name": "res", "cloud": "aws", "region": "us-west-2", "market": "reserved",
              "instance_type": "p4de.24xlarge", "instances": 2}]  # fmt: skip
    w = World(tiny_scenario(pools=pools))
    w.advance(1800)
    c = w.cost()
    assert c["allocated"] == 0 and c["idle_reserved"] == pytest.approx(2 * 0.6 * 27.45 / 2, rel=1e-6)


def test_job_arrivals_are_exposed_for_a_driver():
    w = World(tiny_scenario(jobs=[chat_job("a"), chat_job("b", submitted_at=100, lifetime_s=50)]))
    assert [(t, j.job_id) for t, j in w.job_arrivals()] == [(0.0, "a"), (100.0, "b")]
    assert [j.job_id for j in w.jobs_submitted(50, 150)] == ["b"]
    w.advance(200)
    pb = w.progress("b")
    assert pb.departed and 0 < pb.arrived < 4 * 50 * 1.5
    assert [e["kind"] for e in w.events()].count("job_left") == 1


def test_driver_derives_a_placement_when_none_is_declared():
    from koi.sim.driver import run_scenario

    sc = tiny_scenario(jobs=[chat_job(model="llama-3.1-70b", rate=1.0), batch_job(n=50, submitted_at=20)])
    world, summary = run_scenario(sc, hours=400 / 3600)
    deps = {e["job_id"]: e for e in world.events() if e["kind"] == "launch"}
    assert set(deps) == {"chat", "batch"}
    rows = {j["job_id"]: j for j in summary["jobs"]}
    assert rows["chat"]["served"] > 100 and rows["batch"]["served"] == 50
    assert summary["fleet"]["failed_launches"] == []


def test_a_job_registered_late_starts_its_traffic_now():
    w = World(tiny_scenario())
    w.advance(100)
    w.submit(Job.model_validate({**chat_job("late", rate=5.0), "submitted_at": 0.0}))
    w.submit(Job.model_validate({**batch_job("late-batch", n=20), "submitted_at": 10.0}))
    w.advance(130)
    rec = w.records()
    assert len(rec) > 50 and rec["arrival"].min() >= 100.0
    with pytest.raises(ValueError, match="already in the world"):
        w.submit(Job.model_validate(chat_job("late")))


def _requests_per_rank(world: World, job_id: str, t0: float) -> dict[int, int]:
    rec = world.records()
    r = rec[(rec["job"] == world.job_index[job_id]) & (rec["arrival"] >= t0) & (rec["rank"] >= 0)]
    ranks, counts = np.unique(r["rank"], return_counts=True)
    return dict(zip(ranks.tolist(), counts.tolist(), strict=True))


@pytest.mark.parametrize("weights", [None, (3.0, 1.0), (1.0, 3.0)])
def test_the_gateway_shares_a_split_ladder_by_the_planners_weights(weights):
    """Two one-replica ranks of one job on different GPUs: with no weights the gateway weighs them
    by nominal decode capacity; when both carry ``route_weight`` it follows those (3:1 and 1:3)."""
    w = World(tiny_scenario(jobs=[chat_job(rate=4.0)]))
    a, b = rank_on(w, "h100"), rank_on(w, "l40s", tp=1)
    if weights is not None:
        a, b = a.model_copy(update={"route_weight": weights[0]}), b.model_copy(update={"route_weight": weights[1]})
    ra = w.launch(job(w, "chat"), a, "k-a")
    rb = w.launch(job(w, "chat"), b, "k-b")
    assert ra.status is LaunchStatus.LAUNCHED and rb.status is LaunchStatus.LAUNCHED
    w.advance(600)
    got = _requests_per_rank(w, "chat", 300.0)
    ia, ib = (w.live_rank[ra.rank_id], w.live_rank[rb.rank_id])
    share_a = got.get(ia, 0) / max(got.get(ia, 0) + got.get(ib, 0), 1)
    if weights is None:
        assert share_a > 0.6  # the H100 replica decodes several times faster than the L40S one
    else:
        assert share_a == pytest.approx(weights[0] / sum(weights), abs=0.06)


def test_a_reweight_moves_a_kept_split_ladders_traffic_without_touching_a_replica():
    """S6's reweight of a kept ladder: the gateway follows the new weights from then on; no replica
    starts or stops, and a repeated key or a rank that does not run changes nothing."""
    w = World(tiny_scenario(jobs=[chat_job(rate=4.0)]))
    a = rank_on(w, "h100").model_copy(update={"route_weight": 1.0})
    b = rank_on(w, "l40s", tp=1).model_copy(update={"route_weight": 3.0})
    ra, rb = w.launch(job(w, "chat"), a, "k-a"), w.launch(job(w, "chat"), b, "k-b")
    w.advance(600)
    replicas = len(w.replicas)
    assert w.reweight("chat", ra.rank_id, 3.0, "rw-a") and w.reweight("chat", rb.rank_id, 1.0, "rw-b")
    assert not w.reweight("chat", ra.rank_id, 9.0, "rw-a")  # repeated key: the first weight stands
    assert not w.reweight("chat", "chat/no-such-rank", 9.0, "rw-x")
    w.advance(1200)
    assert len(w.replicas) == replicas
    ia, ib = w.live_rank[ra.rank_id], w.live_rank[rb.rank_id]
    before, after = _requests_per_rank_between(w, "chat", 300.0, 600.0), _requests_per_rank(w, "chat", 900.0)
    assert before[ia] / (before[ia] + before[ib]) == pytest.approx(0.25, abs=0.06)
    assert after[ia] / (after[ia] + after[ib]) == pytest.approx(0.75, abs=0.06)
    assert {d.rank_id: d.rank.route_weight for d in w.deployments()} == {ra.rank_id: 3.0, rb.rank_id: 1.0}


def _requests_per_rank_between(world: World, job_id: str, t0: float, t1: float) -> dict[int, int]:
    rec = world.records()
    r = rec[(rec["job"] == world.job_index[job_id]) & (rec["arrival"] >= t0) & (rec["arrival"] < t1) & (rec["rank"] >= 0)]
    ranks, counts = np.unique(r["rank"], return_counts=True)
    return dict(zip(ranks.tolist(), counts.tolist(), strict=True))


def test_a_scale_in_empties_whole_instances_so_the_freed_node_is_free():
    """Replicas r2 on node A and r3, r4 on node B (r1 on A was lost): scaling 3 → 2 stops r2, the
    only replica on A, and frees A — stopping the newest (r4) would leave both nodes half used and
    free nothing, though the planner's capacity model counts one node returned."""
    w = World(tiny_scenario(jobs=[chat_job(rate=2.0)]))
    a = w.launch(job(w, "chat"), rank_on(w, "l40s", n=3, tp=2), "a")  # 2 replicas per 4-GPU node: A, A, B
    w.advance(200)
    assert w.scale("chat", a.rank_id, 4, "up").replicas_launched == 4  # r4 fills B's free slot
    w.advance(400)
    rk = w.ranks[w.live_rank[a.rank_id]]
    reps = [w.replicas[i] for i in rk.replicas]
    hosts = {}
    for r in reps:
        hosts.setdefault(r.instances[0], []).append(r.idx)
    assert sorted(len(v) for v in hosts.values()) == [2, 2]
    first = min(hosts, key=lambda iid: min(hosts[iid]))
    w._end_replica(w.replicas[min(hosts[first])], "node_failure")  # r1 is lost; its node keeps r2
    free_before = next(p for p in w.capacity().pools if p.instance_type == "g6e.12xlarge").free_instances
    assert w.scale("chat", a.rank_id, 2, "down", drain_s=0.0).status is LaunchStatus.LAUNCHED
    pool = next(p for p in w.capacity().pools if p.instance_type == "g6e.12xlarge")
    assert pool.free_instances == free_before + 1
    assert all(w.replicas[i].state != "serving" for i in hosts[first])
