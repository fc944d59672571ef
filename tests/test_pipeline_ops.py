"""S6's operations for a plan: releases first, launches, then a swap's old ranks handed over (make before break)."""

from __future__ import annotations

from koi.domain.chain import ChainConfig, Ladder, Rank
from koi.domain.plan import Action, Plan
from koi.pipeline.deploy import plan_ops
from koi.planning.synthetic import online_job, pool, snapshot, with_running

H100 = ("aws", "p5.48xlarge")
A100 = ("aws", "p4de.24xlarge")


def _rank(p, n: int = 1) -> Rank:
    return Rank(env=p.env, config=ChainConfig(instance_type=p.instance_type, tp=8), n_replicas=n)


def _setup():
    h, a = pool(*H100, "us-east-1", total=3), pool(*A100, "us-east-1", total=2)
    jobs = [online_job("j1", "llama-3.1-8b", rate=4.0, ttft_ms=1000, tpot_ms=30, submitted_at=0),
            online_job("j2", "llama-3.1-8b", rate=4.0, ttft_ms=1000, tpot_ms=30, submitted_at=1)]  # fmt: skip
    snap = with_running(snapshot(jobs, [h, a], tick=3, now=900.0),
                        {"j1": Ladder(ranks=[_rank(a)]), "j2": Ladder(ranks=[_rank(h)])})  # fmt: skip
    return snap, h, a


def _plan(snap, *actions: Action) -> Plan:
    return Plan(tick=snap.tick, cluster_id=snap.cluster_id, actions=list(actions), proposer="deterministic")


def test_a_swap_across_pools_hands_the_old_rank_over_after_the_launch() -> None:
    snap, h, a = _setup()
    ops = plan_ops(snap, _plan(snap, Action(job_id="j1", type="swap", ladder=Ladder(ranks=[_rank(h, n=2)]))),
                   snap.cluster_id, snap.tick, 0, drain_s=30.0)  # fmt: skip
    kinds = [(o.kind, o.job_id, o.handover) for o in ops]
    assert kinds == [("launch", "j1", False), ("teardown", "j1", True)]
    assert ops[1].drain_s == 30.0 and ops[1].rank.env == a.env


def test_a_swap_within_a_pool_hands_over_when_the_pool_has_room() -> None:
    snap, h, _ = _setup()  # H100: 3 instances, j2 holds 1
    tp4 = Rank(env=h.env, config=ChainConfig(instance_type=h.instance_type, tp=4), n_replicas=4)  # 2 instances
    ops = plan_ops(snap, _plan(snap, Action(job_id="j2", type="swap", ladder=Ladder(ranks=[tp4]))),
                   snap.cluster_id, snap.tick, 0, drain_s=30.0)  # fmt: skip
    assert [(o.kind, o.handover) for o in ops] == [("launch", False), ("teardown", True)]
    # 6 replicas = 3 instances: only 2 are free, so the old rank's instance is reused in place
    full = tp4.model_copy(update={"n_replicas": 6})
    ops = plan_ops(snap, _plan(snap, Action(job_id="j2", type="swap", ladder=Ladder(ranks=[full]))),
                   snap.cluster_id, snap.tick, 0, drain_s=30.0)  # fmt: skip
    assert [(o.kind, o.handover, o.drain_s) for o in ops] == [("teardown", False, 0.0), ("launch", False, 0.0)]


def test_a_swap_within_a_full_pool_and_a_preemption_release_at_once() -> None:
    snap, h, _ = _setup()
    plan = _plan(snap, Action(job_id="j2", type="swap", ladder=Ladder(ranks=[Rank(
        env=h.env, config=ChainConfig(instance_type=h.instance_type, tp=4), n_replicas=6)])),
        Action(job_id="j1", type="preempt"))  # fmt: skip
    ops = plan_ops(snap, plan, snap.cluster_id, snap.tick, 0, drain_s=30.0)
    teardowns = [o for o in ops if o.kind == "teardown"]
    assert {o.job_id for o in teardowns} == {"j1", "j2"}
    assert all(not o.handover and o.drain_s == 0.0 for o in teardowns)
    assert ops.index(teardowns[-1]) < [o.kind for o in ops].index("launch")  # released before the launch


