"""The store on SQLite and PostgreSQL: round-trips, idempotent writes, migrations (the fence:
test_store_fence.py).

Every test taking ``engine`` or ``db_url`` runs on both backends (tests/conftest.py).
"""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa
from test_store_fence import _race, _race_plain

from koi import store
from koi.domain import (
    Action,
    ActionType,
    Arrival,
    ChainConfig,
    ClusterSnapshot,
    CusumResult,
    Deployment,
    DeploymentState,
    Environment,
    EvidenceRow,
    IcpVerdict,
    Job,
    JobClass,
    JobState,
    JobStatus,
    Ladder,
    LengthDist,
    MechanismEvidence,
    Plan,
    Prediction,
    Quadrant,
    Rank,
    Slo,
    TelemetryWindow,
    Verdict,
    WorkloadProfile,
)
from koi.store import migrations
from koi.store.tables import ALL_TABLES, TABLE_NAMES

C = "test-cluster"


# ---- domain builders -----------------------------------------------------------------------------
def env(cloud: str = "aws", gpu: str = "H100", market: str = "on_demand") -> Environment:
    region, zone = ("us-east-1", "use1-az1") if cloud == "aws" else ("us-central1", "us-central1-a")
    return Environment(cloud=cloud, region=region, zone=zone, market=market, gpu_type=gpu)


def online_job(job_id: str = "chat-1", submitted_at: float = 0.0, rate: float = 2.0) -> Job:
    return Job(
        job_id=job_id,
        model="llama-3.1-8b",
        workload=WorkloadProfile(
            kind="chat",
            input_len=LengthDist(mean=512, std=128, min=16, max=4096),
            output_len=LengthDist(mean=256, std=64, min=1, max=2048),
            arrival=Arrival(rate_rps=rate),
        ),
        job_class=JobClass.ONLINE,
        slo=Slo(p99_ttft_ms=800, p99_tpot_ms=60),
        submitted_at=submitted_at,
    )


def batch_job(job_id: str = "batch-1") -> Job:
    return Job(
        job_id=job_id,
        model="llama-3.1-8b",
        workload=WorkloadProfile(
            kind="summarization",
            input_len=LengthDist(mean=2048, std=256, min=64, max=8192),
            output_len=LengthDist(mean=128, std=32, min=1, max=1024),
        ),
        job_class=JobClass.BATCH,
        slo=Slo(deadline_s=3600, num_requests=10_000),
        submitted_at=5.0,
    )


def rank(cloud: str = "aws", tp: int = 1, n: int = 2) -> Rank:
    return Rank(
        env=env(cloud), config=ChainConfig(tp=tp, max_num_seqs=128), n_replicas=n, mechanism_id="M_tp"
    )


def plan(tick: int, n_actions: int = 2) -> Plan:
    actions = [
        Action(
            job_id="chat-1",
            type=ActionType.PLACE,
            ladder=Ladder(ranks=[rank("aws"), rank("gcp", tp=2, n=1)]),
            target_tps=1500.0,
            mechanism_id="M_tp",
            rationale="cheapest feasible",
        ),
        Action(job_id="batch-1", type=ActionType.DEFER, rationale="no capacity"),
        Action(job_id="chat-2", type=ActionType.KEEP),
    ][:n_actions]
    return Plan(tick=tick, cluster_id=C, actions=actions, tick_rationale="test", proposer="deterministic")


def window(tick: int, rank_id: str = "chat-1/r1", n: int = 3) -> TelemetryWindow:
    times = [tick * 300.0 + 10.0 * i for i in range(n)]
    return TelemetryWindow(
        cluster_id=C,
        tick=tick,
        job_id="chat-1",
        rank_id=rank_id,
        env_id=env().env_id,
        t_start=times[0],
        t_end=times[-1] + 10.0,
        times=times,
        series={
            "kv_cache_util": [0.5 + 0.01 * i for i in range(n)],
            "p99_ttft_ms": [420.0 + i for i in range(n)],
        },
    )


def prediction(tick: int, rank_id: str = "chat-1/r1") -> Prediction:
    return Prediction(
        cluster_id=C,
        tick=tick,
        job_id="chat-1",
        rank_id=rank_id,
        env_id=env().env_id,
        values={"kv_cache_util": 0.48, "p99_ttft_ms": 400.0},
        flags=["rescaled_gpu"],
    )


