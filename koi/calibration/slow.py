"""The slow loop: regret, β, B, λ, ε, z*, w and the CUSUM meta recalibration.

Whitepaper "The Slow Loop" and Appendix A; overview §2.5. One pure step per tick,
``slow_t = slow_update(slow_{t−1}, inputs_t)``, driven by the Q1 rate of the tick's
evidence, the observed swap rate, the DRO band coverage and the observed outcomes.

Formulas (Appendix A):
  q_t      fraction of decided evidence–mechanism pairs in Q1 over the last W_q1 ticks
  s_t      (1/W_regret) Σ_k max(0, q* − q_k), q* = 1
  β_{t+1}  clip(β_t · exp(η_β (s_t − s*)), β_min, β_max)
  B_t      B_max if s_t > s* else B_min                     (a step gate)
  λ_{t+1}  clip(λ_t · exp(η_λ (ρ_t − ρ*)), λ_min, λ_max)    ρ_t = swapped / active jobs
  ε_{t+1}  ε(1+η_ε) if κ_t < κ* − d; ε(1−η_ε) if κ_t > κ* + d; else ε
  z*_j     max_H y_j + Δ_j (maximised), min_H y_j − Δ_j (minimised), ratcheted
  w_{t+1}  ∝ w_t · exp(η_w ∇R2), anchored to the class prior (see update_weights)

Choices where the spec is vague (and why):
- No decided pair in the W_q1 window: q_t keeps its last value (0 at cold start, so a
  cluster with no validated evidence explores); s_t averages the q_k available when
  fewer than W_regret ticks exist.
- B is the spec's plain step gate: s_t is already a 20-tick rolling mean of a 20-tick
  rolling rate, smooth enough not to chatter around s*.
- No swap observation (no active job) leaves λ unchanged; no coverage observation
  leaves ε unchanged.
- z* **ratchets**: it only ever moves toward better values. It is the utopia point of the
  Tchebycheff scalarisation, which must dominate every achievable outcome; after a
  regression (an engine update) an unreachable z* is still a valid reference, while
  a z* that fell back would reward the regression. It is kept per job class and per job.
- Meta recalibration of CUSUM (every N ticks): a stream is *in control* when its mean
  residual lies within the slack δ (the detector should not fire on it); an alarm on an
  in-control stream is a false alarm. Streams whose mechanisms landed in Q1 would be the
  spec-like choice, but Q1 already means "no alarm", so their false-alarm rate is 0 by
  construction. h_k rises ×1.1 when the false-alarm rate exceeds twice the 5% target
  and falls ×0.95 below half of it, within [3σ, 8σ]; δ_k stays 0.5σ.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from functools import cache
from itertools import combinations

import numpy as np
from pydantic import Field

from koi import variables
from koi.calibration.state import (
    CoveragePoint,
    KnobPoint,
    MetaCounts,
    QPoint,
    SlowConfig,
    SlowState,
    SwapPoint,
)
from koi.domain.common import JobClass, KoiModel
from koi.domain.job import BATCH_WEIGHTS, ONLINE_WEIGHTS
from koi.domain.telemetry import EvidenceRow, Quadrant, Verdict
from koi.evidence.cusum import CusumEntry, CusumTable
from koi.logging import get_logger

log = get_logger(__name__)

OBJ = variables.OBJECTIVES

#: Absolute floor of the z* slack per objective (same units as the objective).
Z_SLACK_FLOOR: dict[str, float] = {
    "cost_per_token": 1e-10,
    "p99_ttft_ms": 1.0,
    "p99_tpot_ms": 0.1,
    "throughput_tokens_per_sec": 1.0,
    "slo_margin": 0.01,
}
#: Objectives that cannot be negative (a minimised z* is clamped at 0).
NON_NEGATIVE = frozenset({"cost_per_token", "p99_ttft_ms", "p99_tpot_ms", "throughput_tokens_per_sec"})


class OutcomeObservation(KoiModel):
    """One observed outcome vector (a PerfDB record of a job's rank or ladder at a tick)."""

    tick: int
    job_id: str
    job_class: JobClass
    values: dict[str, float] = Field(description="objective name (koi.variables.OBJECTIVES) → observed value")


class SlowInputs(KoiModel):
    tick: int = Field(ge=0)
    evidence: list[EvidenceRow] = Field(default_factory=list, description="this tick's evidence rows")
    outcomes: list[OutcomeObservation] = Field(default_factory=list, description="recent outcomes (any window)")
    swaps: SwapPoint | None = None
    coverage: CoveragePoint | None = None


def class_prior(job_class: JobClass | str) -> dict[str, float]:
    w = ONLINE_WEIGHTS if JobClass(job_class) is JobClass.ONLINE else BATCH_WEIGHTS
    return dict(zip(OBJ, w.as_tuple(), strict=True))


def initial_slow_state(cluster_id: str, config: SlowConfig | None = None) -> SlowState:
    """Cold start: β_0, B_max (no evidence yet, so regret is maximal), λ_0, ε_0, class weights."""
    cfg = config or SlowConfig()
    return SlowState(
        cluster_id=cluster_id, tick=-1, beta=cfg.beta_0, swap_budget=cfg.b_max, lambda_swit=cfg.lambda_0,
        epsilon=cfg.epsilon_0, weights={c.value: class_prior(c) for c in JobClass}, cusum=CusumTable(),
    )


# ---- regret ------------------------------------------------------------------------------------------
def q_counts(rows: Iterable[EvidenceRow]) -> tuple[int, int]:
    """(decided evidence–mechanism pairs, of which in Q1)."""
    n = q1 = 0
    for r in rows:
        for me in r.mechanisms:
            n += 1
            q1 += me.quadrant is Quadrant.Q1
    return n, q1


def rolling_q(history: Sequence[QPoint], tick: int, n_decided: int, n_q1: int, window: int) -> float:
    pts = [p for p in history if tick - window < p.tick < tick]
    n = n_decided + sum(p.n_decided for p in pts)
    if n == 0:
        return history[-1].q if history else 0.0
    return (n_q1 + sum(p.n_q1 for p in pts)) / n


def regret_signal(qs: Sequence[float], q_star: float = 1.0) -> float:
    """s_t = mean over the window of max(0, q* − q_k)."""
    if not qs:
        return 1.0
    return float(np.mean([max(0.0, q_star - q) for q in qs]))


def update_beta(beta: float, s: float, cfg: SlowConfig) -> float:
    return float(np.clip(beta * math.exp(cfg.eta_beta * (s - cfg.s_star)), cfg.beta_min, cfg.beta_max))


def swap_budget(s: float, cfg: SlowConfig) -> int:
    return cfg.b_max if s > cfg.s_star else cfg.b_min


def update_lambda(lam: float, rho: float | None, cfg: SlowConfig) -> float:
    if rho is None:
        return lam
    return float(np.clip(lam * math.exp(cfg.eta_lambda * (rho - cfg.rho_star)), cfg.lambda_min, cfg.lambda_max))


def pooled_coverage(history: Sequence[CoveragePoint], tick: int, window: int) -> float | None:
    pts = [p for p in history if tick - window < p.tick <= tick]
    tot = sum(p.n_total for p in pts)
    return sum(p.n_inside for p in pts) / tot if tot else None


def update_epsilon(eps: float, coverage: float | None, cfg: SlowConfig) -> float:
    if coverage is None:
        return eps
    if coverage < cfg.coverage_target - cfg.coverage_deadband:
        eps = eps * (1.0 + cfg.eta_epsilon)
    elif coverage > cfg.coverage_target + cfg.coverage_deadband:
        eps = eps * (1.0 - cfg.eta_epsilon)
    return float(np.clip(eps, cfg.epsilon_min, cfg.epsilon_max))


# ---- ideal point ---------------------------------------------------------------------------------------
def _better(obj: str, a: float, b: float) -> float:
    return max(a, b) if variables.is_maximized(obj) else min(a, b)


def z_candidate(obj: str, values: Sequence[float], cfg: SlowConfig) -> float:
    """best ± Δ_j for one objective over a history of observed values."""
    if variables.is_maximized(obj):
        best = max(values)
        return best + max(cfg.z_slack_rel * abs(best), Z_SLACK_FLOOR.get(obj, 0.0))
    best = min(values)
    z = best - max(cfg.z_slack_rel * abs(best), Z_SLACK_FLOOR.get(obj, 0.0))
    return max(0.0, z) if obj in NON_NEGATIVE else z


def update_z_star(
    prev: Mapping[str, Mapping[str, float]], outcomes: Iterable[OutcomeObservation], cfg: SlowConfig
) -> tuple[dict[str, dict[str, float]], float]:
    """Ratcheted z* per 'class:<c>' and 'job:<id>', and the largest relative change of an existing entry."""
    groups: dict[str, dict[str, list[float]]] = {}
    for o in outcomes:
        for key in (f"class:{o.job_class.value}", f"job:{o.job_id}"):
            g = groups.setdefault(key, {})
            for obj, v in o.values.items():
                if obj in OBJ and math.isfinite(v):
                    g.setdefault(obj, []).append(float(v))
    new = {k: dict(v) for k, v in prev.items()}
    change = 0.0
    for key in sorted(groups):
        cur = new.setdefault(key, {})
        for obj in sorted(groups[key]):
            cand = z_candidate(obj, groups[key][obj], cfg)
            if obj in cur:
                old = cur[obj]
                cur[obj] = _better(obj, old, cand)
                denom = max(abs(old), Z_SLACK_FLOOR.get(obj, 1e-12))
                change = max(change, abs(cur[obj] - old) / denom)
            else:
                cur[obj] = cand
    return {k: dict(sorted(v.items())) for k, v in sorted(new.items())}, change


# ---- objective weights: R2 Pareto coverage -----------------------------------------------------------------
@cache
def simplex_lattice(m: int, h: int) -> np.ndarray:
    """Das–Dennis lattice: all weight vectors on the m-simplex with coordinates in {0, 1/h, …, 1}."""
    pts = []
    for bars in combinations(range(h + m - 1), m - 1):
        prev, coords = -1, []
        for b in bars:
            coords.append(b - prev - 1)
            prev = b
        coords.append(h + m - 1 - prev - 1)
        pts.append(np.array(coords, dtype=float) / h)
    return np.array(pts)


def normalised_gaps(points: np.ndarray, z_star: np.ndarray, maximize: np.ndarray,
                    abs_floor: np.ndarray | None = None) -> np.ndarray:
    """g_j(a) ≥ 0: distance of each point to z* per objective over range_j (whitepaper §Exploitation).

    range_j is the observed spread floored at 10% of |z*_j| (and an absolute floor, 0.05 for
    the SLO margin), as :mod:`koi.scoring.tchebycheff` normalises J, so the slow loop and the
    scorer measure gaps in the same units.
    """
    gaps = np.where(maximize, z_star - points, points - z_star)
    rng = points.max(axis=0) - points.min(axis=0)
    floor = np.maximum(np.abs(z_star) * 0.10, abs_floor if abs_floor is not None else 0.0)
    rng = np.maximum(rng, np.maximum(floor, 1e-12))
    return np.clip(gaps / rng, 0.0, None)


def r2_indicator(w: np.ndarray, gaps: np.ndarray, lattice: np.ndarray) -> float:
    """R2_w = mean_λ min_a max_j (λ_j w_j / Σ_k λ_k w_k) g_j(a).

    The R2 indicator (Brockhoff et al.) of the observed outcome set against z*, with the
    reference weights λ tilted by the current preference w. Lower is better coverage.
    Homogeneous of degree 0 in w, so its gradient is a pure tilt (Σ_j w_j ∂_j R2 = 0).
    """
    lw = lattice * w[None, :]
    lw = lw / np.maximum(lw.sum(axis=1, keepdims=True), 1e-300)
    # (λ, a, j) → max over j → min over a → mean over λ
    vals = np.max(lw[:, None, :] * gaps[None, :, :], axis=2)
    return float(np.mean(np.min(vals, axis=1)))


def r2_gradient(w: np.ndarray, gaps: np.ndarray, lattice: np.ndarray, step: float = 1e-4) -> np.ndarray:
    """∇_w R2 by central differences (five objectives: ten evaluations, cheap)."""
    g = np.zeros_like(w)
    for j in range(len(w)):
        e = np.zeros_like(w)
        e[j] = step
        g[j] = (r2_indicator(w + e, gaps, lattice) - r2_indicator(np.maximum(w - e, 1e-12), gaps, lattice)) / (2 * step)
    return g


def update_weights(
    w: Mapping[str, float],
    prior: Mapping[str, float],
    outcomes: Sequence[OutcomeObservation],
    z_star: Mapping[str, float],
    cfg: SlowConfig,
) -> dict[str, float]:
    """One entropic mirror-descent step on the R2 gradient, anchored to the class prior.

    log w' = (1 − τ)(log w + η_w ∇R2) + τ log w₀, then normalised onto the simplex with a
    floor. ∂_j R2 > 0 where the observed set is far from the ideal in objective j (poorly
    covered), so weight moves there and the planner is steered to cover that part of the
    front: over time w sweeps the front (Appendix A). Without the anchor τ a persistent
    gradient drives w to a vertex (all weight on one objective), which would overrule
    the operator's preference; with it w stays within a bounded tilt of w₀. Measured without
    it (τ = 0, the white paper's bare update) on hetero-3h × 3 seeds: composite 86.01 against
    86.00 — over 36 ticks the R2 gradient is too small for the anchor to matter either way.
    Objectives missing from some outcome or from z* get no gradient.
    """
    objs = [o for o in OBJ if o in z_star and all(o in x.values for x in outcomes)]
    wv = np.array([max(w.get(o, 0.0), cfg.w_floor) for o in OBJ])
    w0 = np.array([max(prior.get(o, 0.0), cfg.w_floor) for o in OBJ])
    grad = np.zeros(len(OBJ))
    if len(outcomes) >= 2 and len(objs) >= 2:
        idx = [OBJ.index(o) for o in objs]
        pts = np.array([[x.values[o] for o in objs] for x in outcomes])
        zs = np.array([z_star[o] for o in objs])
        mx = np.array([variables.is_maximized(o) for o in objs])
        gaps = normalised_gaps(pts, zs, mx, np.array([0.05 if o == "slo_margin" else 0.0 for o in objs]))
        lattice = simplex_lattice(len(objs), cfg.r2_lattice_h)
        sub = wv[idx] / wv[idx].sum()
        grad[idx] = r2_gradient(sub, gaps, lattice)
    logw = (1.0 - cfg.w_anchor) * (np.log(wv) + cfg.eta_w * grad) + cfg.w_anchor * np.log(w0)
    out = np.exp(logw - logw.max())
    out = out / out.sum()
    out = np.maximum(out, cfg.w_floor)
    out = out / out.sum()
    return {o: float(v) for o, v in zip(OBJ, out, strict=True)}


# ---- CUSUM meta recalibration --------------------------------------------------------------------------------
def count_false_alarms(rows: Iterable[EvidenceRow], counts: MetaCounts) -> MetaCounts:
    streams, alarms = dict(counts.streams), dict(counts.alarms)
    for r in rows:
        for c in r.cusum:
            if abs(c.residual_mean) <= c.delta:
                streams[c.variable] = streams.get(c.variable, 0) + 1
                if c.verdict is Verdict.DIVERGED:
                    alarms[c.variable] = alarms.get(c.variable, 0) + 1
    return MetaCounts(streams=dict(sorted(streams.items())), alarms=dict(sorted(alarms.items())))


def meta_recalibrate(table: CusumTable, counts: MetaCounts, cfg: SlowConfig) -> tuple[CusumTable, MetaCounts]:
    """Retune h_k per variable toward the false-alarm target; variables with too few streams keep counting."""
    entries = dict(table.entries)
    keep_s, keep_a = {}, {}
    for var, n in sorted(counts.streams.items()):
        if n < cfg.meta_min_streams:
            keep_s[var], keep_a[var] = n, counts.alarms.get(var, 0)
            continue
        far = counts.alarms.get(var, 0) / n
        e = entries.get(var, table.default)
        h = e.h_k
        if far > 2.0 * cfg.far_target:
            h *= cfg.h_up
        elif far < 0.5 * cfg.far_target:
            h *= cfg.h_down
        h = float(np.clip(h, cfg.h_k_min, cfg.h_k_max))
        entries[var] = CusumEntry(delta_k=e.delta_k, h_k=h)
    return (CusumTable(entries=dict(sorted(entries.items())), default=table.default),
            MetaCounts(streams=keep_s, alarms=keep_a))


# ---- the step ---------------------------------------------------------------------------------------------------
def _cap(items: list, cap: int) -> list:
    return items[-cap:] if len(items) > cap else items


def slow_update(prev: SlowState, inputs: SlowInputs, config: SlowConfig | None = None) -> SlowState:
    """slow_t = slow_update(slow_{t−1}, inputs_t). Pure; a tick at or before ``prev.tick`` is a no-op."""
    cfg = config or SlowConfig()
    t = inputs.tick
    if t <= prev.tick:
        return prev
    rows = [r for r in inputs.evidence if r.tick == t]
    n_dec, n_q1 = q_counts(rows)
    q = rolling_q(prev.q_history, t, n_dec, n_q1, cfg.w_q1)
    qs = [p.q for p in prev.q_history if t - cfg.w_regret < p.tick < t] + [q]
    s = regret_signal(qs, cfg.q_star)
    beta = update_beta(prev.beta, s, cfg)
    budget = swap_budget(s, cfg)
    rho = inputs.swaps.rate if inputs.swaps is not None and inputs.swaps.tick == t else None
    lam = update_lambda(prev.lambda_swit, rho, cfg)
    cov_hist = list(prev.coverage_history)
    if inputs.coverage is not None and inputs.coverage.tick == t and inputs.coverage.n_total > 0:
        cov_hist.append(inputs.coverage)
    kappa = pooled_coverage(cov_hist, t, cfg.coverage_window) if (
        inputs.coverage is not None and inputs.coverage.n_total > 0) else None
    eps = update_epsilon(prev.epsilon, kappa, cfg)
    outcomes = [o for o in inputs.outcomes if o.tick <= t]
    z_star, z_change = update_z_star(prev.z_star, outcomes, cfg)
    weights = dict(prev.weights)
    recent = [o for o in outcomes if t - cfg.w_window < o.tick <= t]
    for c in JobClass:
        mine = [o for o in recent if o.job_class is c]
        zc = z_star.get(f"class:{c.value}")
        if mine and zc:
            weights[c.value] = update_weights(weights.get(c.value, class_prior(c)), class_prior(c), mine, zc, cfg)
    meta = count_false_alarms(rows, prev.meta)
    table, last_meta = prev.cusum, prev.last_meta_tick
    if t - max(prev.last_meta_tick, 0) >= cfg.meta_every and t >= cfg.meta_every:
        table, meta = meta_recalibrate(prev.cusum, meta, cfg)
        last_meta = t
        if table != prev.cusum:
            log.info("slow.meta_recalibrated", cluster=prev.cluster_id, tick=t,
                     h={k: round(v.h_k, 3) for k, v in table.entries.items()})
    swaps = list(prev.swap_history)
    if inputs.swaps is not None and inputs.swaps.tick == t:
        swaps.append(inputs.swaps)
    state = SlowState(
        cluster_id=prev.cluster_id, tick=t, beta=beta, swap_budget=budget, lambda_swit=lam, epsilon=eps,
        z_star=z_star, weights=dict(sorted(weights.items())), cusum=table, meta=meta, last_meta_tick=last_meta,
        q_history=_cap([*prev.q_history, QPoint(tick=t, n_decided=n_dec, n_q1=n_q1, q=q, s=s)], cfg.history_cap),
        swap_history=_cap(swaps, cfg.history_cap),
        coverage_history=_cap(cov_hist, cfg.history_cap),
        knob_history=_cap([*prev.knob_history, KnobPoint(tick=t, beta=beta, swap_budget=budget, lambda_swit=lam,
                                                          epsilon=eps, z_star_change=z_change)], cfg.history_cap),
    )
    log.debug("slow.updated", cluster=prev.cluster_id, tick=t, q=round(q, 4), s=round(s, 4), beta=round(beta, 5),
             B=budget, lam=round(lam, 4), eps=round(eps, 4))
    return state
