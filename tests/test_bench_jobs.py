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
from koi.bench.jobs import ALL_JOBS, display_rows, job_breakdown, markdown, mean_rows, run_job_rows
from koi.bench.policy import Family
from koi.bench.runner import load, run_key, run_one
from koi.sim.records import Status

TICK = 300.0
HORIZON = 1200.0


def hand_run(sc, policy: str, seed: int, *, late_batch: bool = False, eval_inputs: bool = True) -> tuple:  # noqa: ANN001
    """Jobs: ``chat`` (online, 10 requests, 2 late on TTFT, one of them also dropped), ``mod`` (online, all
    within target), ``batch`` (2 requests, one served after the deadline when ``late_batch``)."""
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
        metrics=evaluate(EvalInputs(jobs=jobs, records=np.concatenate(records), horizon_s=HORIZON, fleet_cost_usd=1.0,
                                    reserved_cost_usd=0.5, admitted_jobs={"chat", "mod", "batch"}, window_s=TICK)),
        trace=trace,
        eval_inputs=RunEvalInputs(jobs=jobs, fleet_cost_usd=1.0, reserved_cost_usd=0.5,
                                  admitted_jobs=["chat", "mod", "batch"], grace_s=60.0) if eval_inputs else None,
    )  # fmt: skip
    return run, np.concatenate(records)


@pytest.fixture()
def sc(tmp_path):
    return load(write_tiny(tmp_path))[0]


def test_each_job_is_scored_by_the_evaluators_formulas_over_its_own_requests(sc):
    run, records = hand_run(sc, "koi", 0)
    rows = {r.job_id: r for r in run_job_rows(run, records)}
    assert list(rows) == ["chat", "mod", "batch"]
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


def test_a_batch_job_that_misses_its_deadline_earns_no_slo_tokens(sc):
    run, records = hand_run(sc, "koi", 0, late_batch=True)
    b = {r.job_id: r for r in run_job_rows(run, records)}["batch"]
    assert b.progress_pct == 100.0 and b.deadline_met_pct == 0.0 and b.slo_tokens == 0.0


def test_the_mean_over_seeds_and_the_table_order(sc):
    rows = []
    for seed, late in ((0, False), (1, True)):
        run, records = hand_run(sc, "koi", seed, late_batch=late)
        rows += run_job_rows(run, records)
    milp, records = hand_run(sc, "milp", 0)
    rows += run_job_rows(milp.model_copy(update={"trace": milp.trace[:1]}), records)  # chat holds 4 GPUs one tick
    means = mean_rows(rows)
    koi_batch = next(r for r in means if r.policy == "koi" and r.job_id == "batch")
    assert koi_batch.seeds == 2 and koi_batch.deadline_met_pct == 50.0 and koi_batch.slo_tokens == 10.0
    table = display_rows(means)
    # chat's GPU-hours differ most between the policies (2.0 against 1/3): its rows come first
    assert [r["job"] for r in table[:2]] == ["chat", "chat"] and [r["policy"] for r in table[:2]] == ["koi", "milp"]
    totals = [r for r in table if r["job"] == ALL_JOBS]
    assert [t["policy"] for t in totals] == ["koi", "milp"]
    assert totals[0]["GPU-h"] == f"{(2.0 + 4 * 2 * TICK / 3600):,.1f}" and totals[0]["swaps"] == "1.0"
    md = markdown(means, "per job")
    assert md.startswith("# per job") and md.count("\n| chat | ") == 2 and f"| {ALL_JOBS} | milp |" in md


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
    assert {row.job_id for row in rows} == {j.job_id for j in r.eval_inputs.jobs}
    assert sum(row.slo_tokens for row in rows) == pytest.approx(r.metrics.slo_tokens)
    held = sum(sum(g.values()) for t in r.trace for g in t.gpus_by_job.values())
    assert sum(row.gpu_hours for row in rows) == pytest.approx(held * r.meta.tick_s / 3600) and held > 0
