"""Benchmark reports (issue 8): the paper's table layout, the ablation table, the formulas, the figures,
and ``koi bench report --json`` — from cached runs.

Most tests write hand-made runs into a cache (every policy family, the oracle, Koi's ablations, two
seeds each) so the tables can be checked exactly; one builds the report from a real run.
"""

from __future__ import annotations

import csv
import io
import json
import math

import numpy as np
import pytest
from test_bench_runner import HOURS, STATIC, write_tiny

from koi.bench.cache import JobInfo, RunCache, RunMeta, RunResult
from koi.bench.evaluator import FORMULAS, Metrics, TickTrace
from koi.bench.policy import Family
from koi.bench.report import MAIN_COLUMNS, policy_rows, rebuild
from koi.bench.runner import load, run_key, run_one
from koi.sim.records import RECORD_DTYPE

PNG = b"\x89PNG\r\n\x1a\n"

POLICIES = [  # name, label, family, composite at seed 0
    ("fcfs", "FCFS + first-fit", Family.NON_LEARNING, 40.0),
    ("bandit", "Contextual bandit", Family.GLOBAL, 45.0),
    ("evo", "Rolling EvoX", Family.EVOLUTIONARY, 52.0),
    ("koi", "Koi", Family.KOI, 70.0),
    ("koi-nodag", "Koi without DAG/mechanisms", Family.ABLATION, 58.0),
    ("koi-frozen", "Koi without online learning", Family.ABLATION, 55.0),
    ("oracle", "Oracle (true performance)", Family.ORACLE, 90.0),
]


def metrics(composite: float, seed: int) -> Metrics:
    c = composite + seed  # seeds differ by one point: std 0.7071 over two seeds
    return Metrics(
        online_admission_pct=90.0 + seed, batch_admission_pct=80.0, batch_progress_pct=c, deadline_attainment_pct=50.0,
        ttft_attainment_pct=c / 2, tpot_attainment_pct=c / 1.5, p99_windows_pct=c / 3, goodput_tok_s=10 * c, cost_per_slo_token=1e-4 / c,
        fleet_cost_usd=100.0, slo_tokens=1e6, demanded_tokens=2e6, swaps=3, keeps=10, quality=c, coverage=c,
        efficiency=c, composite=c, online_requests=1000, batch_requests=500,
    )  # fmt: skip


def trace(learning: bool, seed: int) -> list[TickTrace]:
    out = []
    for n in range(3):
        out.append(TickTrace(
            tick=n, t=300.0 * n, swaps=int(n == 2), keeps=2, places=int(n == 0),
            gpus_by_job={"chat-8b": {"L40S": 4 - n}, "moderation": {"L4": 2}},
            serving_jobs=["chat-8b"] if n else [],
            actions={"chat-8b": "place"} if n == 0 else ({"chat-8b": "swap"} if n == 2 else {}),
            dro_radius=0.2 - 0.01 * n + 0.001 * seed if learning else None,
            active_mechanisms=5 + n if learning else None, cumulative_mechanisms=5 + 2 * n if learning else None,
            mean_u=0.4 / (n + 1) if learning else None, ttft_attainment=80.0 + n, tpot_attainment=90.0 - n,
        ))  # fmt: skip
    return out


def fake(sc, name: str, label: str, family: Family, composite: float, seed: int) -> RunResult:  # noqa: ANN001
    learning = name.startswith("koi")
    return RunResult(
        key=run_key(sc, name, seed, HOURS),
        meta=RunMeta(label=label, family=family.value, cluster_id=f"c-{name}", tick_s=300.0, n_ticks=3,
                     horizon_s=900.0, ticks_committed=3, ticks_fallback=0, wall_s=10.0 + seed, cpu_s=9.0),
        metrics=metrics(composite, seed), trace=trace(learning, seed), plans=["a", "b", "c"],
        jobs=[JobInfo(job_id="chat-8b", job_class="online", model="llama-3.1-8b", submitted_at=0.0),
              JobInfo(job_id="moderation", job_class="online", model="llama-3.2-1b", submitted_at=0.0)],
    )  # fmt: skip


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    path = write_tiny(root)
    sc, _ = load(path)
    cache = RunCache(root / "cache")
    for name, label, fam, comp in POLICIES:
        for seed in (0, 1):
            cache.save(fake(sc, name, label, fam, comp, seed), np.zeros(0, RECORD_DTYPE))
    rep = rebuild(str(path), cache_dir=root / "cache", hours=HOURS)
    return path, root / "cache", rep


