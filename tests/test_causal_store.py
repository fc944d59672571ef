"""S2 + S3 on a temporary SQLite store: persistence, idempotent re-runs, exact replay, why-queries and the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_causal_support import CLUSTER, env, online_job, prediction, rank, store_engine, window  # noqa: F401
from typer.testing import CliRunner

from koi.calibration import SlowState, run_s3
from koi.causal.mechanisms import admit, default_mechanisms
from koi.causal.store import load_beliefs, load_registry, persist_admitted
from koi.causal.updates import apply_evidence, initial_beliefs
from koi.causal.why import (
    why_job_from_store,
    why_mechanism_from_store,
    why_outcome_from_store,
    why_rank_from_store,
)
from koi.domain import ClusterSnapshot, Deployment, JobState
from koi.evidence import build_inputs, run_s2, validate
from koi.store import (
    PerfRecord,
    Stage,
    get_evidence,
    load_slow_state_as,
    save_deployments,
    save_job,
    save_perf_records,
    save_prediction,
    save_stage_output,
    save_telemetry,
    session_scope,
)

ENVS = [env(gpu="H100"), env(gpu="A100-80GB", region="us-west-2", zone="usw2-az1"),
        env(gpu="L40S", cloud="gcp", region="us-central1", zone="us-central1-a")]
PRED = {
    "kv_pressure_score": 0.7, "kv_cache_util": 0.6, "pipeline_bubble_fraction": 0.2, "comm_overhead_pct": 12.0,
    "per_tok_comm_bytes": 65536.0, "queue_depth": 3.0, "live_batch_size": 48.0, "preemption_rate": 0.5,
    "input_length_observed": 2000.0, "output_length_observed": 300.0, "kvcache_hit_rate": 0.1,
    "gpu_mem_used_fraction": 0.9, "vram_headroom_gb": 8.0,
    "p99_ttft_ms": 600.0, "p99_tpot_ms": 40.0, "throughput_tokens_per_sec": 1200.0, "cost_per_token": 2e-6,
    "slo_margin": 0.2,
}
#: the simulated world: per environment, relative bias of some variables (the surrogate does not know these)
BIAS = [{}, {"comm_overhead_pct": 0.5, "p99_tpot_ms": 0.3}, {"queue_depth": 1.0, "p99_ttft_ms": 0.25}]
TICKS = 6


def deployments():
    jobs = [online_job(job_id=f"j{i}") for i in range(3)]
    ranks = [rank(e, tp=4, pp=2) for e in ENVS]
    return jobs, ranks


def populate(engine, ticks: int = TICKS) -> None:
    rng = np.random.default_rng(0)
    jobs, ranks = deployments()
    with session_scope(engine) as s:
        for j in jobs:
            save_job(s, CLUSTER, j, "active")
        deps = [Deployment(job_id=j.job_id, rank=r, state="serving", replicas_ready=1) for j, r in zip(jobs, ranks, strict=True)]
        save_deployments(s, CLUSTER, deps, 0)
        for t in range(0, ticks + 1):
            snap = ClusterSnapshot(cluster_id=CLUSTER, tick=t, now=300.0 * t,
                                   jobs=[JobState(job=j, status="active") for j in jobs], deployments=deps)
            save_stage_output(s, CLUSTER, t, Stage.S0_SNAPSHOT, snap, input_digest="")
            for j, r, bias in zip(jobs, ranks, BIAS, strict=True):
                rid, eid = r.rank_id(j.job_id), r.env.env_id
                if t == 0 or t % 3 == 0:  # the planner re-predicts every few ticks; kept ranks use the older one
                    save_prediction(s, prediction(rid, j.job_id, eid, t, PRED))
                if t == 0:
                    continue
                data = {k: (v * (1 + bias.get(k, 0.0)) + rng.normal(0, 0.02 * abs(v), 30)).tolist() for k, v in PRED.items()}
                save_telemetry(s, window(rid, j.job_id, eid, t, data))
                obs_y = {k: float(np.mean(data[k])) for k in ("p99_ttft_ms", "p99_tpot_ms", "throughput_tokens_per_sec",
                                                            "cost_per_token", "slo_margin")}
                save_perf_records(s, [PerfRecord.of(CLUSTER, t, j, r, observed_v={}, observed_y=obs_y,
                                                    predicted={k: PRED[k] for k in obs_y}, n_samples=30)])


def run_all(engine, ticks: int = TICKS) -> None:
    for t in range(1, ticks + 1):
        with session_scope(engine) as s:
            run_s2(s, CLUSTER, t)
        with session_scope(engine) as s:
            run_s3(s, CLUSTER, t)


@pytest.fixture(scope="module")
def populated(tmp_path_factory):
    """One populated store for the read-only tests (and the re-run test, which must leave it unchanged)."""
    from koi.store import init_db, make_engine

    eng = make_engine(f"sqlite:///{tmp_path_factory.mktemp('store') / 'koi.db'}")
    init_db(eng)
    populate(eng)
    run_all(eng)
    yield eng
    eng.dispose()


def snapshot_of(engine):
    with session_scope(engine) as s:
        rows = [r.model_dump() for r in get_evidence(s, CLUSTER, start=0)]
        beliefs = load_beliefs(s, CLUSTER, TICKS)
        slow = load_slow_state_as(s, CLUSTER, SlowState, TICKS)
    return rows, beliefs, slow


def test_s2_writes_one_row_per_tick_and_rank(populated) -> None:
    with session_scope(populated) as s:
        rows = get_evidence(s, CLUSTER, start=0)
    assert len(rows) == 3 * TICKS
    assert len({(r.tick, r.rank_id) for r in rows}) == 3 * TICKS
    assert all(r.mechanisms for r in rows)  # pp=2, tp=4 dense 70B: the seeds apply and are observable
    names = {m.name for m in default_mechanisms().values()}
    assert "pp_bubbles_dense_large" in names
    # the environments with hidden biases diverge where the bias is
    by_env = {r.env_id: r for r in rows if r.tick == TICKS}
    l40s = by_env[ENVS[2].env_id]
    assert {c.variable: c.verdict.value for c in l40s.cusum}["queue_depth"] == "diverged"


def test_rerunning_a_tick_changes_nothing(populated) -> None:
    before = snapshot_of(populated)
    for t in (3, TICKS):
        with session_scope(populated) as s:
            run_s2(s, CLUSTER, t)
        with session_scope(populated) as s:
            run_s3(s, CLUSTER, t)
    after = snapshot_of(populated)
    assert after[0] == before[0]
    assert after[1] == before[1]
    assert after[2] == before[2]


def test_replaying_s2_and_s3_from_stored_inputs_reproduces_beliefs_exactly(populated) -> None:
    with session_scope(populated) as s:
        for t in range(1, TICKS + 1):
            replay = validate(build_inputs(s, CLUSTER, t))
            assert [r.model_dump() for r in replay] == [r.model_dump() for r in get_evidence(s, CLUSTER, t)]
        registry = load_registry(s, CLUSTER, None)
        beliefs = initial_beliefs(CLUSTER, registry)
        for t in range(1, TICKS + 1):
            beliefs = apply_evidence(beliefs, get_evidence(s, CLUSTER, t), mechanisms=registry)
        stored = load_beliefs(s, CLUSTER, TICKS)
    assert beliefs.edges == stored.edges
    assert beliefs.mechanisms == stored.mechanisms
    seed = initial_beliefs(CLUSTER, registry)
    assert beliefs.edges != seed.edges  # something was learned


def test_slow_state_is_persisted_per_tick(populated) -> None:
    with session_scope(populated) as s:
        states = [load_slow_state_as(s, CLUSTER, SlowState, t) for t in range(1, TICKS + 1)]
    assert [st.tick for st in states] == list(range(1, TICKS + 1))
    last = states[-1]
    assert len(last.q_history) == TICKS
    assert last.z_star["class:online"]["p99_ttft_ms"] < PRED["p99_ttft_ms"] * 1.1
    assert abs(sum(last.weights["online"].values()) - 1.0) < 1e-9
    assert last.coverage_history  # band checks were derived from the PerfDB


def test_admitted_mechanism_is_registered_and_learns(store_engine) -> None:  # noqa: F811
    populate(store_engine, ticks=3)
    res = admit({"edge_ids": ["pp->pipeline_bubble_fraction", "pipeline_bubble_fraction->cost_per_token"],
                 "scope": {"conditions": [{"feature": "pp", "op": "==", "value": 2}]}, "narrative": "n"},
                default_mechanisms(), tick=1)
    assert res.admitted
    with session_scope(store_engine) as s:
        persist_admitted(s, CLUSTER, 1, res.mechanism)
    run_all(store_engine, ticks=3)
    with session_scope(store_engine) as s:
        reg = load_registry(s, CLUSTER, None)
        b = load_beliefs(s, CLUSTER, 3)
        rows = get_evidence(s, CLUSTER, 3)
    mid = res.mechanism_id
    assert mid in reg
    assert any(me.mechanism_id == mid for r in rows for me in r.mechanisms)
    assert b.mechanisms[mid] != reg[mid].prior  # it was tested at ticks 2 and 3 and moved off Beta(1, 1)


def test_why_queries_from_store(populated) -> None:
    jobs, ranks = deployments()
    rid = ranks[0].rank_id(jobs[0].job_id)
    with session_scope(populated) as s:
        job = why_job_from_store(s, CLUSTER, "j0")
        rk = why_rank_from_store(s, CLUSTER, rid)
        mv = why_mechanism_from_store(s, CLUSTER, "pp_bubbles_dense_large")
        out = why_outcome_from_store(s, CLUSTER, "p99_ttft_ms")
        with pytest.raises(KeyError):
            why_job_from_store(s, CLUSTER, "nope")
    assert job.ranks[0].rank_id == rid
    assert rk.mechanisms and all(len(m.history) == TICKS for m in rk.mechanisms)
    assert "pp_bubbles_dense_large" in {m.name for m in rk.mechanisms}
    assert sum(mv.quadrants.values()) == 3 * TICKS and mv.belief_history
    assert "kv_pressure_score" in {p.mediator for p in out.mediators}
    assert {"tp", "gpu_mem_util"} <= {d.decision for d in out.decisions}


def test_why_cli(populated, tmp_path) -> None:
    from koi.cli import app

    url = str(populated.url)
    runner = CliRunner()
    jobs, ranks = deployments()
    rid = ranks[1].rank_id(jobs[1].job_id)
    for args in (["why", "outcome", "p99_ttft_ms"], ["why", "job", "j1"], ["why", "rank", rid],
                 ["why", "mechanism", "pp_bubbles_dense_large"]):
        res = runner.invoke(app, [*args, "--json", "--url", url, "--cluster", CLUSTER])
        assert res.exit_code == 0, res.output
        doc = json.loads(res.stdout)
        assert doc
    res = runner.invoke(app, ["why", "outcome", "kv_pressure_score", "--url", url])
    assert res.exit_code != 0
    # without a store the outcome walk uses the seed table; job queries fail clearly
    missing = f"sqlite:///{tmp_path / 'none.db'}"
    res = runner.invoke(app, ["why", "outcome", "p99_ttft_ms", "--json", "--url", missing])
    assert res.exit_code == 0 and json.loads(res.stdout)["outcome"] == "p99_ttft_ms"
    res = runner.invoke(app, ["why", "job", "j1", "--url", missing])
    assert res.exit_code != 0 and not (tmp_path / "none.db").exists()


def test_s2_s3_on_both_backends_are_idempotent(engine) -> None:
    """The shared ``engine`` fixture (SQLite and PostgreSQL): three ticks, then a re-run of each changes nothing."""
    populate(engine, ticks=3)
    run_all(engine, ticks=3)

    def state():
        with session_scope(engine) as s:
            return ([r.model_dump() for r in get_evidence(s, CLUSTER, start=0)], load_beliefs(s, CLUSTER, 3),
                    load_slow_state_as(s, CLUSTER, SlowState, 3))

    before = state()
    run_all(engine, ticks=3)
    assert state() == before
    assert len(before[0]) == 9
