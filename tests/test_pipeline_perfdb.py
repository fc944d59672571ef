"""S1 writes PerfDB: the residual learner and the slow loop see what every serving rank did."""

from __future__ import annotations

import pytest

from infra.sim import load_scenario, sim_world_provider
from koi.pipeline import Runtime, run_ticks, stages
from koi.pipeline.messages import StageRef
from koi.store import init_db, make_engine, query_perf, session_scope

CLUSTER = "perfdb"


@pytest.fixture
def engine(tmp_path):
    eng = make_engine(f"sqlite:///{tmp_path / 'koi.db'}")
    init_db(eng)
    yield eng
    eng.dispose()


def test_serving_ranks_get_one_record_per_tick_and_a_retry_adds_none(engine):
    rt = Runtime(engine=engine, world=sim_world_provider(), interval_s=300.0)
    jobs = [j.job for j in load_scenario("demo").jobs]
    out = run_ticks(rt, CLUSTER, 4, jobs=jobs)
    with session_scope(engine) as s:
        recs = query_perf(s, cluster_id=CLUSTER)
    assert recs, "ranks served full windows but no PerfDB record was written"
    by_tick = {}
    for r in recs:
        by_tick.setdefault(r.tick, set()).add(r.rank_id)
        assert r.predicted and r.observed_y.get("throughput_tokens_per_sec", 0) > 0
    # a rank's first window is partly boot time, so records start once a rank served a whole window
    assert min(by_tick) >= 1
    last = max(by_tick)
    assert len(by_tick[last]) == len({r.rank_id for r in recs if r.tick == last})
    # S1 of a tick that already has records (a retried activity) writes nothing new
    n_before = len(recs)
    stages.s1_observe(rt, StageRef(cluster_id=CLUSTER, tick=last, proposer="deterministic"))
    with session_scope(engine) as s:
        assert len(query_perf(s, cluster_id=CLUSTER)) == n_before
    assert out[last].observe.n_windows >= len(by_tick[last])


def test_record_perf_can_be_switched_off(engine):
    rt = Runtime(engine=engine, world=sim_world_provider(), interval_s=300.0, record_perf=False)
    run_ticks(rt, CLUSTER, 3, jobs=[j.job for j in load_scenario("demo").jobs])
    with session_scope(engine) as s:
        assert query_perf(s, cluster_id=CLUSTER) == []
