"""The tick pipeline in process, on the ledger world, with stub S2–S5: fallback, fence, idempotency."""

from __future__ import annotations

import pytest

from infra.ledger import LedgerWorld, ledger_provider
from koi.domain import (
    Action,
    ActionType,
    ChainConfig,
    Environment,
    Job,
    Ladder,
    Plan,
    Pool,
    Rank,
    ResourceMap,
)
from koi.pipeline import ProposeContext, Runtime, Verdict, deploy, run_tick, run_ticks, stages
from koi.pipeline.messages import StageRef, TickOutcome
from koi.pipeline.world import decode_checkpoint, load_checkpoint
from koi.store import get_fence, get_plan_row, get_tick, init_db, list_deploys, make_engine, session_scope

CLUSTER = "c-test"
ENV = Environment(cloud="aws", region="us-east-1", zone="use1-az1", market="on_demand", gpu_type="L4")


def resources() -> ResourceMap:
    return ResourceMap(pools=[Pool(env=ENV, instance_type="g6.xlarge", gpus_per_instance=1, total_instances=8,
                                   free_instances=8, hourly_price=0.8)])


def make_job(i: int, submitted_at: float = 0.0) -> Job:
    return Job.model_validate({
        "job_id": f"job-{i}", "model": "llama-3.1-8b", "job_class": "online",
        "workload": {"input_len": {"mean": 512, "std": 100}, "output_len": {"mean": 128, "std": 30},
                     "arrival": {"rate_rps": 2.0}},
        "slo": {"p99_ttft_ms": 2000, "p99_tpot_ms": 100}, "submitted_at": submitted_at,
    })


def rank(n: int = 1) -> Rank:
    return Rank(env=ENV, config=ChainConfig(instance_type="g6.xlarge"), n_replicas=n)


def place_all(ctx: ProposeContext) -> Plan:
    actions = []
    for js in ctx.snapshot.jobs:
        if js.status.value == "pending":
            actions.append(Action(job_id=js.job.job_id, type=ActionType.PLACE, ladder=Ladder(ranks=[rank()])))
        else:
            actions.append(Action(job_id=js.job.job_id, type=ActionType.KEEP))
    return Plan(actions=actions, proposer="place_all")


def always_valid(session, cluster_id, tick, snapshot, plan) -> Verdict:
    return Verdict(valid=True, plan=plan)


@pytest.fixture
def rt(tmp_path):
    eng = make_engine(f"sqlite:///{tmp_path / 'koi.db'}")
    init_db(eng)
    r = Runtime(engine=eng, world=ledger_provider(resources()), proposers={"place_all": place_all},
                default_proposer="place_all", validator=always_valid, s2=lambda s, c, t: {}, s3=lambda s, c, t: {},
                interval_s=60.0)
    yield r
    eng.dispose()


def world(rt) -> LedgerWorld:
    with session_scope(rt.engine) as s:
        return LedgerWorld.restore(decode_checkpoint(load_checkpoint(s, CLUSTER)[1]))


def test_ticks_commit_and_jobs_arrive_on_the_cluster_clock(rt):
    out = run_ticks(rt, CLUSTER, 3, jobs=[make_job(0), make_job(1, submitted_at=60.0)])
    assert [r.outcome for r in out] == [TickOutcome.COMMITTED] * 3
    assert out[0].deploy.launched == 1 and out[1].deploy.launched == 1 and out[2].deploy.launched == 0
    assert sorted(d.job_id for d in out[-1].deployments) == ["job-0", "job-1"]
    assert out[-1].job_status == {"job-0": "active", "job-1": "active"}
    w = world(rt)
    assert w.now() == 180.0 and all(n == 1 for n in w.launches.values())
    with session_scope(rt.engine) as s:
        assert get_fence(s, CLUSTER) == 2
        assert get_tick(s, CLUSTER, 1).status == "committed"


def test_a_raising_planner_falls_back_and_the_next_tick_commits(rt):
    def boom(ctx):
        raise RuntimeError("planner exploded")

    rt.proposers["boom"] = boom
    run_ticks(rt, CLUSTER, 0, jobs=[make_job(0)])
    r0 = run_tick(rt, CLUSTER, 0, proposer="boom")
    assert r0.outcome is TickOutcome.FALLBACK and r0.failed_stage == "s4_plan" and "planner exploded" in r0.reason
    r1 = run_tick(rt, CLUSTER, 1)
    assert r1.outcome is TickOutcome.COMMITTED and r1.deploy.launched == 1


def test_an_invalid_plan_gets_one_repair_round_then_keep_all(rt):
    calls = []

    def picky(session, cluster_id, tick, snapshot, plan):
        calls.append(tick)
        return Verdict(valid=False, plan=plan, violations=["C2: does not fit"])

    rt.validator = picky
    run_ticks(rt, CLUSTER, 0, jobs=[make_job(0)])
    r = run_tick(rt, CLUSTER, 0)
    assert r.outcome is TickOutcome.FALLBACK and len(calls) == 2 and "C2" in r.reason
    assert "s4_plan.1" in r.timings
    with session_scope(rt.engine) as s:
        assert not get_plan_row(s, CLUSTER, 0).committed and get_fence(s, CLUSTER) is None
    assert world(rt).ranks == {}