def test_the_main_table_has_every_policy_in_family_order_with_mean_and_std(suite):
    _path, _cache, rep = suite
    assert [r.policy for r in rep.rows] == ["fcfs", "bandit", "evo", "koi", "koi-frozen", "koi-nodag", "oracle"]
    md = rep.markdown
    main = md.split("Ablations: Koi and its variants", 1)[0]
    for _name, label, fam, _c in POLICIES:
        assert (f"| {label}" in main) == (fam is not Family.ABLATION), label
    assert "Oracle (true performance) (upper bound)" in md
    header = "| Method | Batch progress (%) | Admit online (%) | Admit batch (%) | $/M SLO tokens | TTFT met (%) | " \
             "TPOT met (%) | p99 SLO windows (%) | Goodput (tok/s) | Overall score |"
    assert header in md
    # Koi: composite 70 and 71 over the seeds -> 70.50 ± 0.71, the best non-oracle value (bold)
    koi_line = next(line for line in md.splitlines() if line.startswith("| Koi |"))
    assert "**70.50 ± 0.71**" in koi_line
    # $/M SLO tokens: 1e6 × 1e-4 × mean of (1/70, 1/71) = 1.42 -> lower is better, Koi best
    cells = [c.strip() for c in koi_line.strip("|").split("|")]
    assert cells[4].startswith("**1.42 ± 0.01")
    # second best (EvoX at 52.5) is underlined; the oracle (90.5) is not marked
    evo_line = next(line for line in md.splitlines() if line.startswith("| Rolling EvoX |"))
    assert "<u>52.50 ± 0.71</u>" in evo_line
    oracle_line = next(line for line in md.splitlines() if line.startswith("| Oracle"))
    assert "**" not in oracle_line and "<u>" not in oracle_line
    # Δ vs the best baseline (EvoX by overall score): +18pp batch progress, +34.29% score
    delta = next(line for line in md.splitlines() if line.startswith("| Δ vs. best baseline"))
    assert "Rolling EvoX" in delta and "+18.00pp" in delta and f"{100 * 18 / 52.5:+.2f}%" in delta


def test_the_ablation_table_and_the_formulas(suite):
    _path, _cache, rep = suite
    md = rep.markdown
    abl = md.split("Ablations: Koi and its variants", 1)[1].split("## Runs", 1)[0]
    rows = [line.split("|")[1].strip() for line in abl.splitlines() if line.startswith("| ") and "Method" not in line]
    assert rows[:3] == ["Koi without DAG/mechanisms", "Koi without online learning", "Koi"]
    assert "Δ vs. best ablation (Koi without DAG/mechanisms)" in abl
    assert FORMULAS in md  # verbatim
    assert "## Metrics: the exact formulas" in md


def test_the_csv_tables(suite):
    _path, _cache, rep = suite
    rows = list(csv.DictReader(io.StringIO(rep.main_csv)))
    assert [r["policy"] for r in rows] == ["fcfs", "bandit", "evo", "koi", "oracle"]
    koi = next(r for r in rows if r["policy"] == "koi")
    assert float(koi["Overall score mean"]) == pytest.approx(70.5)
    assert float(koi["Overall score std"]) == pytest.approx(math.sqrt(0.5))
    assert float(koi["$/M SLO tokens mean"]) == pytest.approx(100 * np.mean([1 / 70, 1 / 71]))
    assert koi["seeds"] == "0 1"
    abl = list(csv.DictReader(io.StringIO(rep.ablation_csv)))
    assert [r["policy"] for r in abl] == ["koi-nodag", "koi-frozen", "koi"]
    assert len(MAIN_COLUMNS) == 9


def test_the_figures_are_written(suite):
    _path, _cache, rep = suite
    for name in ("allocation", "slo_attainment", "dro_radius", "mechanisms", "uncertainty", "ablation"):
        p = rep.files[name]
        assert p.is_file() and p.stat().st_size > 1000, name
        assert p.read_bytes()[:8] == PNG
    for k in ("markdown", "main_csv", "ablation_csv", "summary"):
        assert rep.files[k].is_file() and rep.files[k].stat().st_size > 0
    assert "![allocation](allocation.png)" in rep.markdown


