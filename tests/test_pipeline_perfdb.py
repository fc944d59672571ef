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


def test_batch_records_leave_out_ttft_which_counts_the_jobs_backlog(engine, monkeypatch):
    # a batch request's TTFT is counted from the job's submission (koi.variables.NOT_COMPARABLE):
    # learned from, minutes of backlog would drag the GPU- and environment-level TTFT corrections
    # of the online jobs on the same hardware. The served windows of tick 3 are replayed once as
    # they are (online jobs online, batch jobs batch) and once with every job batch.
    import dataclasses

    from koi.domain import ClusterSnapshot, JobClass
    from koi.evidence import perfdb
    from koi.store import Stage, load_stage_model

    rt = Runtime(engine=engine, world=sim_world_provider(), interval_s=300.0)
    run_ticks(rt, CLUSTER, 4, jobs=[j.job for j in load_scenario("demo").jobs])
    with session_scope(engine) as s:
        snap = load_stage_model(s, CLUSTER, 3, Stage.S0_SNAPSHOT, ClusterSnapshot)
        served = perfdb.served_windows(s, CLUSTER, 3, snap, settled=perfdb.SETTLED_WINDOWS)
        online = perfdb.build_records(s, CLUSTER, 3, snap)

        def as_batch(sv):
            job = sv.job.job.model_copy(update={"job_class": JobClass.BATCH})
            return dataclasses.replace(sv, job=sv.job.model_copy(update={"job": job}))

        monkeypatch.setattr(perfdb, "served_windows", lambda *a, **k: [as_batch(sv) for sv in served])
        batch = perfdb.build_records(s, CLUSTER, 3, snap)
    assert online and len(batch) == len(online)
    # the first replay keeps each job's own class: the online jobs' records carry TTFT
    online_ids = {j.job.job_id for j in load_scenario("demo").jobs if j.job.job_class is JobClass.ONLINE}
    assert any(r.job_id in online_ids for r in online)
    assert all(("p99_ttft_ms" in r.observed_y and "p99_ttft_ms" in r.predicted) == (r.job_id in online_ids)
               for r in online)  # fmt: skip
    assert all("p99_ttft_ms" not in r.observed_y and "p99_ttft_ms" not in r.predicted for r in batch)
    for b, o in zip(batch, online, strict=True):  # everything else is recorded as for an online rank
        assert b.observed_y == {k: v for k, v in o.observed_y.items() if k != "p99_ttft_ms"}
        assert b.observed_v == o.observed_v


def test_record_perf_can_be_switched_off(engine):
    rt = Runtime(engine=engine, world=sim_world_provider(), interval_s=300.0, record_perf=False)
    run_ticks(rt, CLUSTER, 3, jobs=[j.job for j in load_scenario("demo").jobs])
    with session_scope(engine) as s:
        assert query_perf(s, cluster_id=CLUSTER) == []


@pytest.mark.parametrize(("queue", "batch", "seqs", "expected"), [
    (0.1, 32.2, 64, False),    # a healthy chat rank (hetero-3h, chat-70b on H200)
    (15.6, 24.0, 256, False),  # a short queue behind a KV-limited batch well below max_num_seqs
    (1.0, 80.3, 256, False),   # a one-request queue, batch far from full
    (8.4, 61.8, 64, True),     # a queue behind a full batch: arrivals outrun the engine
    (46.7, 74.0, 256, False),  # 46.7 < 64 waiting and the batch not full: not yet
    (64.0, 10.0, 256, True),   # exactly a quarter of max_num_seqs waiting
    (112.3, 74.7, 256, True),  # a queue of a quarter of max_num_seqs or more
])
def test_an_overloaded_window_is_recognised(queue, batch, seqs, expected):
    from koi.evidence.perfdb import overloaded

    assert overloaded({"queue_depth": queue, "live_batch_size": batch}, seqs) is expected