def evidence(tick: int, rank_id: str = "chat-1/r1") -> EvidenceRow:
    return EvidenceRow(
        cluster_id=C,
        tick=tick,
        job_id="chat-1",
        rank_id=rank_id,
        env_id=env().env_id,
        n_samples=3,
        cusum=[
            CusumResult(
                variable="p99_ttft_ms",
                verdict=Verdict.DIVERGED,
                s_plus=5.1,
                s_minus=0.0,
                delta=0.5,
                h=4.0,
                residual_mean=20.0,
                residual_std=1.0,
                n=3,
            )
        ],
        mechanisms=[
            MechanismEvidence(
                mechanism_id="M_tp",
                v_verdict=Verdict.MATCHED,
                y_verdict=Verdict.DIVERGED,
                quadrant=Quadrant.Q2,
                edges=["tp->comm_overhead_pct"],
            )
        ],
        icp={"tp->comm_overhead_pct": IcpVerdict.ACCEPT},
        residuals={"p99_ttft_ms": [20.0, 21.0, 19.0]},
    )


def count(engine, table) -> int:
    with engine.connect() as conn:
        return conn.execute(sa.select(sa.func.count()).select_from(table.__table__)).scalar_one()


# ---- schema and migrations ------------------------------------------------------------------------
def test_migrated_schema_is_head_and_matches_the_models(engine, db_url):
    from alembic.autogenerate import compare_metadata
    from alembic.runtime.migration import MigrationContext

    assert store.current_revision(db_url) == store.head_revision() == "0002"
    with engine.connect() as conn:
        assert set(sa.inspect(conn).get_table_names()) >= TABLE_NAMES
        ctx = MigrationContext.configure(
            conn,
            opts={
                "compare_type": True,
                "include_object": lambda o, name, type_, r, c: type_ != "table" or name in TABLE_NAMES,
            },
        )
        assert compare_metadata(ctx, migrations.target_metadata) == []


def test_upgrade_from_0001_keeps_rows(db_url):
    """A database created at the previous revision upgrades to head without loss; a second upgrade is a no-op."""
    assert store.current_revision(db_url) is None
    assert store.upgrade(db_url, "0001") == "0001"
    eng = store.make_engine(db_url)
    try:
        assert "perfdb" not in sa.inspect(eng).get_table_names()
        with store.session_scope(eng) as s:
            store.save_job(s, C, online_job("chat-1"), JobStatus.ACTIVE)
            store.save_job(s, C, batch_job("batch-1"))
            store.save_edge_beliefs(s, C, 1, {"tp->comm_overhead_pct": (3.0, 1.0)})
            assert store.advance_fence(s, C, 1)
        assert store.upgrade(db_url) == "0002"
        assert store.upgrade(db_url) == "0002"  # idempotent
        eng.dispose()
        with store.session_scope(eng) as s:
            jobs = store.get_jobs(s, C)
            assert [j.job.job_id for j in jobs] == ["chat-1", "batch-1"]
            assert jobs[0].job == online_job("chat-1") and jobs[0].status is JobStatus.ACTIVE
            assert store.load_edge_beliefs(s, C) == {"tp->comm_overhead_pct": (3.0, 1.0)}
            assert store.get_fence(s, C) == 1
            # the new revision's tables work
            store.save_stage_output(s, C, 1, store.Stage.S0_SNAPSHOT, {"ok": True}, "in")
        # and down again to 0001 drops only the new tables
        assert store.downgrade(db_url, "0001") == "0001"
        with store.session_scope(eng) as s:
            assert len(store.get_jobs(s, C)) == 2
        assert "stage_outputs" not in sa.inspect(eng).get_table_names()
    finally:
        eng.dispose()


@pytest.mark.postgres
def test_concurrent_upgrades_on_postgres_serialise(pg_url):
    """Workers starting at once (separate processes, and threads in one process) all migrate one empty database."""
    import subprocess
    import sys

    code = "import sys; from koi.store import upgrade; print(upgrade(sys.argv[1]))"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, pg_url], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [err for _, err in outs]
    assert [out.strip() for out, _ in outs] == ["0002"] * 3
    results = _race_plain(lambda: store.upgrade(pg_url), n=3)
    assert results == ["0002"] * 3
    assert store.current_revision(pg_url) == store.head_revision()