def test_a_degraded_rank_asked_for_again_recovers_its_missing_replicas() -> None:
    from koi.domain import DeploymentState

    snap, h, a = _setup()
    two = _rank(a, n=2)
    snap = with_running(snapshot(list(j.job for j in snap.jobs), [h, a], tick=3, now=900.0), {"j1": Ladder(ranks=[two])})
    deps = [d.model_copy(update={"state": DeploymentState.DEGRADED, "replicas_ready": 1}) if d.job_id == "j1" else d
            for d in snap.deployments]  # fmt: skip
    snap = snap.model_copy(update={"deployments": deps})
    ops = plan_ops(snap, _plan(snap, Action(job_id="j1", type="swap", ladder=Ladder(ranks=[two]))),
                   snap.cluster_id, snap.tick, 0, drain_s=30.0)  # fmt: skip
    assert [(o.kind, o.n_replicas, o.prev_replicas, o.detail.get("recover")) for o in ops] == [("scale", 2, 1, True)]
    # a healthy rank asked for at its size is left alone
    healthy = snap.model_copy(update={"deployments": [d.model_copy(update={"state": DeploymentState.SERVING,
                                                                            "replicas_ready": 2}) for d in deps]})
    assert plan_ops(healthy, _plan(healthy, Action(job_id="j1", type="swap", ladder=Ladder(ranks=[two]))),
                    healthy.cluster_id, healthy.tick, 0, drain_s=30.0) == []  # fmt: skip


def test_a_degraded_ranks_scale_counts_from_the_replicas_it_holds() -> None:
    """hetero-12h tick 122: a degraded TP4 rank (3 asked, 2 ready on one node since a spot reclaim)
    grows to 6 beside another job's swap in place in the same pool. The executor scales from the 2
    it holds, so the scale takes 2 of the 2 free nodes, not 1: the pool has no room for the swap's
    launch besides it, and the swap's old rank must be released first, not handed over after."""
    from koi.domain import DeploymentState

    h = pool(*H100, "us-east-1", total=4)
    jobs = [online_job("j1", "llama-3.1-8b", rate=4.0, ttft_ms=1000, tpot_ms=30, submitted_at=0),
            online_job("j2", "llama-3.1-8b", rate=4.0, ttft_ms=1000, tpot_ms=30, submitted_at=1)]  # fmt: skip
    tp4 = Rank(env=h.env, config=ChainConfig(instance_type=h.instance_type, tp=4), n_replicas=3)  # 2 per node
    old = tp4.model_copy(update={"n_replicas": 2})  # one node
    snap = with_running(snapshot(jobs, [h], tick=122, now=36600.0), {"j1": Ladder(ranks=[tp4]), "j2": Ladder(ranks=[old])})
    assert snap.resources.pools[0].free_instances == 1  # as planned: 2 + 1 nodes of 4
    deps = [d.model_copy(update={"state": DeploymentState.DEGRADED, "replicas_ready": 2}) if d.job_id == "j1" else d
            for d in snap.deployments]  # fmt: skip
    # the reclaimed node came back to the pool: the world has 1 + 1 nodes allocated, 2 free
    snap = snap.model_copy(update={"deployments": deps, "resources": snap.resources.model_copy(
        update={"pools": [snap.resources.pools[0].model_copy(update={"free_instances": 2})]})})  # fmt: skip
    new = Rank(env=h.env, config=ChainConfig(instance_type=h.instance_type, tp=8), n_replicas=1)
    plan = _plan(snap, Action(job_id="j1", type="swap", ladder=Ladder(ranks=[tp4.model_copy(update={"n_replicas": 6})])),
                 Action(job_id="j2", type="swap", ladder=Ladder(ranks=[new])))  # fmt: skip
    ops = plan_ops(snap, plan, snap.cluster_id, snap.tick, 0, drain_s=30.0)
    assert [(o.kind, o.job_id, o.n_replicas, o.prev_replicas, o.handover, o.drain_s) for o in ops] == [
        ("teardown", "j2", 0, 0, False, 0.0),  # released first: the launch needs its node
        ("scale", "j1", 6, 2, False, 0.0),  # from the 2 replicas it holds (2 nodes to add)
        ("launch", "j2", 1, 0, False, 0.0),
    ]
    # a degraded rank asked for fewer replicas than requested but more than it holds grows
    ops = plan_ops(snap, _plan(snap, Action(job_id="j1", type="swap", ladder=Ladder(
        ranks=[tp4.model_copy(update={"n_replicas": 4})]))), snap.cluster_id, snap.tick, 0, drain_s=30.0)  # fmt: skip
    assert [(o.kind, o.n_replicas, o.prev_replicas, "recover" in o.detail) for o in ops] == [("scale", 4, 2, False)]


