"""The common evaluator: every policy's metrics from its per-request records and per-tick trace.

Overview §3.1: "A common evaluator computes all results from per-run traces using
workload-defined denominators, so a planner cannot improve its score by refusing or
dropping work." Every denominator below counts what the *workload* asked for, never
what the policy chose to serve.

Definitions (the report prints these verbatim, see :data:`FORMULAS`):

- online admission % = online jobs that ever had a serving replica / online jobs submitted;
- batch admission %  = batch jobs that ever had a serving replica / batch jobs submitted;
- batch progress %   = batch requests served by the horizon / batch requests submitted;
- deadline attainment % = batch jobs whose every request was served by the deadline /
  batch jobs whose deadline falls inside the horizon;
- TTFT attainment %  = online requests whose first token came within the job's p99 TTFT
  target / online requests that arrived (a dropped, timed-out or never-served request
  misses); requests arriving in the last ``grace_s`` of the run are left out of the
  denominator because their outcome is not yet known;
- TPOT attainment %  = online requests that finished with (finish − first token) /
  (tokens out − 1) within the TPOT target / the same denominator;
- SLO goodput tok/s  = (output tokens of online requests meeting both targets + output
  tokens of batch jobs that met their deadline) / horizon;
- cost per SLO token = fleet cost over the run (every provisioned GPU, idle reserved
  capacity included) / SLO tokens;
- p99 SLO windows %  = (online job, window) pairs whose p99 TTFT and p99 TPOT both met the
  job's targets / (online job, window) pairs with at least one arrival (windows of
  ``window_s``, the tick; the same requests as the attainments above; a request without a
  first token has an infinite TTFT and one that did not finish an infinite TPOT, so a job left
  waiting or dropped breaches its windows; TPOT over the window's requests of more than one
  output token and its unfinished ones). Reported beside the composite, not in it.
- composite = geometric mean of three pillars in [0, 100]:
  Quality = mean(TTFT att., TPOT att., deadline att.),
  Coverage = mean(online admission, batch admission, batch progress),
  Efficiency = mean(goodput share, cost efficiency), where goodput share = SLO tokens /
  demanded tokens (all output tokens the workload asked for in the horizon) and cost
  efficiency = min(1, c_ref / cost per SLO token) with c_ref the scenario's reference
  cost per token (the fleet's reserved commitment spread over the demanded tokens: what
  a token costs when the already-paid capacity serves all demand).

Choices where the paper is silent: the targets are p99s, and an operator checks a p99 SLO
per window, which the per-request attainments do not show (a job whose p99 TPOT sits just past
its target every window still has ~99% of its requests within it); the p99 SLO windows % says
how often each job's SLO as written held, with the nearest-rank p99 (the smallest value at or
above 99% of the window's values; with under 100 requests, the window's maximum). Pillar means
are arithmetic and the composite is the geometric mean of the pillars (the paper's "geometric
mean of three equally weighted pillars"); a pillar at 0 makes the composite 0, so a policy that refuses all
work scores 0 whatever its cost. c_ref is fixed by the scenario, so efficiency is
comparable across policies without reference to any other run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from pydantic import Field

from koi.domain import Job, JobClass
from koi.domain.common import KoiModel

FORMULAS = __doc__.split("Definitions (the report prints these verbatim, see :data:`FORMULAS`):", 1)[1].split(
    "Choices where the paper is silent", 1
)[0].strip()

SERVED = 0  # koi.sim.records.Status.SERVED, kept numeric so the evaluator needs no simulator import

#: Bump when a formula below changes. A cached run made under another version is re-scored from its stored
#: records and evaluator inputs (:meth:`koi.bench.cache.RunCache.load`), not simulated again: the formulas
#: read the run, they do not change it. 1: the formulas of runner version 3 (p99 SLO windows included).
EVAL_VERSION = 1

#: Requests arriving this close to the horizon are left out of the online denominators (outcome unknown).
GRACE_S = 60.0


class TickTrace(KoiModel):
    """What the evaluator and the figures need from one tick."""

    tick: int = Field(ge=0)
    t: float = Field(ge=0)
    outcome: str = "committed"
    swaps: int = Field(default=0, ge=0)
    keeps: int = Field(default=0, ge=0)
    places: int = Field(default=0, ge=0)
    defers: int = Field(default=0, ge=0)
    gpus_by_job: dict[str, dict[str, int]] = Field(default_factory=dict, description="job -> gpu_type -> GPUs")
    serving_jobs: list[str] = Field(default_factory=list)
    actions: dict[str, str] = Field(
        default_factory=dict, description="job -> place | swap | relaunch in the committed plan (figure markers)"
    )
    dro_radius: float | None = None
    active_mechanisms: int | None = None
    cumulative_mechanisms: int | None = None
    mean_u: float | None = None
    ttft_attainment: float | None = None
    tpot_attainment: float | None = None


class EvalInputs(KoiModel):
    model_config = {"arbitrary_types_allowed": True}

    jobs: list[Job] = Field(description="every job the scenario submitted, in the records' job-index order")
    records: np.ndarray = Field(description="koi.sim.records.RECORD_DTYPE structured array")
    horizon_s: float = Field(gt=0)
    fleet_cost_usd: float = Field(ge=0)
    reserved_cost_usd: float = Field(ge=0, description="the reserved commitment over the horizon (paid regardless)")
    trace: list[TickTrace] = Field(default_factory=list)
    admitted_jobs: set[str] = Field(default_factory=set, description="jobs that ever had a serving replica")
    grace_s: float = Field(default=GRACE_S, ge=0)
    window_s: float = Field(default=300.0, gt=0, description="the p99 SLO window (the tick)")


class Metrics(KoiModel):
    online_admission_pct: float
    batch_admission_pct: float
    batch_progress_pct: float
    deadline_attainment_pct: float
    ttft_attainment_pct: float
    tpot_attainment_pct: float
    p99_windows_pct: float = Field(description="(online job, window) pairs meeting both p99 targets, %")
    goodput_tok_s: float
    cost_per_slo_token: float = Field(description="$ per SLO token (inf when no SLO token)")
    fleet_cost_usd: float
    slo_tokens: float
    demanded_tokens: float
    swaps: int
    keeps: int
    quality: float
    coverage: float
    efficiency: float
    composite: float
    online_requests: int
    batch_requests: int


def _pct(num: float, den: float) -> float:
    return 100.0 * num / den if den > 0 else 100.0


def _nearest_rank_p99(keys: np.ndarray, values: np.ndarray, n_keys: int) -> np.ndarray:
    """The nearest-rank p99 of ``values`` per key in ``range(n_keys)`` (NaN for a key with no value)."""
    out = np.full(n_keys, np.nan)
    if not len(keys):
        return out
    order = np.lexsort((values, keys))
    k, v = keys[order], values[order]
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    counts = np.diff(np.r_[starts, len(k)])
    out[k[starts]] = v[starts + np.ceil(0.99 * counts).astype(np.int64) - 1]
    return out


def p99_window_flags(job_idx: np.ndarray, arrival: np.ndarray, ttft: np.ndarray, tpot: np.ndarray,
                     tpot_ok_rows: np.ndarray, ttft_t: np.ndarray, tpot_t: np.ndarray, window_s: float
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:  # fmt: skip
    """Per (job, window) pair with an arrival: (job index, window index, both p99 targets met) (module
    docstring). ``ttft`` is inf where no first token came and ``tpot`` where the request did not
    finish; ``tpot_ok_rows`` marks the requests whose TPOT counts."""
    if not len(job_idx):
        z = np.zeros(0, np.int64)
        return z, z, np.zeros(0, bool)
    w = np.floor(arrival / window_s).astype(np.int64)
    n_w = int(w.max()) + 1
    key = job_idx * n_w + w
    n_keys = int(ttft_t.shape[0]) * n_w
    p_ttft = _nearest_rank_p99(key, ttft, n_keys)
    p_tpot = _nearest_rank_p99(key[tpot_ok_rows], tpot[tpot_ok_rows], n_keys)
    seen = np.unique(key)
    jobs_of = seen // n_w
    ok = (p_ttft[seen] <= ttft_t[jobs_of] + 1e-9) & (np.isnan(p_tpot[seen]) | (p_tpot[seen] <= tpot_t[jobs_of] + 1e-9))
    return jobs_of, seen % n_w, ok


def p99_windows(job_idx: np.ndarray, arrival: np.ndarray, ttft: np.ndarray, tpot: np.ndarray,
                tpot_ok_rows: np.ndarray, ttft_t: np.ndarray, tpot_t: np.ndarray, window_s: float
                ) -> tuple[int, int]:  # fmt: skip
    """(windows meeting both p99 targets, windows with an arrival) over (job, window) pairs
    (:func:`p99_window_flags`)."""
    _, _, ok = p99_window_flags(job_idx, arrival, ttft, tpot, tpot_ok_rows, ttft_t, tpot_t, window_s)
    return int(ok.sum()), len(ok)


def _online_requests(inp: EvalInputs, rec_online: np.ndarray) -> tuple[np.ndarray, ...]:
    """The online requests the attainments count (arrived before the grace period) and what is judged of
    each: (records, job index, TTFT s, TPOT s, tokens out, finished, TTFT targets s, TPOT targets s)."""
    jobs, rec = inp.jobs, inp.records
    ttft_t = np.array([j.slo.p99_ttft_ms or np.inf for j in jobs]) / 1e3
    tpot_t = np.array([j.slo.p99_tpot_ms or np.inf for j in jobs]) / 1e3
    o = rec[rec_online & (rec["arrival"] <= inp.horizon_s - inp.grace_s)]
    gen = o["tokens_out"].astype(float)
    with np.errstate(divide="ignore", invalid="ignore"):
        tpot = np.where(gen > 1, (o["finish"] - o["first_token"]) / np.maximum(gen - 1, 1), 0.0)
    return (o, o["job"].astype(np.int64), o["first_token"] - o["arrival"], tpot, gen, o["status"] == SERVED,
            ttft_t, tpot_t)


def _window_args(on: tuple[np.ndarray, ...]) -> tuple[np.ndarray, ...]:
    """:func:`p99_window_flags`' arguments from :func:`_online_requests`: no first token is an infinite TTFT,
    not finished an infinite TPOT (waiting or dropped work breaches)."""
    o, oj, ttft, tpot, gen, finished, ttft_t, tpot_t = on
    return (oj, o["arrival"], np.where(np.isfinite(ttft), ttft, np.inf),
            np.where(finished & np.isfinite(tpot), tpot, np.inf), ~finished | (gen > 1), ttft_t, tpot_t)


def window_flags(inp: EvalInputs) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per online (job, window) pair with an arrival: (job index, window index, both p99 targets met) — the
    pairs ``p99_windows_pct`` counts, for diagnostics that ask which windows missed."""
    online = np.array([j.job_class is JobClass.ONLINE for j in inp.jobs], dtype=bool)
    rec_online = online[inp.records["job"].astype(np.int64)] if len(inp.records) else np.zeros(0, bool)
    return p99_window_flags(*_window_args(_online_requests(inp, rec_online)), inp.window_s)


