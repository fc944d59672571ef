"""Tables of a benchmark (the paper's Tables 1–4 layout), the ablation table, the formulas, JSON.

From cached runs (:class:`~koi.bench.cache.RunResult`), grouped by policy and aggregated
over seeds with :func:`koi.bench.evaluator.aggregate` (mean ± sample std):

- the main table, one row per policy (Koi's ablations aside) grouped by family in table order, columns as in the
  paper's Tables 1–2: Batch progress %, Admit online %, Admit batch %, $/token (×10⁻⁴, the
  cost per SLO token), TTFT met %, TPOT met %, Goodput tok/s, Overall score (the composite);
  the oracle row is marked as an upper bound and left out of best/second-best; a "Δ vs.
  best baseline" row compares Koi with the best non-Koi policy by overall score (pp for
  percentages, % for goodput, $/token and score, as the paper does);
- the ablation table (Table 4 layout): Koi and its ablations (koi-nodag, koi-frozen; koi-physics and
  koi-scripted when they ran) and the language-model planners when they ran;
- Koi against each policy paired by seed, and the paper's claims checked on these runs
  (:mod:`koi.bench.paired`; also under ``paired`` and ``claims`` in the JSON);
- the formulas, verbatim from :data:`koi.bench.evaluator.FORMULAS`.

Written as Markdown (``report.md``) and CSV (``table_main.csv``, ``table_ablation.csv``), with
``summary.json`` (every policy's mean and std of every metric), under the scenario's report
directory. Best values are bold and second-best underlined (ties: every matching method).
"""

from __future__ import annotations

import csv
import io
import json
import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from koi.bench import paired as pr
from koi.bench.cache import RunResult
from koi.bench.evaluator import FORMULAS, aggregate
from koi.bench.llm_use import LlmUse
from koi.bench.paired import Claim, PairedRow, baselines
from koi.bench.policy import Family

#: (metric, header, scale, higher is better, percent) in the paper's column order.
MAIN_COLUMNS: tuple[tuple[str, str, float, bool, bool], ...] = (
    ("batch_progress_pct", "Batch progress (%)", 1.0, True, True),
    ("online_admission_pct", "Admit online (%)", 1.0, True, True),
    ("batch_admission_pct", "Admit batch (%)", 1.0, True, True),
    ("cost_per_slo_token", "$/M SLO tokens", 1e6, False, False),
    ("ttft_attainment_pct", "TTFT met (%)", 1.0, True, True),
    ("tpot_attainment_pct", "TPOT met (%)", 1.0, True, True),
    ("p99_windows_pct", "p99 SLO windows (%)", 1.0, True, True),
    ("goodput_tok_s", "Goodput (tok/s)", 1.0, True, False),
    ("composite", "Overall score", 1.0, True, False),
)
#: Koi and its ablations, in the ablation table's order; LLM planners join when they ran.
ABLATION = (pr.KOI, *pr.ABLATIONS, "koi-physics", "koi-scripted")
LLM_ABLATION = ("llm-only", "koi-llm")
KOI = pr.KOI
ORACLE_MARK = " (upper bound)"


@dataclass
class PolicyRow:
    policy: str
    label: str
    family: str
    seeds: list[int]
    stats: dict[str, tuple[float, float]]
    wall_s: float
    fallback_ticks: int
    ticks: int
    llm: LlmUse | None = None
    llm_runs: int = 0
    kernels: list[str] = field(default_factory=list)  # the runs' numeric kernels (koi.numerics; "?": not recorded)
    clock_bound_ticks: int | None = None  # ticks a wall-clock limit cut, over the runs (None: a run did not record it)

    @property
    def is_oracle(self) -> bool:
        return self.family == Family.ORACLE.value

    def mean(self, metric: str) -> float:
        return self.stats[metric][0]


def _family_order(family: str) -> int:
    fams = [f.value for f in Family]
    return fams.index(family) if family in fams else len(fams)


