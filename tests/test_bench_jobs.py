"""The per-job breakdown (``koi bench jobs``, :mod:`koi.bench.jobs`): the evaluator's formulas per job on
hand-made runs, GPU-hours and swaps from the trace, the mean over seeds, the table's order, and the
command on a cache; one check against a real run (the jobs' SLO tokens add up to the run's)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_bench_evaluator import batch, chat, rec
from test_bench_runner import HOURS, STATIC, write_tiny

from koi.bench.cache import RunCache, RunEvalInputs, RunMeta, RunResult
from koi.bench.evaluator import EvalInputs, TickTrace, evaluate
from koi.bench.jobs import (
    ALL_JOBS,
    IDLE_RESERVED,
    display_rows,
    job_breakdown,
    markdown,
    mean_rows,
    run_job_rows,
)
from koi.bench.policy import Family
from koi.bench.runner import load, run_key, run_one
from koi.sim.records import Status

TICK = 300.0
HORIZON = 1200.0


#: What the hand-made runs' instances cost: chat on reserved and spot, batch on demand, mod nothing;
#: with the fleet's $100 that leaves $22 of reserved capacity no job held.
JOB_COST = {"chat": {"reserved": 40.0, "spot": 8.0}, "mod": {}, "batch": {"on_demand": 30.0}}


def hand_run(sc, policy: str, seed: int, *, late_batch: bool = False, eval_inputs: bool = True,  # noqa: ANN001
             job_cost: dict | None = JOB_COST) -> tuple:
    """Jobs: ``chat`` (online, 10 requests, 2 late on TTFT, one of them also dropped), ``mod`` (online, all
    within target), ``batch`` (2 requests, one served after the deadline when ``late_batch``); fleet $100."""
    jobs = [chat("chat"), chat("mod"), batch("batch", n=2, deadline=900.0)]
    records = [rec(0, 30.0 * i, 0.1, 0.02, 11, Status.SERVED) for i in range(8)]
    records += [rec(0, 400.0, 0.9, 0.02, 11, Status.SERVED), rec(0, 410.0, None, None, 0, Status.DROPPED)]
    records += [rec(1, 20.0 * i, 0.2, 0.01, 11, Status.SERVED) for i in range(5)]
    records += [rec(2, 0.0, 1.0, 0.01, 10, Status.SERVED),
                rec(2, 0.0, 950.0 if late_batch else 1.0, 0.01, 10, Status.SERVED)]
    trace = [TickTrace(tick=n, t=TICK * n, gpus_by_job={"chat": {"H100": 4 if n < 2 else 8}, "batch": {"L4": 2}},
                       actions={"chat": "place", "batch": "place"} if n == 0 else ({"chat": "swap"} if n == 2 else {}),
                       swaps=int(n == 2))
             for n in range(4)]
    run = RunResult(
        key=run_key(sc, policy, seed, HOURS),
        meta=RunMeta(label=policy, family=Family.GLOBAL.value, cluster_id=f"c-{policy}", tick_s=TICK, n_ticks=4,
                     horizon_s=HORIZON, ticks_committed=4, ticks_fallback=0, wall_s=1.0, cpu_s=1.0),
        metrics=evaluate(EvalInputs(jobs=jobs, records=np.concatenate(records), horizon_s=HORIZON,
                                    fleet_cost_usd=100.0, reserved_cost_usd=50.0, admitted_jobs={"chat", "mod", "batch"},
                                    window_s=TICK)),
        trace=trace,
        eval_inputs=RunEvalInputs(jobs=jobs, fleet_cost_usd=100.0, reserved_cost_usd=50.0,
                                  admitted_jobs=["chat", "mod", "batch"], grace_s=60.0) if eval_inputs else None,
        job_cost_usd=job_cost,
    )  # fmt: skip
    return run, np.concatenate(records)


@pytest.fixture()
def sc(tmp_path):
    return load(write_tiny(tmp_path))[0]


def test_each_job_is_scored_by_the_evaluators_formulas_over_its_own_requests(sc):
    run, records = hand_run(sc, "koi", 0)
    rows = {r.job_id: r for r in run_job_rows(run, records)}
    assert list(rows) == ["chat", "mod", "batch", IDLE_RESERVED]
    idle = rows.pop(IDLE_RESERVED)
    c = rows["chat"]
    assert c.requests == 10
    assert c.ttft_pct == pytest.approx(80.0)  # 0.9 s and a drop miss the 500 ms target
    assert c.tpot_pct == pytest.approx(90.0)  # only the dropped request did not finish
    # windows of 300 s: [0, 300) all within target; [300, 600) holds the two misses
    assert c.p99_windows_pct == pytest.approx(50.0)
    assert c.progress_pct is None and c.deadline_met_pct is None
    assert c.slo_tokens == 8 * 11
    assert c.gpu_hours == pytest.approx((4 + 4 + 8 + 8) * TICK / 3600)
    assert c.swaps == 1
    m = rows["mod"]
    assert (m.ttft_pct, m.tpot_pct, m.p99_windows_pct) == (100.0, 100.0, 100.0)
    assert m.gpu_hours == 0.0 and m.swaps == 0  # never in the trace: no GPUs, no swaps
    b = rows["batch"]
    assert b.requests == 2 and b.progress_pct == 100.0 and b.deadline_met_pct == 100.0
    assert b.ttft_pct is None and b.slo_tokens == 20
    assert b.gpu_hours == pytest.approx(4 * 2 * TICK / 3600)
    # nothing is counted twice or lost: the jobs' SLO tokens are the run's
    assert sum(r.slo_tokens for r in rows.values()) == pytest.approx(run.metrics.slo_tokens)
    # dollars by market; the reserved capacity no job held closes the fleet's bill
    assert (c.usd, c.usd_by_market) == (48.0, {"reserved": 40.0, "spot": 8.0})
    assert (m.usd, m.usd_by_market) == (0.0, {}) and (b.usd, b.usd_by_market) == (30.0, {"on_demand": 30.0})
    assert (idle.usd, idle.usd_by_market, idle.gpu_hours) == (22.0, {"reserved": 22.0}, 0.0)
    assert sum(r.usd for r in rows.values()) + idle.usd == pytest.approx(run.metrics.fleet_cost_usd)


def test_a_batch_job_that_misses_its_deadline_earns_no_slo_tokens(sc):
    run, records = hand_run(sc, "koi", 0, late_batch=True)
    rows = run_job_rows(run, records)
    b = {r.job_id: r for r in rows}["batch"]
    assert b.progress_pct == 100.0 and b.deadline_met_pct == 0.0 and b.slo_tokens == 0.0
    assert next(r for r in display_rows(rows) if r["job"] == "batch")["$/M SLO tok"] == "∞"  # $30 for nothing


def test_the_mean_over_seeds_and_the_table_order(sc):
    rows = []
    for seed, late in ((0, False), (1, True)):
        run, records = hand_run(sc, "koi", seed, late_batch=late)
        rows += run_job_rows(run, records)
    # the MILP's batch costs $50 more on demand, its chat $8 less on spot: batch's dollars differ most
    milp_cost = {"chat": {"reserved": 40.0}, "mod": {}, "batch": {"on_demand": 80.0}}
    milp, records = hand_run(sc, "milp", 0, job_cost=milp_cost)
    milp = milp.model_copy(update={"trace": milp.trace[:1]})  # chat holds 4 GPUs one tick
    rows += run_job_rows(milp, records)
    means = mean_rows(rows)
    koi_batch = next(r for r in means if r.policy == "koi" and r.job_id == "batch")
    assert koi_batch.seeds == 2 and koi_batch.deadline_met_pct == 50.0 and koi_batch.slo_tokens == 10.0
    table = display_rows(means)
    assert [(r["job"], r["policy"]) for r in table[:4]] == [("batch", "koi"), ("batch", "milp"), ("chat", "koi"),
                                                            ("chat", "milp")]
    assert table[0]["$"] == "30" and table[1]["$ res / od / spot"] == "0 / 80 / 0"
    # $ per million SLO tokens of the means: Koi's batch earned 20 tokens on one seed of two, at $30 each
    assert table[0]["$/M SLO tok"] == f"{30 / 10 * 1e6:,.2f}" and table[2]["$/M SLO tok"] == f"{48 / 88 * 1e6:,.2f}"
    assert table[2]["$ res / od / spot"] == "40 / 0 / 8"
    idle = [r for r in table if r["job"] == IDLE_RESERVED]
    assert [(r["policy"], r["$"]) for r in idle] == [("koi", "22"), ("milp", "0")]  # 100 − 120 clamps at 0
    totals = [r for r in table if r["job"] == ALL_JOBS]
    assert [t["policy"] for t in totals] == ["koi", "milp"]
    assert totals[0]["GPU-h"] == f"{(2.0 + 4 * 2 * TICK / 3600):,.1f}" and totals[0]["swaps"] == "1.0"
    assert totals[0]["$"] == "100" and totals[0]["$ res / od / spot"] == "62 / 30 / 8"  # the fleet's bill
    assert totals[0]["$/M SLO tok"] == f"{100 / (88 + 55 + 10) * 1e6:,.2f}"
    md = markdown(means, "per job")
    assert md.startswith("# per job") and md.count("\n| chat | ") == 2 and f"| {ALL_JOBS} | milp |" in md


def test_runs_cached_before_dollars_were_recorded_show_none(sc):
    """A run without per-job dollars leaves its jobs' $ blank (never zero), also in a mean with runs that
    have them, and the table falls back to ordering by GPU-hours."""
    rows = []
    for seed, cost in ((0, JOB_COST), (1, None)):
        run, records = hand_run(sc, "koi", seed, job_cost=cost)
        rows += run_job_rows(run, records)
    milp, records = hand_run(sc, "milp", 0, job_cost=None)
    rows += run_job_rows(milp.model_copy(update={"trace": milp.trace[:1]}), records)
    means = mean_rows(rows)
    assert all(r.usd is None and r.usd_by_market is None for r in means)
    table = display_rows(means)
    assert [r["job"] for r in table[:2]] == ["chat", "chat"]  # GPU-hours 2.0 against 1/3
    assert not any(r["job"] == IDLE_RESERVED for r in table)
    assert all(r["$"] == "" and r["$ res / od / spot"] == "" for r in table)


def test_a_run_without_its_records_or_evaluator_inputs_is_named(sc):
    run, records = hand_run(sc, "koi", 3)
    with pytest.raises(FileNotFoundError, match="records of koi seed3"):
        job_breakdown([run], lambda r: None)
    old, _ = hand_run(sc, "koi", 3, eval_inputs=False)
    with pytest.raises(ValueError, match="stores no evaluator inputs"):
        job_breakdown([old], lambda r: records)


def test_the_command_breaks_the_cache_down_by_job(tmp_path):
    from typer.testing import CliRunner

    from koi.cli import app

    path = write_tiny(tmp_path)
    sc, _ = load(path)
    cache = RunCache(tmp_path / "cache")
    for policy in ("koi", "milp"):
        for seed in (0, 1):
            run, records = hand_run(sc, policy, seed, late_batch=policy == "milp" and seed == 1)
            cache.save(run, records)
    base = ["bench", "jobs", "--scenario", str(path), "--cache-dir", str(tmp_path / "cache"), "--hours", str(HOURS)]
    res = CliRunner().invoke(app, [*base, "--policies", "milp,koi", "--json"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert doc["seeds"] == {"milp": [0, 1], "koi": [0, 1]}
    assert [r["policy"] for r in doc["jobs"]][:3] == ["milp"] * 3  # the order asked for
    batch_of = {r["policy"]: r for r in doc["jobs"] if r["job_id"] == "batch"}
    assert batch_of["milp"]["deadline_met_pct"] == 50.0 and batch_of["koi"]["deadline_met_pct"] == 100.0
    assert (tmp_path / "cache" / sc.name / "report" / "jobs.md").read_text().count("| batch |") == 2
    res = CliRunner().invoke(app, [*base, "--policies", "koi,milp"])
    assert res.exit_code == 0 and "chat" in res.output and ALL_JOBS in res.output
    res = CliRunner().invoke(app, [*base, "--policies", "koi,koi-frozen"])
    assert res.exit_code != 0 and "no cached runs" in res.output and "koi-frozen" in res.output
    res = CliRunner().invoke(app, ["bench", "jobs", "--scenario", "nonesuch", "--cache-dir", str(tmp_path / "cache")])
    assert res.exit_code == 2 and "unknown scenario 'nonesuch'" in res.output and res.exception is not None \
        and isinstance(res.exception, SystemExit)


def test_a_real_runs_jobs_add_up_to_the_run(tmp_path):
    path = write_tiny(tmp_path)
    r = run_one(path, STATIC, 0, hours=300 / 3600, cache_dir=tmp_path / "cache")
    rows = job_breakdown([r], lambda run: RunCache(tmp_path / "cache").records(run.key))
    assert {row.job_id for row in rows} == {j.job_id for j in r.eval_inputs.jobs} | {IDLE_RESERVED}
    assert sum(row.slo_tokens for row in rows) == pytest.approx(r.metrics.slo_tokens)
    held = sum(sum(g.values()) for t in r.trace for g in t.gpus_by_job.values())
    assert sum(row.gpu_hours for row in rows) == pytest.approx(held * r.meta.tick_s / 3600) and held > 0
    # the jobs' dollars and the idle reserved capacity are the fleet's bill, market by market
    assert r.job_cost_usd is not None and sum(row.usd for row in rows) == pytest.approx(r.metrics.fleet_cost_usd)
    spent = [row for row in rows if row.job_id != IDLE_RESERVED and row.usd > 0]
    assert spent and all(set(row.usd_by_market) <= {"reserved", "on_demand", "spot"} for row in spent)