def evaluate(inp: EvalInputs) -> Metrics:
    """All metrics of one run (see the module docstring for every formula)."""
    rec = inp.records
    jobs = inp.jobs
    n_jobs = len(jobs)
    online = np.array([j.job_class is JobClass.ONLINE for j in jobs], dtype=bool)
    job_idx = rec["job"].astype(np.int64)
    if len(rec) and (job_idx.min() < 0 or job_idx.max() >= n_jobs):
        raise ValueError("records name a job index outside the job list")
    rec_online = online[job_idx] if len(rec) else np.zeros(0, bool)

    osl = np.array([j.workload.osl for j in jobs])

    # ---- online requests -------------------------------------------------------------
    on = _online_requests(inp, rec_online)
    o, oj, ttft, tpot, gen, finished, ttft_t, tpot_t = on
    ok_ttft = np.isfinite(ttft) & (ttft <= ttft_t[oj] + 1e-9)
    ok_tpot = finished & np.isfinite(tpot) & (tpot <= tpot_t[oj] + 1e-9)
    n_online = len(o)
    online_slo_tokens = float(gen[ok_ttft & ok_tpot].sum())
    win_met, win_n = p99_windows(*_window_args(on), inp.window_s)
    online_demand = float(osl[oj].sum()) if n_online else 0.0

    # ---- batch jobs --------------------------------------------------------------------
    batch_jobs = [i for i, j in enumerate(jobs) if j.job_class is JobClass.BATCH]
    b_total = sum(jobs[i].slo.num_requests or 0 for i in batch_jobs)
    b_served = 0
    batch_slo_tokens = 0.0
    batch_demand = 0.0
    met, due = 0, 0
    for i in batch_jobs:
        j = jobs[i]
        mine = rec[job_idx == i]
        served = mine[mine["status"] == SERVED]
        b_served += len(served)
        batch_demand += (j.slo.num_requests or 0) * j.workload.osl
        deadline = j.deadline_at or math.inf
        done_by_deadline = int(np.sum(served["finish"] <= deadline + 1e-9))
        job_met = done_by_deadline >= (j.slo.num_requests or 0)
        if deadline <= inp.horizon_s:
            due += 1
            met += int(job_met)
        if job_met:
            batch_slo_tokens += float(served["tokens_out"].sum())

    submitted_online = [j.job_id for j in jobs if j.job_class is JobClass.ONLINE]
    submitted_batch = [jobs[i].job_id for i in batch_jobs]
    online_adm = _pct(sum(j in inp.admitted_jobs for j in submitted_online), len(submitted_online))
    batch_adm = _pct(sum(j in inp.admitted_jobs for j in submitted_batch), len(submitted_batch))

    slo_tokens = online_slo_tokens + batch_slo_tokens
    demanded = online_demand + batch_demand
    goodput = slo_tokens / inp.horizon_s
    cost_per = inp.fleet_cost_usd / slo_tokens if slo_tokens > 0 else math.inf
    c_ref = inp.reserved_cost_usd / demanded if demanded > 0 else 0.0

    ttft_att = _pct(float(ok_ttft.sum()), n_online)
    tpot_att = _pct(float(ok_tpot.sum()), n_online)
    deadline_att = _pct(met, due)
    progress = _pct(b_served, b_total)
    quality = float(np.mean([ttft_att, tpot_att, deadline_att]))
    coverage = float(np.mean([online_adm, batch_adm, progress]))
    goodput_share = _pct(slo_tokens, demanded)
    if slo_tokens <= 0:
        cost_eff = 0.0
    elif c_ref <= 0:
        cost_eff = 100.0
    else:
        cost_eff = 100.0 * min(1.0, c_ref / cost_per)
    efficiency = float(np.mean([min(goodput_share, 100.0), cost_eff]))
    pillars = np.array([quality, coverage, efficiency])
    composite = float(np.exp(np.mean(np.log(np.maximum(pillars, 1e-12))))) if np.all(pillars > 0) else 0.0

    return Metrics(
        online_admission_pct=online_adm,
        batch_admission_pct=batch_adm,
        batch_progress_pct=progress,
        deadline_attainment_pct=deadline_att,
        ttft_attainment_pct=ttft_att,
        tpot_attainment_pct=tpot_att,
        p99_windows_pct=_pct(win_met, win_n),
        goodput_tok_s=goodput,
        cost_per_slo_token=cost_per,
        fleet_cost_usd=inp.fleet_cost_usd,
        slo_tokens=slo_tokens,
        demanded_tokens=demanded,
        swaps=sum(t.swaps for t in inp.trace),
        keeps=sum(t.keeps for t in inp.trace),
        quality=quality,
        coverage=coverage,
        efficiency=efficiency,
        composite=composite,
        online_requests=n_online,
        batch_requests=b_total,
    )