def policy_rows(runs: Iterable[RunResult]) -> list[PolicyRow]:
    """One row per policy (seeds aggregated), in table order: family, then policy name."""
    by: dict[str, list[RunResult]] = {}
    for r in runs:
        by.setdefault(r.key.policy, []).append(r)
    rows = []
    for name, rs in by.items():
        rs = sorted(rs, key=lambda r: r.key.seed)
        rows.append(PolicyRow(
            policy=name, label=rs[0].meta.label, family=rs[0].meta.family, seeds=[r.key.seed for r in rs],
            stats=aggregate([r.metrics for r in rs]), wall_s=sum(r.meta.wall_s for r in rs) / len(rs),
            fallback_ticks=sum(r.meta.ticks_fallback for r in rs), ticks=sum(r.meta.n_ticks for r in rs),
            llm=_merged_llm(rs), llm_runs=sum(1 for r in rs if r.meta.llm is not None),
            kernels=sorted({r.meta.kernels or "?" for r in rs}),
            clock_bound_ticks=(None if any(r.meta.clock_bound is None for r in rs)
                               else sum(len({c["tick"] for c in r.meta.clock_bound or []}) for r in rs)),
        ))  # fmt: skip
    return sorted(rows, key=lambda p: (_family_order(p.family), p.policy))


def _merged_llm(runs: Sequence[RunResult]) -> LlmUse | None:
    uses = [r.meta.llm for r in runs if r.meta.llm is not None]
    if not uses:
        return None
    total = uses[0]
    for u in uses[1:]:
        total = total.merge(u)
    return total


LLM_COLS = ["Method", "model", "runs", "model's plans", "calls (failed)", "prompt tok / run",
            "completion tok / run", "LLM $ / run", "s / call"]


def llm_rows(rows: Sequence[PolicyRow]) -> list[dict[str, str]]:
    """The language-model planners' use of their model, summed over seeds (none when no policy asked one).

    "Model's plans" is the share of ticks whose S4 proposal was the model's own (the rest are the
    fallback: keep/defer for the LLM-only planner, the deterministic anchor for Koi's RLM planner),
    which says how much of a row is the model's doing.
    """
    out = []
    for r in rows:
        u = r.llm
        if u is None:
            continue
        n = max(r.llm_runs, 1)
        per_call = u.usage.latency_s / u.usage.calls if u.usage.calls else 0.0
        model = u.model or "?"
        if u.decoding and u.decoding != "none":
            model += f" ({u.decoding})"
        plans = f"{u.model_plans}/{u.ticks} ({100 * u.model_share:.0f}%)"
        plans += (f", {u.cut_plans} cut" if u.cut_plans else "") + (
            f", {u.salvaged_plans} salvaged" if u.salvaged_plans else "")
        vals = [_label(r), model, str(r.llm_runs), plans,
                f"{u.usage.calls} ({u.usage.failed_calls})", f"{u.usage.prompt_tokens / n:,.0f}",
                f"{u.usage.completion_tokens / n:,.0f}", f"{u.usage.cost_usd / n:.4f}", f"{per_call:.1f}"]
        out.append(dict(zip(LLM_COLS, vals, strict=True)))
    return out


def llm_table(rows: Sequence[PolicyRow]) -> str:
    """:func:`llm_rows` as Markdown ("" when none)."""
    rs = llm_rows(rows)
    if not rs:
        return ""
    out = ["| " + " | ".join(LLM_COLS) + " |", "|---|---|" + "---:|" * (len(LLM_COLS) - 2)]
    out += ["| " + " | ".join(r[c] for c in LLM_COLS) + " |" for r in rs]
    return "\n".join(out)


# ---- formatting ---------------------------------------------------------------------------------------------
def _num(x: float, scale: float = 1.0) -> str:
    if x is None or not math.isfinite(x):
        return "∞" if x is not None and x > 0 else "–"
    v = x * scale
    return f"{v:.2f}"


def cell(stats: tuple[float, float], scale: float = 1.0, n: int = 1) -> str:
    mean, std = stats
    if n > 1 and math.isfinite(mean):
        return f"{_num(mean, scale)} ± {_num(std, scale)}"
    return _num(mean, scale)


def _ranks(rows: Sequence[PolicyRow], metric: str, higher: bool) -> tuple[set[str], set[str]]:
    """Policies with the best and the second-best mean (ties share a place); the oracle is left out."""
    vals = sorted({round(r.mean(metric), 9) for r in rows if not r.is_oracle and math.isfinite(r.mean(metric))},
                  reverse=higher)
    best = {r.policy for r in rows if not r.is_oracle and vals and round(r.mean(metric), 9) == vals[0]}
    second = {r.policy for r in rows if not r.is_oracle and len(vals) > 1 and round(r.mean(metric), 9) == vals[1]}
    return best, second