def test_partial_deploy_is_rolled_back_and_a_reset_redeploys(rt):
    run_ticks(rt, CLUSTER, 0, jobs=[make_job(0), make_job(1)])
    # job-1's launch is refused after job-0's went through
    with session_scope(rt.engine) as s:
        found = load_checkpoint(s, CLUSTER)
        w = LedgerWorld.restore(decode_checkpoint(found[1]))
        w.fail_launches.add("job-1")
        from koi.pipeline.world import encode_checkpoint, save_checkpoint
        save_checkpoint(s, CLUSTER, found[0], encode_checkpoint(w.checkpoint(), w.now()))
    r = run_tick(rt, CLUSTER, 0)
    assert r.outcome is TickOutcome.FALLBACK and r.failed_stage == "s6_deploy"
    assert r.compensation.undone == 1 and world(rt).ranks == {}
    # ops fix the cause and re-run S6 of the same tick (what a Temporal reset does)
    with session_scope(rt.engine) as s:
        found = load_checkpoint(s, CLUSTER)
        w = LedgerWorld.restore(decode_checkpoint(found[1]))
        w.fail_launches.clear()
        save_checkpoint(s, CLUSTER, found[0], encode_checkpoint(w.checkpoint(), w.now()))
    d = deploy.s6_deploy(rt, StageRef(cluster_id=CLUSTER, tick=0))
    assert d.committed and d.launched == 2 and d.epoch == 1
    assert sorted(world(rt).ranks) == sorted(rank().rank_id(f"job-{i}") for i in range(2))
    with session_scope(rt.engine) as s:
        keys = [r.idempotency_key for r in list_deploys(s, CLUSTER, 0)]
    assert any(k.endswith("#e1") for k in keys) and any(k.endswith(":undo") for k in keys)


def test_s6_retried_deploys_nothing_twice(rt):
    run_ticks(rt, CLUSTER, 0, jobs=[make_job(0), make_job(1)])
    ref = StageRef(cluster_id=CLUSTER, tick=0)
    for fn in (stages.s0_snapshot, stages.s1_observe, stages.s2_validate, stages.s3_slow_update, stages.s4_plan,
               stages.s5_validate_plan):
        fn(rt, ref)
    first = deploy.s6_deploy(rt, ref)
    again = deploy.s6_deploy(rt, ref)
    assert first.launched == 2 and again.launched == 0 and again.duplicates == 2
    assert all(n == 1 for n in world(rt).launches.values())


def test_the_fence_refuses_a_stale_tick(rt):
    run_ticks(rt, CLUSTER, 0, jobs=[make_job(0)])
    ref0 = StageRef(cluster_id=CLUSTER, tick=0)
    for fn in (stages.s0_snapshot, stages.s1_observe, stages.s2_validate, stages.s3_slow_update, stages.s4_plan,
               stages.s5_validate_plan):
        fn(rt, ref0)
    r1 = run_tick(rt, CLUSTER, 1)  # a newer tick commits first
    assert r1.outcome is TickOutcome.COMMITTED
    from koi.pipeline.errors import StaleTick

    with pytest.raises(StaleTick):
        deploy.s6_deploy(rt, ref0)
    with session_scope(rt.engine) as s:
        assert get_fence(s, CLUSTER) == 1 and get_plan_row(s, CLUSTER, 1).committed
    assert all(n == 1 for n in world(rt).launches.values())


def test_a_cancelled_job_is_released_at_the_next_commit(rt):
    from koi.pipeline.messages import SyncJobsInput

    run_ticks(rt, CLUSTER, 1, jobs=[make_job(0), make_job(1)])
    assert len(world(rt).ranks) == 2
    stages.sync_jobs(rt, SyncJobsInput(cluster_id=CLUSTER, tick=1, cancelled=["job-1"]))
    r = run_tick(rt, CLUSTER, 1)
    assert r.outcome is TickOutcome.COMMITTED and r.deploy.torn_down == 1
    assert sorted(world(rt).ranks) == [rank().rank_id("job-0")]
    assert r.job_status == {"job-0": "active", "job-1": "cancelled"}
    assert [d.job_id for d in r.deployments] == ["job-0"]


def test_a_job_past_its_lifetime_finishes_and_is_released(rt):
    job = make_job(0).model_copy(update={"lifetime_s": 90.0})
    out = run_ticks(rt, CLUSTER, 3, jobs=[job])  # t = 0, 60, 120
    assert out[0].deploy.launched == 1 and out[2].snapshot.finished_jobs == ["job-0"]
    assert out[2].deploy.torn_down == 1 and world(rt).ranks == {}
    assert out[2].job_status == {"job-0": "finished"}