def test_a_swap_into_a_full_pool_releases_only_what_its_launch_lacks() -> None:
    """A rolling replacement: the old rank gives back the instances the new chain needs beyond the
    pool's free ones, keeps serving on the rest, and is handed over once the new chain serves."""
    h = pool(*H100, "us-east-1", total=4)
    jobs = [online_job("j", "llama-3.1-8b", rate=4.0, ttft_ms=1000, tpot_ms=30)]
    old = Rank(env=h.env, config=ChainConfig(instance_type=h.instance_type, tp=1), n_replicas=32)  # 4 nodes
    snap = with_running(snapshot(jobs, [h], tick=5, now=1500.0), {"j": Ladder(ranks=[old])})
    assert snap.resources.pools[0].free_instances == 0
    new = Rank(env=h.env, config=ChainConfig(instance_type=h.instance_type, tp=2), n_replicas=8)  # 2 nodes
    ops = plan_ops(snap, _plan(snap, Action(job_id="j", type="swap", ladder=Ladder(ranks=[new]))),
                   snap.cluster_id, snap.tick, 0, drain_s=30.0)  # fmt: skip
    assert [(o.kind, o.n_replicas, o.prev_replicas, o.handover, o.drain_s) for o in ops] == [
        ("scale", 16, 32, False, 0.0),  # 2 of the 4 nodes given back now, at once
        ("launch", 8, 0, False, 0.0),
        ("teardown", 0, 0, True, 30.0),  # the other 16 replicas serve until the new chain does
    ]
    assert ops[0].rank_id == ops[2].rank_id and ops[0].rank.n_replicas == 16
    assert ops[0].detail == {"action": "swap", "release": "partial"}
    # a successor that needs every node takes the old rank down first, as before
    big = new.model_copy(update={"n_replicas": 16})
    ops = plan_ops(snap, _plan(snap, Action(job_id="j", type="swap", ladder=Ladder(ranks=[big]))),
                   snap.cluster_id, snap.tick, 0, drain_s=30.0)  # fmt: skip
    assert [(o.kind, o.handover) for o in ops] == [("teardown", False), ("launch", False)]


def test_in_place_swaps_of_two_jobs_share_one_pools_deficit_in_plan_order() -> None:
    h = pool(*H100, "us-east-1", total=4)
    jobs = [online_job(j, "llama-3.1-8b", rate=4.0, ttft_ms=1000, tpot_ms=30, submitted_at=i)
            for i, j in enumerate(("a", "b"))]  # fmt: skip
    two = Rank(env=h.env, config=ChainConfig(instance_type=h.instance_type, tp=8), n_replicas=2)
    snap = with_running(snapshot(jobs, [h], tick=5, now=1500.0), {"a": Ladder(ranks=[two]), "b": Ladder(ranks=[two])})
    tp4 = Rank(env=h.env, config=ChainConfig(instance_type=h.instance_type, tp=4), n_replicas=2)  # 1 node
    plan = _plan(snap, Action(job_id="a", type="swap", ladder=Ladder(ranks=[tp4.model_copy(update={"n_replicas": 4})])),
                 Action(job_id="b", type="swap", ladder=Ladder(ranks=[tp4])))  # fmt: skip
    ops = plan_ops(snap, plan, snap.cluster_id, snap.tick, 0, drain_s=30.0)
    # 3 nodes short: job a (first in the plan) gives back both of its nodes, job b the third
    assert [(o.kind, o.job_id, o.n_replicas, o.handover) for o in ops] == [
        ("teardown", "a", 0, False), ("scale", "b", 1, False),
        ("launch", "a", 4, False), ("launch", "b", 2, False),
        ("teardown", "b", 0, True),
    ]
    # 2 short: job a gives back both, job b hands over whole
    plan = _plan(snap, Action(job_id="a", type="swap", ladder=Ladder(ranks=[tp4])),
                 Action(job_id="b", type="swap", ladder=Ladder(ranks=[tp4])))  # fmt: skip
    ops = plan_ops(snap, plan, snap.cluster_id, snap.tick, 0, drain_s=30.0)
    assert [(o.kind, o.job_id, o.handover) for o in ops] == [
        ("teardown", "a", False), ("launch", "a", False), ("launch", "b", False), ("teardown", "b", True)]


def test_release_for_counts_whole_instances() -> None:
    from koi.pipeline.deploy import release_for

    assert release_for(1, 32, 8, 2) == 16  # 8 TP1 replicas per node
    assert release_for(1, 30, 8, 1) == 6  # the half-full node goes first
    assert release_for(16, 3, 8, 3) == 2  # a two-node chain frees two nodes
    assert release_for(8, 2, 8, 5) == 2  # not enough: everything
    assert release_for(8, 2, 8, 0) == 0