def _label(r: PolicyRow) -> str:
    return r.label + (ORACLE_MARK if r.is_oracle else "")


def delta_vs_best(rows: Sequence[PolicyRow], subject: str = KOI, *, ablations: bool = False) -> dict[str, str] | None:
    """``subject`` against the best other policy by overall score (percentage points for percentages,
    relative % for goodput, score and $/token, where lower cost counts as a gain); the oracle never
    counts, nor do Koi's own variants (its ablations and its RLM planner on a scripted or real LLM,
    the ``koi-*`` policies): they are Koi, not baselines. With ``ablations`` the other side is the best
    ablation proper (the RLM planner makes Koi's plans, so it would show a tie). None without both."""
    me = next((r for r in rows if r.policy == subject), None)
    if ablations:
        pool = [r for r in rows if r.policy != subject and r.family == Family.ABLATION.value]
    else:
        pool = baselines(rows, subject)
    if me is None or not pool:
        return None
    best = max(pool, key=lambda r: r.mean("composite"))
    out = {"vs": best.label, "what": "best ablation" if ablations else "best baseline"}
    for metric, _h, _s, _higher, pct in MAIN_COLUMNS:
        a, b = me.mean(metric), best.mean(metric)
        if not (math.isfinite(a) and math.isfinite(b)):
            out[metric] = "–"
        elif pct:
            out[metric] = f"{a - b:+.2f}pp"
        elif metric == "cost_per_slo_token":
            out[metric] = f"{100.0 * (b - a) / b:+.2f}%" if b else "–"
        else:
            out[metric] = f"{100.0 * (a - b) / b:+.2f}%" if b else "–"
    return out


def markdown_table(rows: Sequence[PolicyRow], *, title: str = "", delta: dict[str, str] | None = None,
                   by_family: bool = True) -> str:
    head = ["Method", *[h for _m, h, *_ in MAIN_COLUMNS]]
    lines = [f"**{title}**", ""] if title else []
    lines += ["| " + " | ".join(head) + " |", "|" + "|".join(["---"] + ["---:"] * len(MAIN_COLUMNS)) + "|"]
    marks = {m: _ranks(rows, m, higher) for m, _h, _s, higher, _p in MAIN_COLUMNS}
    family = None
    for r in rows:
        if by_family and r.family != family:
            family = r.family
            lines.append(f"| *{family}* |" + " |" * len(MAIN_COLUMNS))
        cells = []
        for m, _h, scale, _hi, _p in MAIN_COLUMNS:
            c = cell(r.stats[m], scale, len(r.seeds))
            best, second = marks[m]
            if r.policy in best:
                c = f"**{c}**"
            elif r.policy in second:
                c = f"<u>{c}</u>"
            cells.append(c)
        lines.append(f"| {_label(r)} | " + " | ".join(cells) + " |")
    if delta:
        lines.append(f"| Δ vs. {delta.get('what', 'best baseline')} ({delta['vs']}) | " + " | ".join(delta[m] for m, *_ in MAIN_COLUMNS) + " |")
    return "\n".join(lines)


