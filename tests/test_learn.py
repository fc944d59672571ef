"""``koi learn``: the learning loop on the simulator (S1 → S2 → S3 → PerfDB → surrogate refit).

A tiny world: the same two workloads on three H100 environments (two AWS regions and GCP),
one-minute ticks of twelve five-second samples, so ICP's gates (≥ 3 environments × ≥ 15
rank-windows) open after eight validated ticks.
"""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from koi.calibration.learn import _Pricing, learned_surrogate, run_learn
from koi.calibration.learn_report import LearnConfig
from koi.causal.store import load_beliefs, load_registry
from koi.causal.updates import apply_evidence, initial_beliefs
from koi.domain import ClusterSnapshot
from koi.domain.telemetry import IcpVerdict
from koi.evidence import build_inputs, validate, validate_detailed
from koi.sim.scenario import parse_scenario
from koi.sim.testing import chat_job
from koi.store import (
    Stage,
    get_evidence,
    get_predictions,
    init_db,
    load_stage_model,
    make_engine,
    query_perf,
    session_scope,
)
from koi.surrogate import Surrogate

CID = "learn"
TICKS = 10
POOLS = [
    {"name": "use1", "cloud": "aws", "region": "us-east-1", "market": "on_demand", "instance_type": "p5.4xlarge",
     "instances": 2},
    {"name": "usw2", "cloud": "aws", "region": "us-west-2", "market": "on_demand", "instance_type": "p5.4xlarge",
     "instances": 2},
    {"name": "gcp", "cloud": "gcp", "region": "us-central1", "market": "on_demand", "instance_type": "a3-highgpu-1g",
     "instances": 2},
]  # fmt: skip
SLOW_GCP = [{"kind": "efficiency", "match": {"cloud": "gcp"}, "step_time_factor": 1.3, "note": "30% slower"}]


def scenario_dict(hidden: list | None = None) -> dict:
    jobs = []
    for p in POOLS:
        for kind, rate, inp, out in (("chat", 4.0, 600, 150), ("code", 2.0, 1500, 300)):
            jobs.append(chat_job(f"{kind}-{p['name']}", model="llama-3.1-8b", rate=rate, inp=inp, out=out,
                                 deploy=[{"pool": p["name"], "config": {"tp": 1}, "n_replicas": 1}]))
    return {"name": "learn-tiny", "seed": 5, "duration_s": 3600, "sample_s": 5,
            "lifecycle": {"provision_s": 5, "load_gbps": 20.0, "warmup_s": 5},
            "pools": POOLS, "hidden": hidden or [], "jobs": jobs}  # fmt: skip


def engine():
    eng = make_engine("sqlite://")
    init_db(eng)
    return eng


def run(hidden: list | None = None, ticks: int = TICKS, **cfg):
    eng = engine()
    sc = parse_scenario(scenario_dict(hidden))
    report = run_learn(sc, LearnConfig(hours=ticks * 60 / 3600, tick_s=60, **cfg), engine=eng)
    return sc, eng, report


@pytest.fixture(scope="module")
def learned():
    """The loop with learning on, in a world where GCP is 30% slower."""
    sc, eng, report = run(SLOW_GCP)
    yield sc, eng, report
    eng.dispose()


def figures(report) -> list[dict]:
    return [t.model_dump(exclude={"refit_s", "tick_wall_s"}) for t in report.ticks]


# ---- the loop learns ------------------------------------------------------------------------------------
def test_mean_u_of_exercised_edges_falls_as_evidence_accumulates(learned) -> None:
    _, _, report = learned
    us = [t.mean_u_edges for t in report.ticks if t.mean_u_edges is not None]
    assert len(us) >= TICKS - 2
    assert all(b <= a * 1.05 for a, b in zip(us, us[1:], strict=False))  # (nearly) monotone
    assert us[-1] < us[0] / 3
    s = report.summary
    assert s.mean_u_factor is not None and s.mean_u_factor > 3
    assert s.median_u_factor is not None and s.median_u_factor > 1
    assert s.exercised_edges > 10 and s.exercised_mechanisms > 5
    [hour] = report.hourly  # ten one-minute ticks: one (partial) hour, its counts the ticks' sums
    assert (hour.first_tick, hour.last_tick) == (1, TICKS)
    assert hour.decided == sum(t.decided for t in report.ticks)
    assert hour.icp_accept + hour.icp_reject == sum(t.icp_accept + t.icp_reject for t in report.ticks)
    # every rank is predicted from the tick after it comes up, and the surrogate learns
    last = report.ticks[-1]
    assert last.ranks == last.predicted == 6
    tpot = last.errors["p99_tpot_ms"]
    assert tpot.before is not None and tpot.after < tpot.before


def test_the_run_is_deterministic_under_a_seed(learned) -> None:
    _, _, report = learned
    _, eng, again = run(SLOW_GCP)
    eng.dispose()
    assert figures(again) == figures(report)
    assert again.summary == report.summary
    _, eng, other = run(SLOW_GCP, seed=99)
    eng.dispose()
    assert figures(other) != figures(report)