def test_make_engine_defaults_to_sqlite_under_data_dir(tmp_path, monkeypatch):
    from koi.config import get_settings

    monkeypatch.setenv("KOI_DATA_DIR", str(tmp_path / "nested" / "dir"))
    monkeypatch.delenv("KOI_DATABASE_URL", raising=False)
    get_settings.cache_clear()
    try:
        eng = store.make_engine()
        assert eng.dialect.name == "sqlite"
        with eng.connect() as conn:
            assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
            assert conn.exec_driver_sql("PRAGMA foreign_keys").scalar() == 1
        assert (tmp_path / "nested" / "dir" / "koi.db").exists()
        eng.dispose()
    finally:
        get_settings.cache_clear()


def test_postgres_urls_use_psycopg3():
    assert store.normalise_url("postgresql://u@h/db").drivername == "postgresql+psycopg"
    assert store.normalise_url("postgres://u@h/db").drivername == "postgresql+psycopg"
    with pytest.raises(ValueError, match="SQLite or PostgreSQL"):
        store.make_engine("mysql://u@h/db")


# ---- round trips -------------------------------------------------------------------------------------
def test_jobs_round_trip(engine):
    with store.session_scope(engine) as s:
        store.save_job(s, C, online_job("chat-1"))
        store.save_job(s, C, batch_job("batch-1"), JobStatus.ACTIVE)
        store.save_job(s, "other", online_job("chat-1"))
    with store.session_scope(engine) as s:
        jobs = store.get_jobs(s, C)
        assert [j.job for j in jobs] == [online_job("chat-1"), batch_job("batch-1")]
        assert [j.job.job_id for j in store.get_jobs(s, C, JobStatus.ACTIVE)] == ["batch-1"]
        assert len(store.get_jobs(s, C, [JobStatus.ACTIVE, "pending"])) == 2
        assert store.set_job_status(s, C, "chat-1", JobStatus.ACTIVE, admitted_tick=3, completed_requests=7)
        assert not store.set_job_status(s, C, "nope", JobStatus.ACTIVE)
        got = store.get_job(s, C, "chat-1")  # read after write in the same session is fresh
        assert got == JobState(
            job=online_job("chat-1"), status=JobStatus.ACTIVE, admitted_tick=3, completed_requests=7
        )
        assert store.get_job(s, C, "nope") is None


def test_ticks_round_trip(engine):
    with store.session_scope(engine) as s:
        store.save_tick(s, C, 1, store.TickStatus.RUNNING)
        store.save_tick(s, C, 2, store.TickStatus.KEEP_ALL, "S5 failed twice", {"S4_plan": 1.5})
        store.save_tick(s, C, 1, store.TickStatus.COMMITTED, timings={"S0_snapshot": 0.1, "S6_deploy": 2.0})
    with store.session_scope(engine) as s:
        ticks = store.list_ticks(s, C)
        assert [(t.tick, t.status) for t in ticks] == [(1, "committed"), (2, "keep_all")]
        assert ticks[0].timings == {"S0_snapshot": 0.1, "S6_deploy": 2.0}
        assert ticks[1].reason == "S5 failed twice"
        assert [t.tick for t in store.list_ticks(s, C, newest_first=True, limit=1)] == [2]
        assert [t.tick for t in store.list_ticks(s, C, status="keep_all")] == [2]
        assert store.get_tick(s, C, 1).created_at is not None
    assert count(engine, ALL_TABLES[1]) == 2