def csv_table(rows: Sequence[PolicyRow]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    head = ["policy", "method", "family", "seeds"]
    for _m, h, _s, _hi, _p in MAIN_COLUMNS:
        head += [f"{h} mean", f"{h} std"]
    w.writerow(head)
    for r in rows:
        line: list[Any] = [r.policy, _label(r), r.family, " ".join(map(str, r.seeds))]
        for m, _h, scale, _hi, _p in MAIN_COLUMNS:
            mean, std = r.stats[m]
            line += [_csv_num(mean * scale), _csv_num(std * scale)]
        w.writerow(line)
    return buf.getvalue()


def _csv_num(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.6g}"


def main_rows(rows: Sequence[PolicyRow]) -> list[PolicyRow]:
    """The main table's rows: every policy but Koi's ablations (they have their own table)."""
    main = [r for r in rows if r.family != Family.ABLATION.value]
    return main or list(rows)


def ablation_rows(rows: Sequence[PolicyRow]) -> list[PolicyRow]:
    order = [*ABLATION, *LLM_ABLATION]
    present = {r.policy: r for r in rows if r.policy in order}
    # Table 4 lists the language-model planners first and full Koi last
    seq = [*LLM_ABLATION, *ABLATION[1:], KOI]
    return [present[p] for p in seq if p in present]


def summary(rows: Sequence[PolicyRow]) -> dict[str, Any]:
    """Every policy's mean and std of every metric (JSON-able; infinity as None)."""
    def clean(x: float) -> float | None:
        return x if math.isfinite(x) else None

    return {
        r.policy: {
            "label": r.label, "family": r.family, "seeds": r.seeds, "n_runs": len(r.seeds),
            "upper_bound": r.is_oracle,
            "mean": {k: clean(v[0]) for k, v in r.stats.items()},
            "std": {k: clean(v[1]) for k, v in r.stats.items()},
            "wall_s_mean": round(r.wall_s, 2), "fallback_ticks": r.fallback_ticks, "ticks": r.ticks,
            "kernels": r.kernels, "clock_bound_ticks": r.clock_bound_ticks,
            **({"llm": {**r.llm.model_dump(mode="json"), "runs": r.llm_runs}} if r.llm is not None else {}),
        }
        for r in rows
    }


@dataclass
class Report:
    scenario: str
    digest: str
    hours: float
    rows: list[PolicyRow]
    markdown: str
    main_csv: str
    ablation_csv: str
    files: dict[str, Path]
    paired: list[PairedRow]
    claims: list[Claim]

    def json(self) -> dict[str, Any]:
        return {**report_json(self.scenario, self.digest, self.hours, self.rows, self.paired, self.claims),
                "files": {k: str(v) for k, v in self.files.items()}}


def report_json(scenario: str, digest: str, hours: float, rows: Sequence[PolicyRow],
                paired: Sequence[PairedRow] | None = None, claims: Sequence[Claim] | None = None,
                runs: Sequence[RunResult] = ()) -> dict[str, Any]:
    """A report's JSON without its files: every policy's figures, Koi paired by seed, the claims
    (paired and claims computed from ``runs`` when not given)."""
    if paired is None:
        paired = paired_in_table_order(rows, runs)
    if claims is None:
        claims = pr.claims(rows, paired=paired)
    return {"scenario": scenario, "scenario_digest": digest, "hours": hours, "policies": summary(rows),
            **pr.as_json(paired, claims)}


def paired_in_table_order(rows: Sequence[PolicyRow], runs: Sequence[RunResult]) -> list[PairedRow]:
    """:func:`koi.bench.paired.paired_rows` with the policies in the report's table order."""
    order = {r.policy: i for i, r in enumerate(rows)}
    return sorted(pr.paired_rows(runs), key=lambda p: order.get(p.policy, len(order)))


def build_markdown(scenario: str, digest: str, hours: float, rows: Sequence[PolicyRow], runs: Sequence[RunResult],
                   figures: dict[str, Path] | None = None, paired: Sequence[PairedRow] | None = None) -> str:
    abl = ablation_rows(rows)
    main = main_rows(rows)
    ticks = sorted({r.meta.n_ticks for r in runs})
    parts = [
        f"# Benchmark report: {scenario}",
        "",
        f"Scenario digest `{digest[:12]}`, {hours:g} h ({', '.join(map(str, ticks))} ticks of "
        f"{runs[0].meta.tick_s:g} s), {len(runs)} runs over {len(rows)} policies. Values are mean ± std over "
        "seeds; bold marks the best value and underline the second-best (ties: every matching method); the "
        "oracle reads the simulator's true performance and is an upper bound, not a competitor.",
        "",
        markdown_table(main, title=f"Table: {scenario}", delta=delta_vs_best(main)),
        "",
    ]
    if abl:
        parts += [markdown_table(abl, title="Ablations: Koi and its variants", by_family=False,
                                 delta=delta_vs_best(abl, ablations=True)), ""]
    if paired is None:
        paired = paired_in_table_order(rows, runs)
    paired_md = pr.md_table(pr.paired_table_rows(paired), pr.PAIRED_COLS)
    if paired_md:
        parts += ["## Koi against each policy, paired by seed", "",
                  "Every policy ran the same seeds — the same arrivals, reclaims, failures and engine update — so "
                  "each seed's difference Koi − policy is free of what the seed does to all of them. Mean ± "
                  "standard error over the seeds both ran, and on how many Koi was better; goodput is relative, "
                  "and the cost column is the saving per SLO token (positive: Koi cheaper).", "", paired_md, ""]
    cl = pr.md_table(pr.claim_table_rows(pr.claims(rows, paired=paired)), pr.CLAIM_COLS, text_cols=2)
    if cl:
        parts += ["## The paper's claims on these runs", "",
                  "Means over seeds; the strongest baseline is the one with the best overall score (the oracle "
                  "and Koi's own variants are not baselines); 1.45× and 0.69× are the paper's margins "
                  "(2,911 vs 2,004 tok/s; 1.85 vs 2.69 ×10⁻⁴ $/token).", "", cl, ""]
    codes = sorted({r.meta.code_digest for r in runs})
    if len(codes) > 1:
        parts += [f"**Note:** these runs were made by {len(codes)} different versions of the code "
                  f"({', '.join(c or '?' for c in codes)}); `koi bench run --fresh` recomputes them.", ""]
    kern = sorted({k for r in rows for k in r.kernels})  # the rows carry each policy's runs' kernels
    if len(kern) > 1:
        parts += [f"**Note:** these runs were made with {len(kern)} different numeric kernels "
                  f"({'; '.join(kern)}; `?`: not recorded); kernels that round differently give different last "
                  "digits and, through the simulation, different runs (`koi/numerics.py`).", ""]
    cut = [r for r in rows if r.clock_bound_ticks]
    if cut:
        parts += ["**Note:** a wall-clock limit (the MILP's time limit, EvoX's time budget) cut the planning of "
                  + ", ".join(f"{r.clock_bound_ticks} tick(s) of {r.label}" for r in cut)
                  + ": those plans depend on the machine's speed, so another machine may not reproduce these "
                  "runs (each run's `meta.clock_bound` names the ticks).", ""]
    llm = llm_table(rows)
    if llm:
        parts += ["## Language models", "", "The planners that ask a model, summed over their runs: how many "
                  "ticks' proposals were the model's own plan (the rest are the fallback) and what the model "
                  "was asked for.", "", llm, ""]
    parts += ["## Runs", "", "Clock-bound ticks: ticks whose plan a wall-clock limit cut (— : not recorded).", "",
              "| Method | seeds | mean wall s / run | fallback ticks | clock-bound ticks | ticks |",
              "|---|---|---:|---:|---:|---:|"]
    for r in rows:
        cb = "—" if r.clock_bound_ticks is None else str(r.clock_bound_ticks)
        parts.append(f"| {_label(r)} | {' '.join(map(str, r.seeds))} | {r.wall_s:.1f} | {r.fallback_ticks} | {cb} "
                     f"| {r.ticks} |")
    parts += ["", "## Metrics: the exact formulas", "", "From `koi/bench/evaluator.py` (FORMULAS), verbatim:", "",
              "```text", FORMULAS, "```", ""]
    parts += ["$/M SLO tokens is the cost per SLO token in dollars per million tokens (the paper prints "
              "×10⁻⁴ $/token; this fleet's costs are two orders of magnitude lower, so ×10⁻⁴ would round "
              "every row to 0.05); Overall score is the composite.", ""]
    if figures:
        parts += ["## Figures", ""]
        for name, p in figures.items():
            parts.append(f"![{name}]({p.name})")
        parts.append("")
    return "\n".join(parts)


def write_report(scenario: str, digest: str, hours: float, runs: Sequence[RunResult], out_dir: Path, *,
                 figures: dict[str, Path] | None = None) -> Report:
    """Write report.md, the CSV tables and summary.json for these runs; return the report."""
    if not runs:
        raise ValueError(f"no cached runs of {scenario!r} to report on")
    rows = policy_rows(runs)
    paired = paired_in_table_order(rows, runs)
    out_dir.mkdir(parents=True, exist_ok=True)
    md = build_markdown(scenario, digest, hours, rows, runs, figures, paired)
    main_csv, abl_csv = csv_table(main_rows(rows)), csv_table(ablation_rows(rows))
    files = {"markdown": out_dir / "report.md", "main_csv": out_dir / "table_main.csv",
             "ablation_csv": out_dir / "table_ablation.csv", "summary": out_dir / "summary.json"}
    files["markdown"].write_text(md, encoding="utf-8")
    files["main_csv"].write_text(main_csv, encoding="utf-8")
    files["ablation_csv"].write_text(abl_csv, encoding="utf-8")
    rep = Report(scenario=scenario, digest=digest, hours=hours, rows=rows, markdown=md, main_csv=main_csv,
                 ablation_csv=abl_csv, files={**files, **(figures or {})},
                 paired=paired, claims=pr.claims(rows, paired=paired))
    files["summary"].write_text(json.dumps(rep.json(), indent=1), encoding="utf-8")
    return rep


def select_runs(scenario: str, *, cache_dir: str | Path | None = None, hours: float | None = None,
                via: str = "in-process", policies: Collection[str] | None = None,
                seeds: Collection[int] | None = None) -> tuple[str, str, float, list[RunResult]]:
    """(scenario name, digest, hours, runs) to report on: the cached runs of the scenario's current
    file at ``hours`` (default: its duration; when none ran that long, the horizon most runs used),
    of ``policies`` and ``seeds`` when given (default: every cached one).

    A language-model policy may have runs of several model setups for one seed (its key carries the
    setup): the one the settings give now is reported, else the latest made."""
    from collections import Counter

    from koi.bench.cache import RunCache, scenario_digest
    from koi.bench.runner import load

    sc, _path = load(scenario)
    digest = scenario_digest(sc)
    cache = RunCache(cache_dir, via=via)
    runs = [r for r in cache.runs(sc.name, digest=digest)
            if (policies is None or r.key.policy in policies) and (seeds is None or r.key.seed in seeds)]
    h = float(hours) if hours is not None else sc.duration_s / 3600.0
    chosen = [r for r in runs if abs(r.key.hours - h) < 1e-9]
    if not chosen and hours is None and runs:
        h = Counter(r.key.hours for r in runs).most_common(1)[0][0]
        chosen = [r for r in runs if abs(r.key.hours - h) < 1e-9]
    return sc.name, digest, h, _one_per_seed(chosen)


def _one_per_seed(runs: list[RunResult]) -> list[RunResult]:
    """One run per (policy, seed): of several LLM setups, the current one, else the latest finished."""
    from koi.bench.policies.llm import llm_setup_tag
    from koi.config import get_settings

    groups: dict[tuple[str, int], list[RunResult]] = {}
    for r in runs:
        groups.setdefault((r.key.policy, r.key.seed), []).append(r)
    out = []
    for (policy, _seed), rs in groups.items():
        if len(rs) > 1:
            now = llm_setup_tag(policy, get_settings())
            rs = sorted(rs, key=lambda r: (r.key.llm == now, r.meta.finished_at))
        out.append(rs[-1])
    return sorted(out, key=lambda r: (r.key.policy, r.key.seed))


def rebuild(scenario: str, *, cache_dir: str | Path | None = None, hours: float | None = None,
            via: str = "in-process", figures: bool = True, policies: Collection[str] | None = None,
            seeds: Collection[int] | None = None) -> Report:
    """Tables and figures of a scenario from its cached runs (optionally of some policies and seeds),
    written under its report directory."""
    from koi.bench.cache import RunCache

    name, digest, h, runs = select_runs(scenario, cache_dir=cache_dir, hours=hours, via=via, policies=policies,
                                        seeds=seeds)
    if not runs:
        which = "".join([f", policies {', '.join(sorted(policies))}" if policies is not None else "",
                         f", seeds {', '.join(map(str, sorted(seeds)))}" if seeds is not None else ""])
        raise LookupError(f"no cached runs of {scenario!r} (hours {h:g}{which}); "
                          f"run `koi bench run --scenario {scenario}` first")
    out = RunCache(cache_dir, via=via).report_dir(name)
    figs: dict[str, Path] = {}
    if figures:
        from koi.bench.figures import write_figures

        figs = write_figures(runs, out, policy_rows(runs))
    return write_report(name, digest, h, runs, out, figures=figs)