# ---- replay from the store ------------------------------------------------------------------------------
def test_replaying_s2_and_s3_from_the_stored_inputs_reproduces_the_beliefs(learned) -> None:
    _, eng, report = learned
    with session_scope(eng) as s:
        for t in range(1, TICKS + 1):
            stored = get_evidence(s, CID, t)
            assert stored, f"tick {t} has no evidence rows"
            replay = validate(build_inputs(s, CID, t))  # exactly what run_s2 computes from the store
            assert [r.model_dump() for r in replay] == [r.model_dump() for r in stored]
        registry = load_registry(s, CID, None)
        beliefs = initial_beliefs(CID, registry)
        for t in range(1, TICKS + 1):
            beliefs = apply_evidence(beliefs, get_evidence(s, CID, t), mechanisms=registry)
        stored_beliefs = load_beliefs(s, CID, TICKS)
    assert beliefs.edges == stored_beliefs.edges
    assert beliefs.mechanisms == stored_beliefs.mechanisms
    assert beliefs.edges != initial_beliefs(CID, registry).edges
    # the reported U is that of the stored beliefs
    last = report.ticks[-1]
    assert last.mean_u_edges is not None


def test_stored_predictions_are_the_surrogate_refit_on_the_stored_perfdb(learned) -> None:
    sc, eng, report = learned
    cfg = report.config
    pricing = _Pricing(sc)
    jobs = {j.job.job_id: j.job for j in sc.jobs}
    t = TICKS - 2
    with session_scope(eng) as s:
        recs = [r for r in query_perf(s, cluster_id=CID, since_tick=max(0, t - cfg.window_ticks + 1)) if r.tick <= t]
        snap = load_stage_model(s, CID, t, Stage.S0_SNAPSHOT, ClusterSnapshot)
        stored = {p.rank_id: p for p in get_predictions(s, CID, start=t, end=t)}
    assert recs and stored
    fast, full = learned_surrogate(recs), Surrogate.from_records(recs)
    for d in snap.deployments:
        job = jobs[d.job_id]
        rank = d.rank.model_copy(update={"n_replicas": d.replicas_ready})
        price = pricing.per_gpu_hour(rank)
        a = fast.predict_many(job, [rank.chain], n_replicas=rank.n_replicas, price_per_gpu_hour=price,
                              with_capacity=False).rank(0)
        b = full.predict_many(job, [rank.chain], n_replicas=rank.n_replicas, price_per_gpu_hour=price,
                              with_capacity=False).rank(0)
        assert a.values == b.values and a.base_values == b.base_values  # the one-block fit predicts the same
        assert a.to_prediction(CID, t, d.rank_id) == stored[d.rank_id]


# ---- ICP sees an environment-dependent hidden effect ----------------------------------------------------------
def test_an_environment_dependent_effect_makes_icp_reject_the_edges_into_the_affected_child() -> None:
    """GCP 30% slower, surrogate frozen (refit_every=0): the edges into p99 TPOT are rejected; in the
    same world without the effect they are accepted. Edges into an unaffected child (the observed
    input length) are accepted in both."""

    def verdicts(hidden):
        _, eng, report = run(hidden, refit_every=0)
        with session_scope(eng) as s:
            out = validate_detailed(build_inputs(s, CID, TICKS))
        eng.dispose()
        by_child: dict[str, set[IcpVerdict]] = {}
        for e, r in out.icp.items():
            by_child.setdefault(e.split("->")[1], set()).add(r.verdict)
        return by_child, report

    slow, rep_slow = verdicts(SLOW_GCP)
    same, rep_same = verdicts(None)
    assert slow["p99_tpot_ms"] == {IcpVerdict.REJECT}
    assert same["p99_tpot_ms"] == {IcpVerdict.ACCEPT}
    assert slow["input_length_observed"] == same["input_length_observed"] == {IcpVerdict.ACCEPT}
    assert rep_slow.ticks[-1].icp_accept_rate < rep_same.ticks[-1].icp_accept_rate
    # no learning: "after" is the base physics
    e = rep_same.ticks[-1].errors["p99_tpot_ms"]
    assert e.after == e.before


# ---- the command ----------------------------------------------------------------------------------------------
def test_koi_learn_json_and_table(tmp_path) -> None:
    from koi.cli import app

    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(scenario_dict(SLOW_GCP)))
    runner = CliRunner()
    url = f"sqlite:///{tmp_path / 'learn.db'}"
    res = runner.invoke(app, ["learn", str(path), "--hours", "0.05", "--tick-s", "60", "--json", "--db", url])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert [t["tick"] for t in doc["ticks"]] == [1, 2, 3]
    assert {"mean_u_factor", "support_share_first", "icp_accept_last", "epsilon_last"} <= set(doc["summary"])
    assert doc["database"].endswith("learn.db")
    # the same database again: refused (a run needs a fresh cluster)
    res = runner.invoke(app, ["learn", str(path), "--hours", "0.05", "--tick-s", "60", "--json", "--db", url])
    assert res.exit_code != 0 and "fresh" in res.output
    # the table: a row per --every ticks, then the summary
    res = runner.invoke(app, ["learn", str(path), "--hours", "0.05", "--tick-s", "60", "--every", "1",
                              "--db", f"sqlite:///{tmp_path / 'b.db'}"])
    assert res.exit_code == 0, res.output
    assert "ICP acc" in res.stdout and "koi learn: summary" in res.stdout
    # too short a tick for CUSUM
    res = runner.invoke(app, ["learn", str(path), "--tick-s", "20", "--json"])
    assert res.exit_code != 0