def test_plans_and_actions_round_trip(engine):
    p1, p2 = plan(1), plan(2, n_actions=3)
    with store.session_scope(engine) as s:
        store.save_plan(s, C, p1, committed=True)
        store.save_plan(s, C, p2)
    with store.session_scope(engine) as s:
        assert store.get_plan(s, C, 1) == p1
        assert store.get_plan(s, C, 2) == p2
        assert store.get_plan(s, C, 3) is None
        assert store.latest_committed_plan(s, C) == p1
        assert store.mark_plan_committed(s, C, 2)
        assert not store.mark_plan_committed(s, C, 9)
        assert store.latest_committed_plan(s, C) == p2
        assert store.latest_committed_plan(s, C, before=2) == p1
        rows = store.list_actions(s, C, tick=2)
        assert [(r.seq, r.job_id, r.action_type) for r in rows] == [
            (0, "chat-1", "place"),
            (1, "batch-1", "defer"),
            (2, "chat-2", "keep"),
        ]
        assert rows[0].ladder_key == p2.actions[0].ladder.key
        assert [r.tick for r in store.list_actions(s, C, job_id="chat-1")] == [1, 2]
        # a re-proposed plan with fewer actions replaces the action rows
        store.save_plan(s, C, plan(2, n_actions=1))
        assert len(store.list_actions(s, C, tick=2)) == 1
        assert store.get_plan_row(s, C, 2).n_actions == 1
    with pytest.raises(ValueError, match="belongs to cluster"), store.session_scope(engine) as s:
        store.save_plan(s, "elsewhere", p1)


def test_deployments_round_trip(engine):
    r1, r2 = rank("aws"), rank("gcp", tp=2, n=1)
    d1 = Deployment(
        job_id="chat-1",
        rank=r1,
        state=DeploymentState.SERVING,
        since_tick=1,
        replicas_ready=2,
        idempotency_key=store.deploy_key(C, 1, "chat-1", r1.rank_id("chat-1")),
    )
    d2 = Deployment(job_id="chat-1", rank=r2, state=DeploymentState.LAUNCHING, since_tick=2)
    with store.session_scope(engine) as s:
        store.save_deployments(s, C, [d1, d2], tick=2)
    with store.session_scope(engine) as s:
        assert sorted(store.get_deployments(s, C), key=lambda d: d.rank_id) == sorted(
            [d1, d2], key=lambda d: d.rank_id
        )
        d2.state = DeploymentState.TERMINATED
        store.save_deployment(s, C, d2, tick=3)
        assert store.get_deployments(s, C, live_only=True) == [d1]
        assert len(store.get_deployments(s, C, job_id="chat-1")) == 2
    # the snapshot S0 builds from them round-trips as a stage output
    snap = ClusterSnapshot(
        cluster_id=C, tick=3, now=900.0, jobs=[JobState(job=online_job())], deployments=[d1, d2]
    )
    with store.session_scope(engine) as s:
        store.save_stage_output(s, C, 3, store.Stage.S0_SNAPSHOT, snap, store.digest({"tick": 3}))
    with store.session_scope(engine) as s:
        assert store.load_stage_model(s, C, 3, store.Stage.S0_SNAPSHOT, ClusterSnapshot) == snap


def test_telemetry_predictions_evidence_round_trip(engine):
    with store.session_scope(engine) as s:
        store.save_telemetry(s, [window(1), window(1, "chat-1/r2"), window(2)])
        store.save_prediction(s, [prediction(1), prediction(2)])
        store.save_evidence(s, evidence(1))
        store.save_evidence(s, [evidence(2), evidence(3)])
    with store.session_scope(engine) as s:
        assert store.get_telemetry(s, C, 1) == [window(1), window(1, "chat-1/r2")]
        assert store.get_telemetry(s, C, 1, rank_id="chat-1/r2") == [window(1, "chat-1/r2")]
        assert store.get_telemetry(s, C, start=2) == [window(2)]
        assert store.get_predictions(s, C, 2) == [prediction(2)]
        assert store.get_evidence(s, C, 1) == [evidence(1)]
        assert store.get_evidence(s, C, start=2, end=3) == [evidence(2), evidence(3)]
        assert store.get_evidence(s, C, end=1, job_id="chat-1") == [evidence(1)]
        assert store.get_evidence(s, "other", 1) == []
        with pytest.raises(ValueError, match="either tick or"):
            store.get_evidence(s, C, 1, start=0)


