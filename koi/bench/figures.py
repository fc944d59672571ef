"""Figures of a benchmark (the paper's Figures 4–6) as PNG, from cached run traces (matplotlib, Agg).

- ``allocation.png`` (Fig. 5): per-job GPU allocation over time, one panel per policy (its
  lowest seed): rows are jobs, time on x, the colour is the GPU family holding most of the
  job's GPUs at that tick (bar height ∝ the job's GPUs relative to its own peak), markers
  for place (●), swap (▲) and relaunch (✕) in the committed plans;
- ``slo_attainment.png`` (Fig. 4b): TTFT (solid) and TPOT (dashed) attainment of the online
  requests arriving in each tick's interval, per policy, mean over seeds;
- ``dro_radius.png`` (Fig. 4c): Koi's DRO radius ε per tick (mean over seeds, min–max band);
- ``mechanisms.png`` (Fig. 4d): Koi's active (applicable to live ranks) and cumulative
  (tested or admitted) mechanisms per tick;
- ``uncertainty.png``: Koi's mean causal uncertainty U over the edges exercised so far;
- ``ablation.png`` (Fig. 6): overall score, TTFT and TPOT attainment and goodput of Koi's
  variants (bars: mean over seeds, whiskers: std).

Koi's panels use the policy named ``koi``, else the first policy with a learning trace.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from koi.bench.cache import RunResult
from koi.bench.report import ABLATION, KOI, LLM_ABLATION, PolicyRow, ablation_rows, policy_rows


def _plt():  # noqa: ANN202 - matplotlib.pyplot
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def gpu_family(gpu_type: str) -> str:
    """H100-80GB and H100 → H100; A100-40GB and A100-80GB → A100; RTX PRO 6000 stays whole."""
    g = gpu_type.replace("_", "-")
    head = g.split("-")[0]
    return head if any(ch.isdigit() for ch in head) else g


def _by_policy(runs: Sequence[RunResult]) -> dict[str, list[RunResult]]:
    out: dict[str, list[RunResult]] = {}
    for r in sorted(runs, key=lambda r: (r.key.policy, r.key.seed)):
        out.setdefault(r.key.policy, []).append(r)
    return out


def _hours(runs: Sequence[RunResult]) -> np.ndarray:
    r = runs[0]
    return np.array([t.t for t in r.trace]) / 3600.0


def _series(runs: Sequence[RunResult], field: str) -> np.ndarray:
    """ticks × seeds (NaN where missing)."""
    n = max(len(r.trace) for r in runs)
    out = np.full((n, len(runs)), np.nan)
    for j, r in enumerate(runs):
        for i, t in enumerate(r.trace):
            v = getattr(t, field)
            if v is not None:
                out[i, j] = float(v)
    return out


def _learner(runs_by: dict[str, list[RunResult]]) -> str | None:
    if KOI in runs_by:
        return KOI
    for name, rs in runs_by.items():
        if any(t.dro_radius is not None for t in rs[0].trace):
            return name
    return None


def _save(fig, path: Path) -> Path:  # noqa: ANN001 - a matplotlib Figure
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return path


# ---- Fig. 5: allocation -------------------------------------------------------------------------------------
def allocation_figure(runs: Sequence[RunResult], rows: Sequence[PolicyRow], path: Path) -> Path:
    plt = _plt()
    by = _by_policy(runs)
    order = [r.policy for r in rows if r.policy in by]
    families = sorted({gpu_family(g) for r in runs for t in r.trace for by_gpu in t.gpus_by_job.values()
                       for g in by_gpu})
    cmap = plt.get_cmap("tab10" if len(families) <= 10 else "tab20")
    colour = {f: cmap(i % cmap.N) for i, f in enumerate(families)}
    jobs = [j.job_id for j in runs[0].jobs]
    n = len(order)
    height = max(2.0, 0.22 * len(jobs) + 0.8) * n + 0.8
    fig, axes = plt.subplots(n, 1, figsize=(12, height), squeeze=False, sharex=True)
    fig.subplots_adjust(top=1.0 - 0.8 / height, hspace=0.35)
    for ax, name in zip(axes[:, 0], order, strict=True):
        run = by[name][0]
        label = next((r.label for r in rows if r.policy == name), name)
        tick_h = run.meta.tick_s / 3600.0
        peak = {j: max((sum(t.gpus_by_job.get(j, {}).values()) for t in run.trace), default=0) for j in jobs}
        for y, job in enumerate(jobs):
            for t in run.trace:
                g = t.gpus_by_job.get(job)
                if not g:
                    continue
                total = sum(g.values())
                fam: dict[str, int] = {}
                for k, v in g.items():
                    fam[gpu_family(k)] = fam.get(gpu_family(k), 0) + v
                top = max(sorted(fam), key=lambda f: fam[f])
                h = 0.25 + 0.6 * (total / peak[job] if peak[job] else 0.0)
                ax.add_patch(plt.Rectangle((t.t / 3600.0, y - h / 2), tick_h, h, color=colour[top], lw=0))
            for t in run.trace:
                kind = t.actions.get(job)
                if kind is None:
                    continue
                m = {"place": ("o", "black"), "swap": ("^", "crimson"), "relaunch": ("x", "darkorange")}[kind]
                ax.plot(t.t / 3600.0, y, marker=m[0], color=m[1], ms=4.5, lw=0)
        ax.set_ylim(-0.7, len(jobs) - 0.3)
        ax.set_yticks(range(len(jobs)))
        ax.set_yticklabels(jobs, fontsize=6)
        ax.invert_yaxis()
        ax.set_xlim(0, run.meta.horizon_s / 3600.0)
        ax.set_title(f"{label} (seed {run.key.seed})", fontsize=9, loc="left")
    axes[-1, 0].set_xlabel("time (h)")
    handles = [plt.Rectangle((0, 0), 1, 1, color=colour[f]) for f in families]
    handles += [plt.Line2D([], [], marker=m, color=c, lw=0) for m, c in (("o", "black"), ("^", "crimson"),
                                                                          ("x", "darkorange"))]
    fig.legend(handles, [*families, "place", "swap", "relaunch"], loc="upper right", fontsize=7,
               ncol=min(len(families) + 3, 8), bbox_to_anchor=(0.99, 1.0 - 0.1 / height))
    fig.suptitle("Per-job GPU allocation (colour: GPU family; height: share of the job's peak GPUs)", fontsize=10,
                 x=0.02, y=1.0 - 0.1 / height, ha="left")
    return _save(fig, path)


# ---- Fig. 4b: SLO attainment ----------------------------------------------------------------------------------
def attainment_figure(runs: Sequence[RunResult], rows: Sequence[PolicyRow], path: Path) -> Path:
    plt = _plt()
    by = _by_policy(runs)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    cmap = plt.get_cmap("tab20")
    for i, r in enumerate(x for x in rows if x.policy in by):
        rs = by[r.policy]
        h = _hours(rs)
        c = cmap(i % cmap.N)
        with np.errstate(all="ignore"):
            ttft = np.nanmean(_series(rs, "ttft_attainment"), axis=1)
            tpot = np.nanmean(_series(rs, "tpot_attainment"), axis=1)
        ax.plot(h, ttft, color=c, lw=1.4, label=f"{r.label} TTFT")
        ax.plot(h, tpot, color=c, lw=1.2, ls="--", label=f"{r.label} TPOT")
    ax.set_xlabel("time (h)")
    ax.set_ylabel("attainment of requests arriving in the tick (%)")
    ax.set_ylim(-2, 102)
    ax.set_title("Online SLO attainment: TTFT (solid), TPOT (dashed)", fontsize=10)
    ax.legend(fontsize=6, ncol=2, loc="center left", bbox_to_anchor=(1.0, 0.5))
    return _save(fig, path)


# ---- Fig. 4c/d and U: Koi's learning ----------------------------------------------------------------------------
def _band(ax, h: np.ndarray, s: np.ndarray, colour: str, label: str, ls: str = "-") -> None:  # noqa: ANN001
    some = np.isfinite(s).any(axis=1)  # a tick no seed has a value for stays a gap (NaN), without a warning
    mean, lo, hi = (np.full(len(s), np.nan) for _ in range(3))
    mean[some] = np.nanmean(s[some], axis=1)
    lo[some], hi[some] = np.nanmin(s[some], axis=1), np.nanmax(s[some], axis=1)
    ax.plot(h, mean, color=colour, lw=1.6, ls=ls, label=label)
    if s.shape[1] > 1:
        ax.fill_between(h, lo, hi, color=colour, alpha=0.18, lw=0)


def learning_figures(runs: Sequence[RunResult], out_dir: Path) -> dict[str, Path]:
    plt = _plt()
    by = _by_policy(runs)
    who = _learner(by)
    if who is None:
        return {}
    rs = by[who]
    label = rs[0].meta.label
    h = _hours(rs)
    seeds = ", ".join(str(r.key.seed) for r in rs)
    out: dict[str, Path] = {}

    fig, ax = plt.subplots(figsize=(8, 3.5))
    _band(ax, h, _series(rs, "dro_radius"), "tab:blue", "ε")
    ax.set_xlabel("time (h)")
    ax.set_ylabel("DRO radius ε")
    ax.set_title(f"{label}: calibrated DRO radius (seeds {seeds})", fontsize=10)
    out["dro_radius"] = _save(fig, out_dir / "dro_radius.png")

    fig, ax = plt.subplots(figsize=(8, 3.5))
    _band(ax, h, _series(rs, "active_mechanisms"), "tab:green", "active (applicable to live ranks)")
    _band(ax, h, _series(rs, "cumulative_mechanisms"), "tab:purple", "cumulative (tested or admitted)", ls="--")
    ax.set_xlabel("time (h)")
    ax.set_ylabel("mechanisms")
    ax.legend(fontsize=8)
    ax.set_title(f"{label}: active and cumulative mechanisms (seeds {seeds})", fontsize=10)
    out["mechanisms"] = _save(fig, out_dir / "mechanisms.png")

    fig, ax = plt.subplots(figsize=(8, 3.5))
    _band(ax, h, _series(rs, "mean_u"), "tab:red", "mean U")
    ax.set_xlabel("time (h)")
    ax.set_ylabel("mean causal uncertainty U")
    ax.set_title(f"{label}: mean U of the exercised edges (seeds {seeds})", fontsize=10)
    out["uncertainty"] = _save(fig, out_dir / "uncertainty.png")
    return out


# ---- Fig. 6: ablations ---------------------------------------------------------------------------------------------
def ablation_figure(rows: Sequence[PolicyRow], path: Path) -> Path | None:
    abl = ablation_rows(rows)
    if len(abl) < 2:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    x = np.arange(len(abl))
    names = [r.label for r in abl]

    def bars(ax, metric: str, offset: float = 0.0, width: float = 0.7, colour: str = "tab:blue",  # noqa: ANN001
             label: str | None = None) -> None:
        m = [r.stats[metric][0] for r in abl]
        s = [r.stats[metric][1] for r in abl]
        m = [v if math.isfinite(v) else 0.0 for v in m]
        ax.bar(x + offset, m, width, yerr=s, color=colour, capsize=3, label=label)

    bars(axes[0], "composite")
    axes[0].set_title("Overall score", fontsize=10)
    bars(axes[1], "ttft_attainment_pct", -0.2, 0.4, "tab:orange", "TTFT")
    bars(axes[1], "tpot_attainment_pct", 0.2, 0.4, "tab:green", "TPOT")
    axes[1].set_title("SLO attainment (%)", fontsize=10)
    axes[1].legend(fontsize=8)
    bars(axes[2], "goodput_tok_s", colour="tab:purple")
    axes[2].set_title("Goodput (tok/s)", fontsize=10)
    for ax in axes:
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=25, ha="right", fontsize=8)
    fig.suptitle("Ablations", fontsize=10)
    return _save(fig, path)


def write_figures(runs: Sequence[RunResult], out_dir: Path, rows: Sequence[PolicyRow] | None = None) -> dict[str, Path]:
    """Every figure the runs support, as PNG files in ``out_dir``; name → path."""
    if not runs:
        return {}
    rows = list(rows) if rows is not None else policy_rows(runs)
    out = {
        "allocation": allocation_figure(runs, rows, out_dir / "allocation.png"),
        "slo_attainment": attainment_figure(runs, rows, out_dir / "slo_attainment.png"),
    }
    out.update(learning_figures(runs, out_dir))
    abl = ablation_figure(rows, out_dir / "ablation.png")
    if abl is not None:
        out["ablation"] = abl
    return out


__all__ = ["ABLATION", "LLM_ABLATION", "gpu_family", "write_figures"]
