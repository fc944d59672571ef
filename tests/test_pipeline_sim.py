"""The in-process runner (what benchmarks call) over the simulator with the real S2–S5."""

from __future__ import annotations

import pytest

from infra.sim import load_scenario, sim_world_provider
from koi.pipeline import InProcessWorldProvider, Runtime, run_tick, run_ticks
from koi.pipeline.messages import TickOutcome
from koi.store import get_evidence, get_fence, get_plan_row, init_db, make_engine, session_scope

CLUSTER = "bench-sim"


@pytest.fixture
def engine(tmp_path):
    eng = make_engine(f"sqlite:///{tmp_path / 'koi.db'}")
    init_db(eng)
    yield eng
    eng.dispose()


def demo_jobs():
    return [j.job for j in load_scenario("demo").jobs]


def test_run_ticks_over_the_simulator_commits_and_learns(engine):
    rt = Runtime(engine=engine, world=sim_world_provider(), interval_s=300.0)
    out = run_ticks(rt, CLUSTER, 3, jobs=demo_jobs())
    assert [r.outcome for r in out] == [TickOutcome.COMMITTED] * 3
    assert out[0].deploy.launched >= 4 and out[0].plan.proposer == "deterministic"
    assert out[1].observe.n_windows > 0 and out[1].evidence.n_rows > 0
    assert out[2].world_now == pytest.approx(600.0)
    assert {"s0_snapshot", "s4_plan", "s6_deploy", "total"} <= set(out[0].timings)
    with session_scope(engine) as s:
        assert get_fence(s, CLUSTER) == 2 and get_plan_row(s, CLUSTER, 2).committed
        assert len(get_evidence(s, CLUSTER, tick=1)) == out[1].evidence.n_rows


def test_an_in_process_world_and_a_raising_proposer(engine):
    """A benchmark owns its world object (no checkpoints); a failing proposer falls back to keep-all."""
    from koi.sim.world import World

    world = World(load_scenario("demo"), cluster_id=CLUSTER)
    rt = Runtime(engine=engine, world=InProcessWorldProvider(worlds={CLUSTER: world}), interval_s=300.0)
    first = run_ticks(rt, CLUSTER, 1, jobs=demo_jobs())[0]
    assert first.outcome is TickOutcome.COMMITTED and len(world.deployments()) == first.deploy.launched

    def broken(ctx):
        raise RuntimeError("the planner fell over")

    res = run_tick(rt, CLUSTER, 1, proposer=broken)
    assert res.outcome is TickOutcome.FALLBACK and res.failed_stage == "s4_plan"
    assert "the planner fell over" in res.reason and res.compensation.undone == 0
    assert len(world.deployments()) == first.deploy.launched  # keep-all: the fleet is unchanged


def test_a_rank_keeps_the_tick_it_was_launched_at_when_the_world_reports_it(engine):
    """The simulator reports what runs but not when we launched it; the launch tick is ours. A rank first seen
    in the snapshot of tick t was launched by tick t − 1's plan, and every later snapshot (and the deployments
    table) says so — not tick 0, which the world's report carried before."""
    from koi.domain import ClusterSnapshot
    from koi.store import Stage, get_deployments, load_stage_model

    rt = Runtime(engine=engine, world=sim_world_provider(), interval_s=300.0)
    out = run_ticks(rt, CLUSTER, 5, jobs=demo_jobs())
    assert [r.outcome for r in out] == [TickOutcome.COMMITTED] * 5
    first: dict[str, int] = {}
    with session_scope(engine) as s:
        snaps = [load_stage_model(s, CLUSTER, t, Stage.S0_SNAPSHOT, ClusterSnapshot) for t in range(5)]
        table = {d.rank_id: d.since_tick for d in get_deployments(s, CLUSTER, live_only=True)}
    for snap in snaps:
        for d in snap.deployments:
            first.setdefault(d.rank_id, snap.tick)
            assert d.since_tick == first[d.rank_id] - 1, (snap.tick, d.rank_id)
    late = {d.rank_id for d in snaps[4].deployments if first[d.rank_id] > 1}
    assert "agent-moe" in {d.job_id for d in snaps[4].deployments if d.rank_id in late}  # arrives at 900 s
    seen = [r for r in table if r in first]  # the table after tick 4's deploy: the ranks that still run
    assert seen and all(table[r] == first[r] - 1 for r in seen)