def test_beliefs_as_of_a_tick(engine):
    e1, e2 = "tp->comm_overhead_pct", "comm_overhead_pct->p99_tpot_ms"
    with store.session_scope(engine) as s:
        store.save_edge_beliefs(s, C, 1, {e1: (1.0, 1.0), e2: (2.0, 1.0)})
        store.save_edge_beliefs(s, C, 3, {e1: (4.0, 1.5)})  # only e1 updated at tick 3
        mech = {
            "mechanism_id": "M_tp",
            "edges": [e1, e2],
            "scope": {"model_type": "dense_small"},
            "state": "active",
        }
        store.save_mechanism_beliefs(s, C, 1, {"M_tp": (1.0, 1.0)}, {"M_tp": mech})
        store.save_mechanism_beliefs(s, C, 2, {"M_tp": (2.0, 1.0)}, {"M_tp": {**mech, "state": "probation"}})
    with store.session_scope(engine) as s:
        assert store.load_edge_beliefs(s, C, 0) == {}
        assert store.load_edge_beliefs(s, C, 2) == {e1: (1.0, 1.0), e2: (2.0, 1.0)}
        assert store.load_edge_beliefs(s, C, 3) == {e1: (4.0, 1.5), e2: (2.0, 1.0)}
        assert store.load_edge_beliefs(s, C) == store.load_edge_beliefs(s, C, 99)
        assert store.edge_belief_history(s, C, e1) == [(1, 1.0, 1.0), (3, 4.0, 1.5)]
        m = store.load_mechanism_beliefs(s, C, 1)["M_tp"]
        assert (m.alpha, m.beta, m.tick, m.definition) == (1.0, 1.0, 1, mech)
        assert store.load_mechanism_beliefs(s, C)["M_tp"].definition["state"] == "probation"
        with pytest.raises(ValueError, match="positive"):
            store.save_edge_beliefs(s, C, 4, {e1: (0.0, 1.0)})
        with pytest.raises(ValueError, match="finite"):
            store.save_edge_beliefs(s, C, 4, {e1: (float("nan"), 1.0)})
        with pytest.raises(ValueError, match="no definition"):
            store.save_mechanism_beliefs(s, C, 4, {"M_x": (1.0, 1.0)}, {})


def test_slow_state_as_of_a_tick(engine):
    import numpy as np
    from pydantic import BaseModel

    class Slow(BaseModel):
        beta: float
        w: list[float]

    with store.session_scope(engine) as s:
        assert store.load_slow_state(s, C) is None
        store.save_slow_state(s, C, 1, {"beta": np.float64(0.5), "w": np.array([0.2, 0.8])})
        store.save_slow_state(s, C, 4, Slow(beta=0.7, w=[0.5, 0.5]))
    with store.session_scope(engine) as s:
        assert store.load_slow_state(s, C, 1) == {"beta": 0.5, "w": [0.2, 0.8]}
        assert store.load_slow_state(s, C, 3) == {"beta": 0.5, "w": [0.2, 0.8]}
        assert store.load_slow_state_as(s, C, Slow) == Slow(beta=0.7, w=[0.5, 0.5])
        assert store.load_slow_state_row(s, C, 3).tick == 1


def test_perfdb_round_trip_and_query(engine):
    job = online_job("chat-1")
    recs = [
        store.PerfRecord.of(
            C,
            1,
            job,
            rank("aws", tp=1),
            observed_v={"kv_cache_util": 0.5},
            observed_y={"throughput_tokens_per_sec": 900.0, "p99_ttft_ms": 420.0},
            predicted={"p99_ttft_ms": 400.0},
            n_samples=30,
        ),
        store.PerfRecord.of(
            C, 1, job, rank("gcp", tp=2, n=1), observed_v={}, observed_y={"p99_ttft_ms": 300.0}
        ),
        store.PerfRecord.of(
            C,
            2,
            online_job("chat-9", rate=9.0),
            rank("aws", tp=1),
            observed_v={},
            observed_y={"p99_ttft_ms": 900.0},
        ),
    ]
    with store.session_scope(engine) as s:
        store.save_perf_records(s, recs)
    with store.session_scope(engine) as s:
        assert store.query_perf(s) == recs
        assert store.query_perf(s, model="llama-3.1-8b", gpu_type="H100", cloud="gcp") == [recs[1]]
        assert store.query_perf(s, tp=1, rate_range=(0.0, 5.0)) == [recs[0]]
        assert store.query_perf(s, config_key=rank("aws", tp=1).config.key, since_tick=2) == [recs[2]]
        assert store.query_perf(s, until_tick=1) == recs[:2]  # a replay of tick 1 sees no later record
        assert store.query_perf(s, since_tick=1, until_tick=1) == recs[:2]
        assert store.query_perf(s, isl_range=(1000, 2000)) == []
        assert store.query_perf(s, model="qwen3-8b") == []
    with pytest.raises(ValueError, match="unknown variable"):
        store.PerfRecord.of(C, 1, job, rank(), observed_v={"p99_ttft_ms": 1.0}, observed_y={})