def test_report_json_prints_each_policys_mean_metrics(suite):
    from typer.testing import CliRunner

    from koi.cli import app

    path, cache, _rep = suite
    res = CliRunner().invoke(app, ["bench", "report", "--scenario", str(path), "--cache-dir", str(cache), "--hours",
                                   str(HOURS), "--json", "--no-figures"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)
    assert set(doc["policies"]) == {p[0] for p in POLICIES}
    koi = doc["policies"]["koi"]
    assert koi["mean"]["composite"] == pytest.approx(70.5) and koi["n_runs"] == 2 and koi["seeds"] == [0, 1]
    assert koi["std"]["composite"] == pytest.approx(math.sqrt(0.5))
    assert doc["policies"]["oracle"]["upper_bound"] is True
    assert set(koi["mean"]) == set(Metrics.model_fields)


def test_report_prints_its_tables_on_the_terminal(suite):
    """Without --json the report prints the main, ablation and language-model tables with every column of the
    Markdown report (a header list of its own once missed the p99 column and crashed every `bench run`)."""
    from typer.testing import CliRunner

    from koi.bench.report import MAIN_COLUMNS
    from koi.cli import app

    path, cache, _rep = suite
    res = CliRunner().invoke(app, ["bench", "report", "--scenario", str(path), "--cache-dir", str(cache), "--hours",
                                   str(HOURS), "--no-figures"], env={"COLUMNS": "400"})
    assert res.exit_code == 0, res.output
    for _m, header, *_ in MAIN_COLUMNS:
        assert header in res.output
    assert "mean ± std over seeds" in res.output and "ablations" in res.output


def test_report_of_some_policies_and_seeds(tmp_path):
    """`--policies` and `--seeds/--first-seed` report a subset of the cache; an unknown name fails clearly."""
    from typer.testing import CliRunner

    from koi.cli import app

    path = write_tiny(tmp_path)
    sc, _ = load(path)
    cache = RunCache(tmp_path / "cache")
    for name, label, fam, comp in [("koi", "Koi", Family.KOI, 70.0), ("milp", "Rolling MILP", Family.GLOBAL, 60.0),
                                   ("koi-frozen", "Koi without online learning", Family.ABLATION, 55.0)]:
        for seed in (0, 1, 2, 3):
            cache.save(fake(sc, name, label, fam, comp, seed), np.zeros(0, RECORD_DTYPE))
    base = ["bench", "report", "--scenario", str(path), "--cache-dir", str(tmp_path / "cache"), "--hours", str(HOURS),
            "--json", "--no-figures"]
    res = CliRunner().invoke(app, [*base, "--policies", "koi,milp", "--seeds", "2", "--first-seed", "1"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.stdout)["policies"]
    assert set(doc) == {"koi", "milp"} and doc["koi"]["seeds"] == [1, 2] and doc["milp"]["seeds"] == [1, 2]
    assert doc["koi"]["mean"]["composite"] == pytest.approx(71.5)  # seeds 1 and 2: 71 and 72
    everything = json.loads(CliRunner().invoke(app, base).stdout)["policies"]
    assert set(everything) == {"koi", "milp", "koi-frozen"} and everything["koi"]["seeds"] == [0, 1, 2, 3]
    res = CliRunner().invoke(app, [*base, "--policies", "koi,nonesuch"])
    assert res.exit_code != 0 and "unknown policy 'nonesuch'" in res.output
    res = CliRunner().invoke(app, [*base, "--seeds", "2", "--first-seed", "7"])
    assert res.exit_code != 0 and "no cached runs" in res.output and "seeds 7, 8" in res.output


def test_report_without_runs_fails_clearly(tmp_path):
    from typer.testing import CliRunner

    from koi.cli import app

    path = write_tiny(tmp_path)
    res = CliRunner().invoke(app, ["bench", "report", "--scenario", str(path), "--cache-dir", str(tmp_path / "none")])
    assert res.exit_code != 0 and "no cached runs" in res.output


def test_a_report_from_a_real_run(tmp_path):
    path = write_tiny(tmp_path)
    r = run_one(path, STATIC, 0, hours=300 / 3600, cache_dir=tmp_path / "cache")
    rep = rebuild(str(path), cache_dir=tmp_path / "cache", hours=300 / 3600)
    assert [row.policy for row in rep.rows] == ["test-static"]
    assert rep.rows[0].stats["composite"][0] == pytest.approx(r.metrics.composite)
    assert rep.files["allocation"].read_bytes()[:8] == PNG
    assert "dro_radius" not in rep.files  # no learning policy ran
    assert policy_rows([r])[0].seeds == [0]


def test_koi_variants_are_not_the_best_baseline(suite):
    """Koi's RLM planner on a scripted model is Koi, not a baseline: the Δ row skips it (and the ablations)."""
    import dataclasses

    from koi.bench.report import delta_vs_best

    _path, _cache, rep = suite
    koi = next(r for r in rep.rows if r.policy == "koi")
    scripted = dataclasses.replace(koi, policy="koi-scripted", label="Koi with a scripted LLM", family="llm",
                                   stats={**koi.stats, "composite": (99.0, 0.0)})
    nodag = dataclasses.replace(koi, policy="koi-nodag", label="Koi without DAG/mechanisms", family="Koi ablations",
                                stats={**koi.stats, "composite": (98.0, 0.0)})
    rows = [*rep.rows, scripted, nodag]
    assert delta_vs_best(rows)["vs"] == "Rolling EvoX"
    # the ablation table compares Koi with its best ablation, not with its own RLM planner (a tie by design)
    abl = delta_vs_best(rows, ablations=True)
    assert abl["vs"] == "Koi without DAG/mechanisms" and abl["what"] == "best ablation"
    assert delta_vs_best([koi, scripted], ablations=True) is None


def test_the_language_model_table_says_whose_plans_a_models_row_is(tmp_path):
    """An LLM row is read beside how often the model's own plan was proposed, and what it cost."""
    from koi.agent.llm import Usage
    from koi.bench.llm_use import LlmUse
    from koi.bench.report import build_markdown, llm_table, summary

    sc, _ = load(write_tiny(tmp_path))
    runs = []
    for seed, (mine, calls) in enumerate([(3, 4), (2, 5)]):
        r = fake(sc, "llm-only", "LLM only (no tools)", Family.LLM, 30.0, seed)
        r.meta.llm = LlmUse(model="smollm2", ticks=3, model_plans=mine, fallback_plans=3 - mine,
                            salvaged_plans=seed,
                            usage=Usage(calls=calls, failed_calls=seed, prompt_tokens=1000 * calls,
                                        completion_tokens=100 * calls, cost_usd=0.01 * calls, latency_s=2.0 * calls))
        runs.append(r)
    runs.append(fake(sc, "fcfs", "FCFS + first-fit", Family.NON_LEARNING, 40.0, 0))
    rows = policy_rows(runs)
    table = llm_table(rows)
    lines = table.splitlines()
    assert len(lines) == 3 and "FCFS" not in table  # header, rule, the one model row
    cells = [c.strip() for c in lines[2].strip("|").split("|")]
    # model, runs, model's plans over both seeds, calls (failed), per-run tokens and dollars, s per call
    assert cells[1:] == ["smollm2", "2", "5/6 (83%), 1 salvaged", "9 (1)", "4,500", "450", "0.0450", "2.0"]
    assert "## Language models" in build_markdown(sc.name, "d" * 64, HOURS, rows, runs)
    doc = summary(rows)
    assert doc["llm-only"]["llm"]["model_plans"] == 5 and doc["llm-only"]["llm"]["runs"] == 2
    assert doc["llm-only"]["llm"]["salvaged_plans"] == 1
    assert "llm" not in doc["fcfs"]
    assert llm_table(policy_rows(runs[2:])) == ""


def test_of_several_llm_setups_for_one_seed_the_report_reads_the_current_one_else_the_latest(tmp_path, monkeypatch):
    """An LLM policy's key carries its model setup, so one seed can have several cached runs: the report
    takes the one the settings give now; when none matches (the setup changed since), the latest made."""
    from koi.bench.report import select_runs
    from koi.config import get_settings

    path = write_tiny(tmp_path)
    sc, _ = load(path)
    cache = RunCache(tmp_path / "cache")

    def made_with(model: str, composite: float, finished: str) -> None:
        monkeypatch.setenv("KOI_LLM_MODEL", model)
        get_settings.cache_clear()
        r = fake(sc, "llm-only", "LLM only (no tools)", Family.LLM, composite, 0)
        cache.save(r.model_copy(update={"meta": r.meta.model_copy(update={"finished_at": finished})}),
                   np.zeros(0, RECORD_DTYPE))

    try:
        made_with("model-a", 60.0, "2026-12-03T10:00:00+00:00")
        made_with("model-b", 50.0, "2026-12-03T09:00:00+00:00")  # made earlier, configured now
        assert len(list((tmp_path / "cache" / "bench-tiny" / "runs" / "llm-only").glob("*.json"))) == 2
        _n, _d, _h, runs = select_runs(str(path), cache_dir=tmp_path / "cache", hours=HOURS)
        assert [r.metrics.composite for r in runs] == [50.0]
        monkeypatch.setenv("KOI_LLM_MODEL", "model-c")  # neither: the latest made
        get_settings.cache_clear()
        _n, _d, _h, runs = select_runs(str(path), cache_dir=tmp_path / "cache", hours=HOURS)
        assert [r.metrics.composite for r in runs] == [60.0]
    finally:
        monkeypatch.undo()
        get_settings.cache_clear()


def test_koi_against_each_policy_paired_by_seed(suite):
    """Each seed's Koi − policy difference, its mean, standard error and wins; in the Markdown, the JSON and
    on the terminal. In the hand-made suite every policy's composite is its seed-0 value + seed, so the
    differences are the same on both seeds (s.e. 0) and the cost saving is 1 − c_P / c_Koi per seed."""
    from typer.testing import CliRunner

    from koi.cli import app

    path, cache, rep = suite
    by = {p.policy: p for p in rep.paired}
    assert [p.policy for p in rep.paired] == ["fcfs", "bandit", "evo", "koi-frozen", "koi-nodag", "oracle"]
    evo = by["evo"].deltas
    assert by["evo"].seeds == [0, 1]
    assert evo["composite"].mean == pytest.approx(18.0) and evo["composite"].se == pytest.approx(0.0)
    assert (evo["composite"].wins, evo["composite"].ties, evo["composite"].losses) == (2, 0, 0)
    assert evo["p99_windows_pct"].mean == pytest.approx(6.0)  # c / 3
    assert evo["goodput_tok_s"].mean == pytest.approx(100 * np.mean([18 / 52, 18 / 53]))
    assert evo["cost_per_slo_token"].mean == pytest.approx(100 * np.mean([1 - 52 / 70, 1 - 53 / 71]))
    oracle = by["oracle"].deltas["composite"]
    assert oracle.mean == pytest.approx(-20.0) and (oracle.wins, oracle.losses) == (0, 2)
    md = rep.markdown
    section = md.split("## Koi against each policy, paired by seed", 1)[1].split("##", 1)[0]
    assert "| Rolling EvoX | 0 1 | +18.00 ± 0.00 (2/2 won) |" in section
    assert "-20.00 ± 0.00 (0/2 won)" in section
    res = CliRunner().invoke(app, ["bench", "report", "--scenario", str(path), "--cache-dir", str(cache), "--hours",
                                   str(HOURS), "--json", "--no-figures"])
    doc = json.loads(res.stdout)
    evo_json = next(p for p in doc["paired"] if p["policy"] == "evo")
    assert evo_json["deltas"]["composite"]["wins"] == 2 and evo_json["deltas"]["composite"]["n"] == 2
    res = CliRunner().invoke(app, ["bench", "report", "--scenario", str(path), "--cache-dir", str(cache), "--hours",
                                   str(HOURS), "--no-figures"], env={"COLUMNS": "400"})
    assert "paired by seed" in res.output and "+18.00 ± 0.00 (2/2 won)" in res.output


def test_paired_differences_count_wins_ties_and_losses_and_skip_what_is_not_finite():
    from koi.bench.paired import paired_delta

    d = paired_delta("composite", "abs", [1.0, 2.0, 3.0], [2.0, 1.0, 3.0])
    assert (d.n, d.wins, d.ties, d.losses) == (3, 1, 1, 1)
    assert d.mean == pytest.approx(0.0) and d.se == pytest.approx(1 / math.sqrt(3))
    # cost per SLO token: lower is better, a positive saving is Koi cheaper; an infinite cost (no SLO token)
    # has no relative difference, so that seed is left out rather than counted as a win
    c = paired_delta("cost_per_slo_token", "saving", [1.0, 2.0, math.inf], [2.0, 1.0, 4.0])
    assert c.n == 2 and c.mean == pytest.approx(np.mean([50.0, -100.0])) and (c.wins, c.losses) == (1, 1)
    # a difference that prints as ±0.00 is a tie, not a win
    near = paired_delta("composite", "abs", [70.004, 70.0, 70.2], [70.0, 70.004, 70.0])
    assert (near.wins, near.ties, near.losses) == (1, 2, 0)
    one = paired_delta("composite", "abs", [5.0], [4.0])
    assert one.se is None and one.wins == 1
    assert paired_delta("composite", "abs", [math.nan], [1.0]) is None


def test_pairs_only_the_seeds_both_policies_ran(tmp_path):
    from koi.bench.paired import paired_rows

    path = write_tiny(tmp_path)
    sc, _ = load(path)
    runs = [fake(sc, "koi", "Koi", Family.KOI, 70.0, s) for s in (0, 1, 2, 3)]
    runs += [fake(sc, "milp", "Rolling MILP", Family.GLOBAL, 60.0, s) for s in (1, 2)]
    runs += [fake(sc, "bandit", "Contextual bandit", Family.GLOBAL, 50.0, s) for s in (5,)]
    (milp,) = paired_rows(runs)  # the bandit shares no seed with Koi
    assert milp.seeds == [1, 2] and milp.deltas["composite"].n == 2
    assert paired_rows([r for r in runs if r.key.policy != "koi"]) == []


def test_the_papers_claims_on_the_runs(suite):
    """Each claim of issue 8 with Koi's value, the target and whether it is met; the oracle and Koi's variants
    are not the strongest baseline; a claim whose policy did not run is left out, never reported as met."""
    from koi.bench.paired import claims

    _path, _cache, rep = suite
    got = {(c.claim, c.against): c for c in rep.claims}
    ahead = got[("overall score ahead of every baseline (Koi − best)", "Rolling EvoX")]
    assert ahead.value == pytest.approx(18.0) and ahead.met
    assert ahead.paired.mean == pytest.approx(18.0) and ahead.paired.wins == 2  # read beside its paired s.e.
    goodput = got[("goodput over the strongest baseline's", "Rolling EvoX")]
    assert goodput.value == pytest.approx(70.5 / 52.5) and goodput.target == 1.45 and not goodput.met
    cost = got[("cost per SLO token over the strongest baseline's", "Rolling EvoX")]
    assert cost.value == pytest.approx(np.mean([1 / 70, 1 / 71]) / np.mean([1 / 52, 1 / 53])) and not cost.met
    oracle = got[("goodput over the oracle's", "Oracle (true performance)")]
    assert oracle.value == pytest.approx(70.5 / 90.5) and not oracle.met
    for label in ("Koi without DAG/mechanisms", "Koi without online learning"):
        assert got[("overall score above the ablation (Koi − ablation)", label)].met
    assert "| goodput over the strongest baseline's | Rolling EvoX | 1.34× | ≥ 1.45× | no |  |" in rep.markdown
    assert "| Rolling EvoX | +18.00 | > +0.00 | yes | +18.00 ± 0.00 (2/2 won) |" in rep.markdown
    import dataclasses

    koi = next(r for r in rep.rows if r.policy == "koi")
    frozen = next(r for r in rep.rows if r.policy == "koi-frozen")
    level = dataclasses.replace(frozen, stats={**frozen.stats, "composite": (koi.mean("composite") - 0.001, 0.0)})
    (gap,) = [c for c in claims([koi, level]) if c.against == "Koi without online learning"]
    assert gap.value == pytest.approx(0.001) and not gap.met  # a lead that prints as +0.00 is not one
    only_koi = [r for r in rep.rows if r.policy in ("koi", "oracle")]
    assert [c.claim for c in claims(only_koi)] == ["goodput over the oracle's"]
    assert claims([r for r in rep.rows if r.policy != "koi"]) == []


def test_the_report_says_when_its_runs_were_made_with_different_numeric_kernels(tmp_path):
    """numpy's and OpenBLAS's kernels round differently per CPU (koi/numerics.py): a table mixing them says so."""
    path = write_tiny(tmp_path)
    sc, _ = load(path)
    cache = RunCache(tmp_path / "cache")
    for seed in (0, 1):
        run = fake(sc, "koi", "Koi", Family.KOI, 70.0, seed)
        run.meta.kernels = "numpy X86_V3, OpenBLAS Haswell"
        cache.save(run, np.zeros(0, RECORD_DTYPE))
    one = rebuild(str(path), cache_dir=tmp_path / "cache", hours=HOURS, figures=False).markdown
    assert "numeric kernels" not in one
    run = fake(sc, "koi", "Koi", Family.KOI, 70.0, 2)
    run.meta.kernels = "numpy AVX512_ICL, OpenBLAS auto"
    cache.save(run, np.zeros(0, RECORD_DTYPE))
    rep = rebuild(str(path), cache_dir=tmp_path / "cache", hours=HOURS, figures=False)
    assert "made with 2 different numeric kernels (numpy AVX512_ICL, OpenBLAS auto; numpy X86_V3, OpenBLAS Haswell;" in rep.markdown
    assert rep.json()["policies"]["koi"]["kernels"] == ["numpy AVX512_ICL, OpenBLAS auto", "numpy X86_V3, OpenBLAS Haswell"]


def test_the_report_counts_the_ticks_a_wall_clock_limit_cut(tmp_path):
    """A plan cut by the MILP's time limit or EvoX's budget depends on the machine's speed: the report says which."""
    path = write_tiny(tmp_path)
    sc, _ = load(path)
    cache = RunCache(tmp_path / "cache")
    evo = fake(sc, "evo", "Rolling EvoX", Family.EVOLUTIONARY, 60.0, 0)
    evo.meta.clock_bound = [{"tick": 3, "stage": "S4_search", "cut": "EvoX's 1.5 s time budget after 9 of 60 generations"},
                            {"tick": 5, "stage": "S4_search", "cut": "EvoX's 1.5 s time budget after 2 of 60 generations"}]
    milp = fake(sc, "milp", "Rolling MILP (no learning)", Family.GLOBAL, 65.0, 0)
    milp.meta.clock_bound = []
    old = fake(sc, "koi", "Koi", Family.KOI, 70.0, 0)  # a run from before the field: not recorded
    for run in (evo, milp, old):
        cache.save(run, np.zeros(0, RECORD_DTYPE))
    rep = rebuild(str(path), cache_dir=tmp_path / "cache", hours=HOURS, figures=False)
    assert ("**Note:** a wall-clock limit (the MILP's time limit, EvoX's time budget) cut the planning of "
            "2 tick(s) of Rolling EvoX:") in rep.markdown
    assert "| clock-bound ticks |" in rep.markdown
    rows = {ln.split("|")[1].strip(): ln.split("|")[5].strip() for ln in rep.markdown.splitlines()
            if ln.startswith("| ") and ln.count("|") == 7}
    assert rows["Rolling EvoX"] == "2" and rows["Rolling MILP (no learning)"] == "0" and rows["Koi"] == "—"
    js = rep.json()["policies"]
    assert (js["evo"]["clock_bound_ticks"], js["milp"]["clock_bound_ticks"], js["koi"]["clock_bound_ticks"]) == (2, 0, None)
    evo.meta.clock_bound = []
    cache.save(evo, np.zeros(0, RECORD_DTYPE))
    assert "**Note:** a wall-clock limit" not in rebuild(str(path), cache_dir=tmp_path / "cache", hours=HOURS, figures=False).markdown


def test_a_learning_band_over_a_tick_no_seed_has_a_value_for_is_a_gap_without_a_warning():
    import warnings

    from koi.bench.figures import _band, _plt

    s = np.array([[1.0, 3.0], [np.nan, np.nan], [2.0, np.nan]])  # tick 1: no seed recorded a value
    fig, ax = _plt().subplots()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        _band(ax, np.arange(3.0), s, "C0", "ε")
    _plt().close(fig)
    assert [str(w.message) for w in seen] == []
    line = ax.get_lines()[0].get_ydata()
    assert line[0] == 2.0 and np.isnan(line[1]) and line[2] == 2.0
