"""Per-job breakdown of cached runs: where each policy's GPU-hours, swaps and SLO misses go.

The policy table says *how much* (composite, goodput, cost per SLO token); an operator comparing Koi
with the planner they would otherwise use next asks *where*: which jobs one policy holds on more
GPUs, what those GPUs buy (requests within target, p99 windows met), and which jobs it moves. On
hetero-3h that is how Koi's extra ~4% spend was traced to two jobs whose p99 targets the prior
surrogate thinks it meets (benchmarks/results/hetero-3h/README.md, sixteenth run); this module makes
that analysis a command (``koi bench jobs``) instead of a one-off script.

Every SLO figure is the common evaluator's own formula (:func:`koi.bench.evaluator.evaluate`) applied
to one job's records with that job alone in the job list, so the denominators are the job's own
(its arrivals, its batch requests) and nothing is computed twice in two ways. Per run and job:

- TTFT %, TPOT %, p99 SLO windows % (online jobs), batch progress % and deadline met (batch jobs
  whose deadline falls inside the horizon), SLO tokens: as in the evaluator's module docstring;
- GPU-hours = Σ over ticks of the GPUs the job held at the tick (the trace's ``gpus_by_job``, the
  allocation figure's data) × the tick length;
- $ = what the instances its ranks held cost over the run, by market (the run's ``job_cost_usd``, the
  simulated fleet's showback: each instance at its pool's hourly price from allocation to release,
  so a reserved GPU costs its reserved price and a spot one its spot price). The fleet's bill also
  pays for reserved capacity no job held; that is a row of its own, ``(idle reserved)`` = the run's
  fleet cost − Σ jobs' $, so the all-jobs row adds up to the fleet cost in the policy table. Runs
  cached before per-job dollars were recorded have none: their $ is blank, never zero;
- $/M SLO tok = the job's mean $ / its mean SLO tokens (the ratio of sums over the seeds, so a seed
  whose job earned no SLO token does not make it infinite; the policy table averages each seed's
  ratio instead, so its figure can differ slightly); ∞ when dollars bought no SLO token;
- swaps = ticks whose committed plan swapped the job's ladder.

Over seeds each figure is the mean (deadline met: the share of seeds, %); $ is blank for a job when
any of its runs lacks it (a mean over fewer seeds than the other columns would not compare). A job a
run never submitted is absent from that run's rows, not zero.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence

import numpy as np
from pydantic import Field

from koi.bench.cache import RunResult
from koi.bench.evaluator import EvalInputs, evaluate
from koi.domain import JobClass
from koi.domain.common import KoiModel


class JobRow(KoiModel):
    """One job under one policy (one run, or the mean over the policy's seeds)."""

    policy: str
    job_id: str
    job_class: str
    seeds: int = Field(default=1, ge=1, description="runs averaged")
    requests: float = Field(description="online: arrivals counted by the evaluator; batch: requests submitted")
    ttft_pct: float | None = None
    tpot_pct: float | None = None
    p99_windows_pct: float | None = None
    progress_pct: float | None = None
    deadline_met_pct: float | None = Field(default=None, description="batch: runs meeting the deadline, %")
    slo_tokens: float
    gpu_hours: float
    swaps: float
    usd: float | None = Field(default=None, description="$ of the instances the job's ranks held")
    usd_by_market: dict[str, float] | None = Field(default=None, description="market -> $ (markets used)")


#: The pseudo-job that carries the reserved capacity no job held (its $ only).
IDLE_RESERVED = "(idle reserved)"
MARKETS = ("reserved", "on_demand", "spot")


def run_job_rows(run: RunResult, records: np.ndarray) -> list[JobRow]:
    """Every evaluated job of one run, from its records and trace (module docstring)."""
    if run.eval_inputs is None:
        raise ValueError(f"run {run.key.stem} of {run.key.policy} stores no evaluator inputs; "
                         "run it again (`koi bench run --fresh`) to break it down by job")
    ei = run.eval_inputs
    tick_h = run.meta.tick_s / 3600.0
    gpu_h: dict[str, float] = defaultdict(float)
    swaps: dict[str, int] = defaultdict(int)
    for t in run.trace:
        for job_id, by_type in t.gpus_by_job.items():
            gpu_h[job_id] += sum(by_type.values()) * tick_h
        for job_id, action in t.actions.items():
            swaps[job_id] += action == "swap"

    idx = records["job"].astype(np.int64) if len(records) else np.zeros(0, np.int64)
    order = np.argsort(idx, kind="stable")
    bounds = np.searchsorted(idx[order], np.arange(len(ei.jobs) + 1))
    rows = []
    for i, job in enumerate(ei.jobs):
        mine = records[order[bounds[i]:bounds[i + 1]]]  # fancy indexing: a copy, safe to relabel
        mine["job"] = 0
        m = evaluate(EvalInputs(jobs=[job], records=mine, horizon_s=run.meta.horizon_s, fleet_cost_usd=0.0,
                                reserved_cost_usd=0.0, admitted_jobs=set(ei.admitted_jobs), grace_s=ei.grace_s,
                                window_s=run.meta.tick_s))
        online = job.job_class is JobClass.ONLINE
        due = not online and job.deadline_at is not None and job.deadline_at <= run.meta.horizon_s
        rows.append(JobRow(
            policy=run.key.policy, job_id=job.job_id, job_class=job.job_class.value,
            requests=float(m.online_requests if online else m.batch_requests),
            ttft_pct=m.ttft_attainment_pct if online else None,
            tpot_pct=m.tpot_attainment_pct if online else None,
            p99_windows_pct=m.p99_windows_pct if online else None,
            progress_pct=None if online else m.batch_progress_pct,
            deadline_met_pct=m.deadline_attainment_pct if due else None,
            slo_tokens=m.slo_tokens, gpu_hours=gpu_h.get(job.job_id, 0.0), swaps=float(swaps.get(job.job_id, 0)),
            **_dollars(run, job.job_id),
        ))
    idle = None if run.job_cost_usd is None else max(ei.fleet_cost_usd - sum(r.usd or 0.0 for r in rows), 0.0)
    rows.append(JobRow(policy=run.key.policy, job_id=IDLE_RESERVED, job_class="fleet", requests=0.0, slo_tokens=0.0,
                       gpu_hours=0.0, swaps=0.0, usd=idle, usd_by_market=None if idle is None else {"reserved": idle}))
    return rows


def _dollars(run: RunResult, job_id: str) -> dict[str, object]:
    if run.job_cost_usd is None:
        return {}
    by = run.job_cost_usd.get(job_id, {})
    return {"usd": float(sum(by.values())), "usd_by_market": {m: float(by[m]) for m in MARKETS if m in by}}


def _mean(xs: Sequence[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return float(np.mean(vals)) if vals else None


def _mean_markets(rs: Sequence[JobRow]) -> dict[str, float] | None:
    if any(r.usd_by_market is None for r in rs):
        return None
    used = [m for m in MARKETS if any(m in (r.usd_by_market or {}) for r in rs)]
    return {m: float(np.mean([(r.usd_by_market or {}).get(m, 0.0) for r in rs])) for m in used}


def mean_rows(rows: Iterable[JobRow]) -> list[JobRow]:
    """One row per (policy, job): the mean over its runs, in first-seen order."""
    groups: dict[tuple[str, str], list[JobRow]] = {}
    for r in rows:
        groups.setdefault((r.policy, r.job_id), []).append(r)
    out = []
    for (policy, job_id), rs in groups.items():
        markets = _mean_markets(rs)
        out.append(JobRow(
            policy=policy, job_id=job_id, job_class=rs[0].job_class, seeds=len(rs),
            requests=float(np.mean([r.requests for r in rs])),
            ttft_pct=_mean([r.ttft_pct for r in rs]), tpot_pct=_mean([r.tpot_pct for r in rs]),
            p99_windows_pct=_mean([r.p99_windows_pct for r in rs]), progress_pct=_mean([r.progress_pct for r in rs]),
            deadline_met_pct=_mean([r.deadline_met_pct for r in rs]),
            slo_tokens=float(np.mean([r.slo_tokens for r in rs])), gpu_hours=float(np.mean([r.gpu_hours for r in rs])),
            swaps=float(np.mean([r.swaps for r in rs])),
            usd=None if markets is None else float(np.mean([r.usd for r in rs])), usd_by_market=markets,
        ))
    return out


def job_breakdown(runs: Sequence[RunResult], records_of: Callable[[RunResult], np.ndarray | None]) -> list[JobRow]:
    """The per-job means of each policy over its runs; ``records_of`` reads a run's records (the cache).
    A run whose records are gone is named in the error rather than skipped (a silent skip would change
    the mean's seeds)."""
    rows: list[JobRow] = []
    for run in runs:
        rec = records_of(run)
        if rec is None:
            raise FileNotFoundError(f"the records of {run.key.policy} {run.key.stem} are missing from the cache; "
                                    "run it again (`koi bench run --fresh`)")
        rows += run_job_rows(run, rec)
    return mean_rows(rows)


#: The columns of :func:`display_rows` (the terminal table and the Markdown file).
JOB_COLUMNS = ["job", "policy", "$", "$ res / od / spot", "$/M SLO tok", "GPU-h", "swaps", "TTFT %", "TPOT %",
               "p99 windows %", "progress %", "deadline met %", "SLO Mtok"]
ALL_JOBS = "(all jobs)"


def _fmt(x: float | None, digits: int = 1) -> str:
    return "" if x is None else f"{x:,.{digits}f}"


def _markets(by: dict[str, float] | None) -> str:
    return "" if by is None else " / ".join(f"{by.get(m, 0.0):,.0f}" for m in MARKETS)


def _per_mtok(usd: float | None, tokens: float) -> str:
    """$ per million SLO tokens of the means (over the same seeds: the ratio of the sums); ∞ for dollars
    that bought no SLO token."""
    if usd is None:
        return ""
    return f"{usd / tokens * 1e6:,.2f}" if tokens > 0 else ("∞" if usd > 0 else "")


def _row(job_id: str, r: JobRow) -> dict[str, str]:
    idle = r.job_id == IDLE_RESERVED  # dollars only: it holds no GPU, serves no token
    return {"job": job_id, "policy": r.policy, "$": _fmt(r.usd, 0), "$ res / od / spot": _markets(r.usd_by_market),
            "$/M SLO tok": "" if idle else _per_mtok(r.usd, r.slo_tokens),
            "GPU-h": "" if idle else _fmt(r.gpu_hours), "swaps": "" if idle else _fmt(r.swaps),
            "TTFT %": _fmt(r.ttft_pct, 2), "TPOT %": _fmt(r.tpot_pct, 2), "p99 windows %": _fmt(r.p99_windows_pct),
            "progress %": _fmt(r.progress_pct), "deadline met %": _fmt(r.deadline_met_pct, 0),
            "SLO Mtok": "" if idle else _fmt(r.slo_tokens / 1e6, 2)}


def _sum(xs: Iterable[float | None]) -> float | None:
    vals = list(xs)
    return None if any(x is None for x in vals) else float(sum(v for v in vals if v is not None))


def display_rows(rows: Sequence[JobRow]) -> list[dict[str, str]]:
    """The breakdown as table rows: jobs where the policies' dollars differ most first (GPU-hours when
    some run has no dollars) — that is where their spend differs — each job's policies in the order
    given, then the idle reserved capacity, then one all-jobs row per policy (dollars, GPU-hours, swaps
    and SLO tokens summed; its $ is the policy table's fleet cost)."""
    by_job: dict[str, list[JobRow]] = {}
    for r in rows:
        if r.job_id != IDLE_RESERVED:
            by_job.setdefault(r.job_id, []).append(r)
    dollars = all(r.usd is not None for rs in by_job.values() for r in rs)

    def spread(job_id: str) -> float:
        g = [(r.usd or 0.0) if dollars else r.gpu_hours for r in by_job[job_id]]
        return max(g) - min(g)

    out = [_row(job_id, r) for job_id in sorted(by_job, key=lambda j: (-spread(j), j)) for r in by_job[job_id]]
    out += [_row(IDLE_RESERVED, r) for r in rows if r.job_id == IDLE_RESERVED and r.usd is not None]
    policies = list(dict.fromkeys(r.policy for r in rows))
    for p in policies:
        mine = [r for r in rows if r.policy == p]
        markets = None if any(r.usd_by_market is None for r in mine) else {
            m: sum((r.usd_by_market or {}).get(m, 0.0) for r in mine) for m in MARKETS}
        usd = _sum(r.usd for r in mine)
        out.append({"job": ALL_JOBS, "policy": p, "$": _fmt(usd, 0), "$ res / od / spot": _markets(markets),
                    "$/M SLO tok": _per_mtok(usd, sum(r.slo_tokens for r in mine)),
                    "GPU-h": _fmt(sum(r.gpu_hours for r in mine)),
                    "swaps": _fmt(sum(r.swaps for r in mine)), "TTFT %": "", "TPOT %": "", "p99 windows %": "",
                    "progress %": "", "deadline met %": "",
                    "SLO Mtok": _fmt(sum(r.slo_tokens for r in mine) / 1e6, 2)})
    return out


def markdown(rows: Sequence[JobRow], title: str) -> str:
    """The breakdown as a Markdown table under ``title``."""
    lines = [f"# {title}", "", "| " + " | ".join(JOB_COLUMNS) + " |",
             "|" + "|".join("---" if c in ("job", "policy") else "---:" for c in JOB_COLUMNS) + "|"]
    lines += ["| " + " | ".join(r[c] for c in JOB_COLUMNS) + " |" for r in display_rows(rows)]
    return "\n".join(lines) + "\n"