def test_perfdb_reads_see_in_place_updates_and_return_independent_records(engine):
    """Reads reuse validated records by row content: an upsert of the same key must be seen, and a
    caller changing what it got must not change the next read."""
    job = online_job("chat-1")
    first = store.PerfRecord.of(C, 1, job, rank("aws"), observed_v={}, observed_y={"p99_ttft_ms": 420.0})
    with store.session_scope(engine) as s:
        store.save_perf_record(s, first)
    with store.session_scope(engine) as s:
        got = store.query_perf(s, cluster_id=C)
        assert got == [first]
        got[0].observed_y["p99_ttft_ms"] = -1.0
        got[0].n_samples = 99
        assert store.query_perf(s, cluster_id=C) == [first]
    again = first.model_copy(update={"observed_y": {"p99_ttft_ms": 510.0}, "predicted": {"p99_ttft_ms": 400.0}})
    with store.session_scope(engine) as s:
        store.save_perf_record(s, again)
    with store.session_scope(engine) as s:
        assert store.query_perf(s, cluster_id=C) == [again]


def test_stage_outputs_round_trip_and_digests(engine):
    p = plan(5)
    with store.session_scope(engine) as s:
        out = store.save_stage_output(s, C, 5, store.Stage.S4_PLAN, p, input_digest=store.digest({"tick": 5}))
        store.save_stage_output(s, C, 5, "custom_stage", [1, 2, 3], "x")
    with store.session_scope(engine) as s:
        row = store.load_stage_output(s, C, 5, "S4_plan")
        assert row.output_digest == out == store.digest(p)
        assert row.input_digest == store.digest({"tick": 5})
        assert Plan.model_validate(row.payload) == p
        assert store.load_stage_output(s, C, 5, "custom_stage").payload == [1, 2, 3]
        assert [r.stage for r in store.list_stage_outputs(s, C, 5)] == ["S4_plan", "custom_stage"]
        assert store.load_stage_output(s, C, 6, "S4_plan") is None


def test_non_finite_payloads_are_refused_on_both_backends(engine):
    with pytest.raises(Exception, match="non-finite"), store.session_scope(engine) as s:
        store.save_slow_state(s, C, 1, {"x": float("inf")})
    with store.session_scope(engine) as s:
        assert store.load_slow_state(s, C) is None


# ---- idempotency --------------------------------------------------------------------------------------
def _write_a_tick(engine, tick: int) -> None:
    """Everything one tick writes; called twice it must leave the same rows."""
    r = rank("aws")
    d = Deployment(job_id="chat-1", rank=r, state=DeploymentState.SERVING, since_tick=tick)
    with store.session_scope(engine) as s:
        store.save_job(s, C, online_job("chat-1"), JobStatus.ACTIVE)
        store.save_tick(s, C, tick, "committed")
        store.save_plan(s, C, plan(tick), committed=True)
        store.save_deployment(s, C, d, tick)
        store.save_telemetry(s, window(tick))
        store.save_prediction(s, prediction(tick))
        store.save_evidence(s, evidence(tick))
        store.save_edge_beliefs(s, C, tick, {"tp->comm_overhead_pct": (2.0, 1.0)})
        store.save_mechanism_beliefs(s, C, tick, {"M_tp": (2.0, 1.0)}, {"M_tp": {"id": "M_tp"}})
        store.save_slow_state(s, C, tick, {"beta": 0.5})
        store.save_perf_record(s, store.PerfRecord.of(C, tick, online_job(), r, observed_v={}, observed_y={}))
        store.save_stage_output(s, C, tick, store.Stage.S2_VALIDATE, [evidence(tick)], "in")
        store.record_deploy(s, C, tick, "chat-1", r.rank_id("chat-1"))
        store.advance_fence(s, C, tick)