def window_attainment(jobs: Sequence[Job], records: np.ndarray, n_ticks: int, tick_s: float, horizon_s: float,
                      grace_s: float = GRACE_S) -> list[tuple[float | None, float | None]]:
    """(TTFT %, TPOT %) of the online requests arriving in each tick's interval (the formulas above; the
    figures' SLO attainment over time)."""
    online = np.array([j.job_class is JobClass.ONLINE for j in jobs], dtype=bool)
    rec = records[online[records["job"].astype(np.int64)]] if len(records) else records
    slot = np.floor(rec["arrival"] / tick_s).astype(np.int64) if len(rec) else np.zeros(0, np.int64)
    order = np.argsort(slot, kind="stable")
    rec, slot = rec[order], slot[order]
    bounds = np.searchsorted(slot, np.arange(n_ticks + 1))
    out: list[tuple[float | None, float | None]] = []
    for n in range(n_ticks):
        part = rec[bounds[n]: bounds[n + 1]]
        m = evaluate(EvalInputs(jobs=list(jobs), records=part, horizon_s=horizon_s, fleet_cost_usd=0.0,
                                reserved_cost_usd=0.0, grace_s=grace_s, window_s=tick_s))
        out.append((None, None) if m.online_requests == 0 else (m.ttft_attainment_pct, m.tpot_attainment_pct))
    return out


def aggregate(runs: Sequence[Metrics]) -> dict[str, tuple[float, float]]:
    """Mean and sample std of every metric over seeds (std 0 for one run)."""
    if not runs:
        return {}
    out: dict[str, tuple[float, float]] = {}
    for name in Metrics.model_fields:
        xs = np.array([float(getattr(r, name)) for r in runs])
        finite = xs[np.isfinite(xs)]
        if len(finite) == 0:
            out[name] = (math.inf, 0.0)
            continue
        out[name] = (float(finite.mean()), float(finite.std(ddof=1)) if len(finite) > 1 else 0.0)
    return out