def test_a_stale_rerun_of_a_committed_tick_undoes_nothing(rt):
    """Resetting a tick that had committed, after a newer tick committed: the fence refuses the
    re-run and keep-all must not tear down what that tick had launched."""
    from koi.pipeline.errors import StaleTick

    run_ticks(rt, CLUSTER, 2, jobs=[make_job(0), make_job(1, submitted_at=60.0)])
    before = dict(world(rt).ranks)
    assert len(before) == 2
    with pytest.raises(StaleTick):
        deploy.s6_deploy(rt, StageRef(cluster_id=CLUSTER, tick=0))
    comp = deploy.compensate_keep_all(rt, StageRef(cluster_id=CLUSTER, tick=0), "StaleTick")
    assert comp.undone == 0 and world(rt).ranks == before


def test_an_active_job_that_lost_its_ranks_is_placed_again(rt):
    run_ticks(rt, CLUSTER, 1, jobs=[make_job(0)])
    assert len(world(rt).ranks) == 1
    _edit_world(rt, lambda w: w.ranks.clear())  # e.g. every replica reclaimed
    r = run_tick(rt, CLUSTER, 1)
    assert r.snapshot.n_pending == 1 and r.outcome is TickOutcome.COMMITTED and r.deploy.launched == 1
    assert r.job_status == {"job-0": "active"}


def _edit_world(rt, fn) -> None:
    from koi.pipeline.fencing import lock_cluster
    from koi.pipeline.world import encode_checkpoint, save_checkpoint

    with session_scope(rt.engine) as s:
        lock_cluster(s, CLUSTER)
        at, payload = load_checkpoint(s, CLUSTER)
        w = LedgerWorld.restore(decode_checkpoint(payload))
        fn(w)
        save_checkpoint(s, CLUSTER, at, encode_checkpoint(w.checkpoint(), w.now()))


def _split(w0: float, w1: float) -> Ladder:
    return Ladder(ranks=[rank().model_copy(update={"route_weight": w0}),
                         Rank(env=ENV, config=ChainConfig(instance_type="g6.xlarge", max_num_seqs=128), n_replicas=1,
                              route_weight=w1)])


def test_a_keeps_gateway_weights_are_applied_committed_and_undone_by_keep_all(rt):
    """Tick 0 places a two-rank ladder at 1:1; tick 1 keeps it at 3:1 — S6 re-weighs both ranks
    without a launch and the deployments table follows; when a later operation of the tick fails,
    keep-all puts the old weights back."""
    ids = [r.rank_id("job-0") for r in _split(1.0, 1.0).ranks]

    def reweigh(ctx: ProposeContext) -> Plan:
        acts = []
        for js in ctx.snapshot.jobs:
            if js.job.job_id == "job-0" and js.status.value == "pending":
                acts.append(Action(job_id="job-0", type=ActionType.PLACE, ladder=_split(1.0, 1.0)))
            elif js.job.job_id == "job-0":
                acts.append(Action(job_id="job-0", type=ActionType.KEEP, route_weights={ids[0]: 3.0, ids[1]: 1.0}))
            else:
                acts.append(Action(job_id=js.job.job_id, type=ActionType.PLACE, ladder=Ladder(ranks=[rank()])))
        return Plan(actions=acts, proposer="reweigh")

    rt.proposers["reweigh"] = reweigh
    rt.default_proposer = "reweigh"
    run_ticks(rt, CLUSTER, 1, jobs=[make_job(0), make_job(1, submitted_at=120.0)])  # job-1 arrives at tick 2
    r = run_tick(rt, CLUSTER, 1)
    assert r.outcome is TickOutcome.COMMITTED and (r.deploy.reweighted, r.deploy.launched) == (1, 0)  # 1.0 → 1.0 is no op
    weights = lambda: {rid: v["rank"]["route_weight"] for rid, v in world(rt).ranks.items()}  # noqa: E731
    assert weights() == {ids[0]: 3.0, ids[1]: 1.0}
    from koi.store import get_deployments

    with session_scope(rt.engine) as s:
        assert {d.rank_id: d.rank.route_weight for d in get_deployments(s, CLUSTER, live_only=True)} == weights()
    # tick 2: the keep re-weighs back to 1:1 (first wave) and job-1's launch is refused → keep-all
    rt.proposers["reweigh"] = lambda ctx: Plan(proposer="reweigh", actions=[
        Action(job_id="job-0", type=ActionType.KEEP, route_weights={ids[0]: 1.0, ids[1]: 2.0}),
        Action(job_id="job-1", type=ActionType.PLACE, ladder=Ladder(ranks=[rank()]))])
    _edit_world(rt, lambda w: w.fail_launches.add("job-1"))
    r = run_tick(rt, CLUSTER, 2)
    assert r.outcome is TickOutcome.FALLBACK and r.compensation.undone == 2
    assert weights() == {ids[0]: 3.0, ids[1]: 1.0}
