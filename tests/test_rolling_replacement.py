"""A swap into a full pool on the simulated world: S6's rolling replacement keeps part of the old
rank serving through the new chain's cold start, where releasing all of it took the job dark."""

from __future__ import annotations

import numpy as np

from koi.domain import ChainConfig, ClusterSnapshot, JobState, JobStatus, Ladder, Rank
from koi.domain.plan import Action, Plan
from koi.pipeline.deploy import Op, plan_ops
from koi.sim.records import Status
from koi.sim.testing import chat_job, tiny_scenario
from koi.sim.world import World

POOL = {"name": "l40s", "cloud": "aws", "region": "us-east-1", "market": "on_demand",
        "instance_type": "g6e.12xlarge", "instances": 4}  # fmt: skip
LIFECYCLE = {"provision_s": 60, "load_gbps": 2.0, "warmup_s": 20}  # a cold start of ~90 s


def _world() -> World:
    return World(tiny_scenario(pools=[POOL], jobs=[chat_job(rate=6.0)], lifecycle=LIFECYCLE, duration_s=1200))


def _rank(world: World, tp: int, n: int) -> Rank:
    p = world.scenario.pools[0]
    return Rank(env=world.scenario.environment(p), config=ChainConfig(instance_type=p.instance_type, tp=tp),
                n_replicas=n)  # fmt: skip


def _apply(world: World, op: Op) -> None:
    """What S6's ``_apply`` asks the executor for, without the store."""
    job = world.jobs[world.job_index[op.job_id]].job
    if op.kind == "launch":
        world.launch(job, op.rank, op.key)
    elif op.kind == "scale":
        world.scale(op.job_id, op.rank_id, op.n_replicas, op.key, drain_s=op.drain_s)
    else:
        world.teardown(op.job_id, op.rank_id, op.key, drain_s=op.drain_s, handover=op.handover)


def _swap(world: World, ops: list[Op] | None = None) -> tuple[float, np.ndarray]:
    """Run 16 × TP1 on the whole pool, swap to 4 × TP2 (half the pool) at t = 300 s with S6's
    operations (or ``ops``); return the swap time and the records of requests that arrived in the
    three minutes after it."""
    job = world.jobs[world.job_index["chat"]].job
    old = world.launch(job, _rank(world, 1, 16), "old")
    world.advance(300)
    snap = ClusterSnapshot(cluster_id="c", tick=1, now=world.now(),
                           jobs=[JobState(job=job, status=JobStatus.ACTIVE, admitted_tick=0)],
                           deployments=world.deployments(), resources=world.capacity())  # fmt: skip
    assert snap.resources.pools[0].free_instances == 0 and snap.deployments[0].rank_id == old.rank_id
    plan = Plan(tick=1, cluster_id="c", proposer="deterministic",
                actions=[Action(job_id="chat", type="swap", ladder=Ladder(ranks=[_rank(world, 2, 4)]))])
    for op in ops if ops is not None else plan_ops(snap, plan, "c", 1, 0, drain_s=30.0):
        _apply(world, op)
    t0 = world.now()
    world.advance(t0 + 600)
    rec = world.records()
    return t0, rec[(rec["arrival"] >= t0) & (rec["arrival"] < t0 + 180)]


def test_a_rolling_replacement_keeps_serving_through_the_cold_start() -> None:
    world = _world()
    t0, rolling = _swap(world)
    kinds = [e["kind"] for e in world.events()]
    assert "teardown_deferred" in kinds  # the old rank's remaining half was handed over
    ttft = rolling["first_token"] - rolling["arrival"]
    served_early = np.sum(np.isfinite(ttft) & (rolling["first_token"] < t0 + 60))
    assert served_early > 0.3 * 6.0 * 60  # the kept half serves from the start
    assert np.sum(rolling["status"] == Status.DROPPED) == 0

    # the same swap releasing the whole old rank first: nothing is served until the new chain is up
    dark = _world()
    job = dark.jobs[dark.job_index["chat"]].job
    old_id = _rank(dark, 1, 16).rank_id("chat")
    new = _rank(dark, 2, 4)
    t1, all_at_once = _swap(dark, [Op("teardown", "chat", _rank(dark, 1, 16), old_id, "down"),
                                   Op("launch", "chat", new, new.rank_id(job.job_id), "new", n_replicas=4)])  # fmt: skip
    assert t1 == t0
    ttft_dark = all_at_once["first_token"] - all_at_once["arrival"]
    assert np.sum(np.isfinite(ttft_dark) & (all_at_once["first_token"] < t1 + 60)) == 0
    # requests that arrived in the first minute and met the 2-s TTFT target: most, against none
    early = rolling["arrival"] < t0 + 60
    assert np.mean(np.nan_to_num(ttft[early], nan=np.inf) <= 2.0) > 0.9
    early = all_at_once["arrival"] < t1 + 60
    assert np.mean(np.nan_to_num(ttft_dark[early], nan=np.inf) <= 2.0) == 0.0


def test_keep_all_undoes_a_rolling_replacement_whose_launch_was_refused(tmp_path) -> None:
    """S6 scaled the old rank in, then the cloud refused the new rank: keep-all scales it back, so
    the job runs on the whole pool again, and a reset of the tick deploys the swap afresh."""
    from fakes.swap_cluster import JOB, NEW, OLD, swap_runtime

    from infra.ledger import LedgerWorld
    from koi.pipeline import deploy, run_tick, run_ticks
    from koi.pipeline.messages import StageRef, TickOutcome
    from koi.pipeline.world import decode_checkpoint, encode_checkpoint, load_checkpoint, save_checkpoint
    from koi.store import session_scope

    rt = swap_runtime(f"sqlite:///{tmp_path / 'koi.db'}")

    def ledger(edit=None) -> LedgerWorld:  # noqa: ANN001
        with session_scope(rt.engine) as s:
            found = load_checkpoint(s, "c")
            w = LedgerWorld.restore(decode_checkpoint(found[1]))
            if edit is not None:
                edit(w)
                save_checkpoint(s, "c", found[0], encode_checkpoint(w.checkpoint(), w.now()))
        return w

    assert run_ticks(rt, "c", 1, jobs=[JOB])[0].outcome is TickOutcome.COMMITTED
    ledger(lambda w: w.fail_launches.add(NEW.rank_id("chat")))
    r = run_tick(rt, "c", 1)
    assert r.outcome is TickOutcome.FALLBACK and r.failed_stage == "s6_deploy"
    assert r.compensation.undone == 1  # the partial release
    w = ledger()
    assert list(w.ranks) == [OLD.rank_id("chat")] and w.ranks[OLD.rank_id("chat")]["instances"] == 8
    assert w.resources.pools[0].free_instances == 0
    ledger(lambda w: w.fail_launches.clear())
    d = deploy.s6_deploy(rt, StageRef(cluster_id="c", tick=1))
    assert d.committed and d.scaled == 1 and d.launched == 1 and d.torn_down == 1
    assert sorted(ledger().ranks) == [NEW.rank_id("chat")]
    rt.engine.dispose()