def test_repeated_writes_leave_one_row(engine):
    _write_a_tick(engine, 1)
    counts = {t.__tablename__: count(engine, t) for t in ALL_TABLES}
    _write_a_tick(engine, 1)
    assert {t.__tablename__: count(engine, t) for t in ALL_TABLES} == counts
    assert all(n >= 1 for n in counts.values()), counts
    assert counts["actions"] == 2
    _write_a_tick(engine, 2)
    assert count(engine, ALL_TABLES[0]) == 1  # the job is per cluster, not per tick
    with store.session_scope(engine) as s:
        assert store.get_fence(s, C) == 2


def test_upsert_updates_and_dedupes(engine):
    from koi.store.tables import EdgeBeliefRow

    key = ("cluster_id", "edge_id", "tick")
    row = {"cluster_id": C, "tick": 1, "edge_id": "a->b", "alpha": 1.0, "beta": 1.0}
    with store.session_scope(engine) as s:
        assert store.upsert(s, EdgeBeliefRow, [row, {**row, "alpha": 2.0}], key) == 1  # last wins
        store.upsert(s, EdgeBeliefRow, {**row, "alpha": 3.0}, key, update_cols=[])  # insert-if-absent
        assert store.load_edge_beliefs(s, C) == {"a->b": (2.0, 1.0)}
        store.upsert(s, EdgeBeliefRow, {**row, "alpha": 5.0, "beta": 9.0}, key, update_cols=["alpha"])
        assert store.load_edge_beliefs(s, C) == {"a->b": (5.0, 1.0)}
        assert store.upsert(s, EdgeBeliefRow, [], key) == 0
        with pytest.raises(ValueError, match="key column"):
            store.upsert(s, EdgeBeliefRow, {"cluster_id": C}, key)


def test_deploy_log_claims_each_key_once(engine):
    key = store.deploy_key(C, 3, "chat-1", "chat-1/abc")
    with store.session_scope(engine) as s:
        assert store.record_deploy(s, C, 3, "chat-1", "chat-1/abc") is True
        assert store.record_deploy(s, C, 3, "chat-1", "chat-1/abc", status="launched") is False
        assert store.get_deploy(s, key).status == "requested"
        assert store.update_deploy(s, key, store.DeployStatus.LAUNCHED, {"instance_ids": ["i-1"]})
        assert not store.update_deploy(s, "missing", "launched")
    with store.session_scope(engine) as s:
        row = store.get_deploy(s, key)
        assert (row.status, row.detail) == ("launched", {"instance_ids": ["i-1"]})
        assert [r.idempotency_key for r in store.list_deploys(s, C, 3)] == [key]
        assert store.list_deploys(s, C, 4) == []


def test_deploy_log_concurrent_claims_one_winner(engine):
    results = _race(engine, lambda s: store.record_deploy(s, C, 7, "chat-1", "chat-1/r"), n=4)
    assert sorted(results) == [False, False, False, True]


def test_perfdb_reads_on_several_threads_share_the_record_cache_safely(engine, monkeypatch):
    """Activity workers run stages on several threads: reads that evict each other's cached records
    (a cache of one entry, the thread switch forced often) must neither fail nor mix up records."""
    import sys

    from koi.store.repos import perf

    recs = [store.PerfRecord.of(C, t, online_job(), rank("aws"), observed_v={}, observed_y={"p99_ttft_ms": 100.0 + t})
            for t in range(4)]
    with store.session_scope(engine) as s:
        store.save_perf_records(s, recs)
    monkeypatch.setattr(perf, "_PARSED_MAX", 1)
    errors: list[BaseException] = []

    def reader(tick: int) -> None:
        try:
            with store.session_scope(engine) as s:
                for _ in range(100):  # every read walks all four rows through a one-entry cache
                    assert store.query_perf(s, cluster_id=C, since_tick=tick) == recs[tick:]
        except BaseException as exc:  # noqa: BLE001 - any failure in a thread fails the test
            errors.append(exc)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        threads = [threading.Thread(target=reader, args=(t % 4,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors[:1]


def test_a_kept_store_is_named_by_its_url_or_its_sqlite_files_path(tmp_path, monkeypatch):
    from koi.store import store_url

    assert store_url("postgresql://127.0.0.1/test") == "postgresql://127.0.0.1/test"
    monkeypatch.chdir(tmp_path)
    assert store_url("run/koi.db") == f"sqlite:///{tmp_path.resolve() / 'run' / 'koi.db'}"
