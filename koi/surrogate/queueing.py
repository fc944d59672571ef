"""Latency under load: a steady-state model of one continuous-batching replica.

Overview §2.3 asks the surrogate for p99 TTFT/TPOT "at the job's arrival rate",
not the zero-load step time. Everything here is vectorised over n candidate
replicas (numpy arrays of shape ``(n,)``; iteration tables of shape ``(rows, K)`` on a
shared batch grid, shared by entries through ``rows``), so the planner can score
thousands of chains at once.

The model (a careful reading of how vLLM/SGLang schedule, in closed form):

1. **Decode population as a birth–death process.** With N sequences decoding, one
   engine iteration takes ``T(N) = T_dec(N) / (1 − λ·isl·c_pf(N))`` — the decode-only
   iteration plus the prompt chunks that arrive meanwhile (λ·isl prompt tokens per
   second, ``c_pf`` marginal seconds each, chunked into the same iterations). Every
   sequence needs ``n_dec = osl − 1`` iterations, so sequences leave at rate
   ``μ(N) = N / (n_dec · T(N))``: a processor-sharing system with state-dependent
   speed. Arrivals are Poisson at λ (renewal with CV ``ca`` otherwise), so N is a
   birth–death chain with stationary law ``π(N) ∝ Π_{k≤N} λ/μ(k)`` — insensitive to
   the output-length distribution, as processor sharing is. For ``ca ≠ 1`` the log
   ratios are scaled by ``2/(ca² + 1)`` (the diffusion approximation's variance
   factor). The product is integrated in log space on the batch grid (log-linear
   within segments). This captures what a deterministic fixed point misses: near
   saturation ``μ(N)`` flattens, and the batch (hence TPOT) wanders far above the
   fixed point — the simulator and real engines both show it.
2. **Admission queue.** The engine runs at most ``B_cap`` sequences (max_num_seqs, or
   the KV blocks for ``isl + osl/2`` tokens each). Beyond it requests wait, served at
   ``μ(B_cap)``: the chain continues as a geometric tail. Saturation is
   ``λ_sat = μ(B_cap)`` (also bounded by the prompt token budget); ``ρ = λ/λ_sat``.
3. **Means by Little's law.** Live batch ``E[N]``; mean TPOT ``E[N]/(λ·n_dec)``;
   admission wait ``E[Q]/λ``. The queue depth reported is Little's law over the whole wait
   before a request's prefill starts (admission slot, prompt budget, the iteration in
   flight, overload): ``λ_served · wait_mean`` — requests the engine holds but has not
   admitted, the quantity the simulator's telemetry (and vLLM's waiting queue) counts.
   The stationary law itself is returned (:attr:`LoadResult.atoms` / ``weights``), so
   time averages of any function of the running batch — the pipeline bubble, the
   collective share — are taken over it, not at its mean.
4. **TTFT** = admission wait + the prompt-budget wait (G/G/1 by Kingman, with the
   arrival CV and the prompt-length CV) + the residual of the iteration in flight +
   the prompt's service ``S = ceil(isl/chunk) · T + isl · c_pf``; its tail adds the
   prompts co-scheduled in the same iterations: the p99 count q of the arrival stream within
   the prefill seen from an arrival (:func:`renewal_count_q99`; Poisson(λ·S) for Poisson
   arrivals, clustered for bursty ones), each costing ``δ = isl · c_pf`` plus its share
   ``isl/chunk`` of the iterations the cluster needs (each carrying the decode batch). The cluster's own work widens
   the window others join it in: q is recounted once over ``S + q·δ``. Choice: one step, not
   the fixed point — the first generation of joiners delays the request; later ones mostly
   arrive behind it. On ``koi surrogate eval --part arrivals`` (240 deployments: constant,
   Poisson, gamma CV 1.5/2/3 on 1, 2, 4 replicas) the median |log(predicted/observed)| of
   p99 TTFT is 0.11 with one step (0.24 with none, 0.19 with two, 0.27 with three), against
   0.38 with Poisson counts and no thinning (chosen there); on the held-out Poisson grid of
   ``--part sim`` the median p99 TTFT error before learning fell from 34.5% to 18.6%.
   The waits and the cluster read the arrival CV one engine sees (``ca_engine``: the caller
   thins the job's to ``ca·√p`` for an engine taking a share p of a round-robin gateway,
   :func:`koi.surrogate.core._thinning`). Choice: the decoding population (1.) and the TPOT
   tail (5.) keep the job's CV. Thinned there too, the arrival grid's p99 TPOT at 4 replicas
   became exact (Poisson 1.10 → 1.01) but the planner, sizing on it, under-provisioned the
   decode-heavy jobs (hetero-3h seeds 0–2: Koi 87.64 against 88.81; agent-235b's TPOT
   attainment 94.7% → 86.6%): the burst factor left there is a margin the planner's TPOT
   sizing was tuned with (koi.surrogate.capacity_mixin), not a finding about the physics.
5. **Tails.** Each wait has an atom at 0 and an exponential tail
   (``P(W > t) = P_w · exp(−t · P_w / E[W])``); the p99 of a sum of independent
   terms is the sum of means plus the root-sum-square of the terms' p99 excesses.
   p99 TPOT: a request's TPOT is the iteration time averaged over its own lifetime
   ``L = n_dec·T``. N moves like an Ornstein–Uhlenbeck process around its mean with
   variance ``Var_π(N)`` and correlation time ``τ = 1/μ'(N)``; the lifetime average has
   variance ``Var·(2τ/L)·[1 − (τ/L)(1 − e^{−L/τ})]``; the p99 request sees
   ``T(E[N] + z₉₉·sd)``, plus the prompt interference of its own lifetime (compound
   Poisson, prompt-length CV, for a short request: n at the 5th percentile of osl).
6. **Overload.** If λ ≥ λ_sat the queue grows without bound. So that the numbers
   stay finite and monotone, we report what happens over one planning tick
   (``OVERLOAD_HORIZON_S`` = 300 s, Appendix B's tick): served rate λ_sat, a
   request at the end of the window waits ``(λ/λ_sat − 1) · H``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

Z99 = 2.3263478740408408
OVERLOAD_HORIZON_S = 300.0
#: ρ at which the heavy-traffic formulas are evaluated when the replica is overloaded.
RHO_CLIP = 0.995
#: Refinements of the co-scheduled prompts' window (module docstring, 4.).
CO_FIXED_POINT_STEPS = 1


@dataclass(frozen=True, slots=True)
class LoadInputs:
    """Per-candidate inputs of the queueing model (arrays broadcast to ``(n,)``; times in seconds)."""

    lam: np.ndarray  # offered requests/s per engine
    isl: np.ndarray  # mean prompt tokens that must be computed (after prefix-cache hits)
    isl_p99: np.ndarray  # p99 prompt tokens (computed part)
    isl_cv: np.ndarray  # CV of prompt length
    osl: np.ndarray  # mean output tokens
    osl_p05: np.ndarray  # 5th-percentile output tokens
    osl_cv: np.ndarray  # CV of output length
    ca: np.ndarray  # CV of inter-arrival times (1 Poisson)
    b_grid: np.ndarray  # (K,) shared batch grid, increasing, b_grid[0] == 1
    t_dec: np.ndarray  # (rows, K) decode-only iteration time at each batch on b_grid
    c_pf: np.ndarray  # (rows, K) marginal seconds per prompt token (mean prompt) riding with each batch
    c_pf_p99: np.ndarray  # (rows, K) the same at the p99 prompt length
    b_cap: np.ndarray  # maximum running sequences (max_num_seqs, KV limit)
    budget: np.ndarray  # token budget of one iteration (max_num_batched_tokens)
    chunked: np.ndarray  # bool: chunked prefill enabled
    rows: np.ndarray | None = None  # table row of each entry (tiled entries share tables); default i
    ca_engine: np.ndarray | None = None  # CV one engine sees behind the gateway (the TTFT terms); default ca


@dataclass(frozen=True, slots=True)
class LoadResult:
    """Steady-state figures per candidate (seconds, requests, req/s)."""

    lam_served: np.ndarray
    lam_sat: np.ndarray
    rho: np.ndarray
    batch: np.ndarray  # mean sequences decoding (live_batch_size)
    batch_seen: np.ndarray
    t_step: np.ndarray  # mean iteration time = mean TPOT
    ttft_mean: np.ndarray
    ttft_p99: np.ndarray
    tpot_p99: np.ndarray
    wait_mean: np.ndarray
    queue_depth: np.ndarray
    prefill_share: np.ndarray  # share of iteration time spent on prompt tokens
    saturated: np.ndarray  # bool
    batch_sd: np.ndarray  # standard deviation of the decoding population
    prefill_s: np.ndarray  # mean prefill service of one prompt (seconds in the PREFILL state)
    atoms: np.ndarray  # (n, A) decoding-population values: 0, 1, each grid segment's mean, B_cap
    weights: np.ndarray  # (n, A) their time-stationary probabilities (rows sum to 1)

    def expect(self, f: np.ndarray) -> np.ndarray:
        """Time average ``Σ_a weights·f`` of a function already evaluated at :attr:`atoms` (shape (n, A))."""
        return np.sum(self.weights * f, axis=1)


def interp_rows_many(b_grid: np.ndarray, tables: tuple[np.ndarray, ...], b: np.ndarray,
                     rows: np.ndarray | None = None) -> list[np.ndarray]:
    """Row-wise piecewise-linear interpolation of each ``table[rows[i]]`` at ``b[i]`` (clamped to the grid).

    Several tables at the same points: the segment and weight are found once (the solver reads the
    decode and prompt tables at the same batch sizes)."""
    b = np.minimum(np.maximum(b, b_grid[0]), b_grid[-1])
    j = np.minimum(np.searchsorted(b_grid, b, side="right") - 1, len(b_grid) - 2)
    lo, hi = b_grid[j], b_grid[j + 1]
    w = (b - lo) / (hi - lo)
    r = np.arange(len(b)) if rows is None else rows
    j1, w1 = j + 1, 1.0 - w
    return [t[r, j] * w1 + t[r, j1] * w for t in tables]


#: Gamma shape above which a renewal stream is treated as clockwork (CV ≤ 0.01).
_K_MAX = 1e4


def renewal_count_q99(m: np.ndarray, ca: np.ndarray) -> np.ndarray:
    """99th percentile of the arrivals within a window of ``m`` mean arrivals after an arrival.

    A gamma renewal stream (shape ``K = 1/ca²``, the simulator's and a common model of bursty
    traffic) seen from one of its own arrivals (Palm): the n-th next arrival comes after a sum
    of n gamma gaps, so ``P(N ≥ n) = P(Γ(nK, 1) ≤ m·K)`` — the regularized ``gammainc(nK, mK)``.
    ``ca = 1`` is the Poisson tail exactly; ``ca → 0`` tends to ``floor(m)`` (clockwork); a
    bursty stream (``ca > 1``) clusters, and its p99 grows far beyond Poisson(m)'s. The quantile
    is the smallest n with ``P(N ≥ n + 1) ≤ 1%``, found by integer bisection (vectorised;
    ``gammainc`` is decreasing in its first argument), plus a fraction that makes it continuous
    in m (the integer quantile where it steps, less than one above it between)."""
    from scipy.special import gammainc

    m = np.maximum(np.asarray(m, dtype=float), 0.0)
    k = np.minimum(1.0 / np.maximum(np.asarray(ca, dtype=float), 1e-9) ** 2, _K_MAX)
    m, k = np.broadcast_arrays(m, k)
    x = m * k

    def tail(n: np.ndarray) -> np.ndarray:  # P(N ≥ n), n ≥ 1
        return gammainc(np.maximum(n, 1.0) * k, x)

    hi = np.maximum(np.ceil(2.0 * m), 1.0)
    for _ in range(40):  # grow hi until P(N ≥ hi + 1) ≤ 1%
        grow = (tail(hi + 1.0) > 0.01) & (hi < 1e6)
        if not grow.any():
            break
        hi = np.where(grow, 2.0 * hi, hi)
    lo = np.full_like(hi, -1.0)  # invariant: P(N ≥ lo + 1) > 1% (lo = −1: P(N ≥ 0) = 1)
    while np.any(open_ := hi - lo > 1.0):
        mid = np.floor(0.5 * (lo + hi))
        ok = tail(mid + 1.0) <= 0.01
        hi, lo = np.where(open_ & ok, mid, hi), np.where(open_ & ~ok, mid, lo)
    # continuous: the planner's bisections and the residual learner's speed inversion need latency
    # to move smoothly with load and speed. The next count's tail P(N ≥ n + 1) ramps q from n to
    # n + 1 as m grows between the points where the quantile steps: from r·1% (r the ratio of the
    # next tail to this one, where P(N ≥ n) is 1%) to 1% (where the quantile steps to n + 1).
    t1 = tail(hi + 1.0)
    r = np.clip(t1 / np.maximum(np.where(hi >= 1.0, tail(hi), 1.0), 1e-300), 0.0, 0.999)
    frac = np.clip((t1 / 0.01 - r) / (1.0 - r), 0.0, 1.0)
    return np.where(m > 0, hi + frac, 0.0)


def _exp_tail_q99(mean_wait: np.ndarray, p_wait: np.ndarray) -> np.ndarray:
    """p99 of a wait with an atom at 0 and an exponential tail: 0 when P(wait) ≤ 1%."""
    p = np.clip(p_wait, 1e-9, 1.0)
    cond_mean = mean_wait / p
    return np.where(p > 0.01, cond_mean * np.log(p / 0.01), 0.0)


def kingman_wait(rho: np.ndarray, ca: np.ndarray, cs: np.ndarray, service: np.ndarray) -> np.ndarray:
    """G/G/1 mean wait (Kingman): ρ/(1-ρ) · (ca² + cs²)/2 · E[S]."""
    r = np.clip(rho, 0.0, RHO_CLIP)
    return r / (1.0 - r) * 0.5 * (ca**2 + cs**2) * service


def _log_geom_sum(w: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """log Σ_{i=1}^{w} e^{i·δ} (w ≥ 1 states, per-state log increment δ), stable for any δ."""
    ad = np.abs(delta)
    small = ad * np.maximum(w, 1.0) < 1e-8
    a = np.where(small, 1.0, ad)
    num = -np.expm1(-np.maximum(w, 1.0) * a)  # 1 − e^{−w|δ|}
    den = -np.expm1(-a)  # 1 − e^{−|δ|}
    big = np.where(delta > 0, np.maximum(w, 1.0) * a, -a)  # the largest term: i = w (δ > 0) or i = 1 (δ < 0)
    return np.where(small, np.log(np.maximum(w, 1.0)) + delta * (w + 1) / 2, big + np.log(num / den))


def _geom_mean_index(w: np.ndarray, delta: np.ndarray) -> np.ndarray:
    """Mean of i ∈ {1..w} under weights e^{i·δ}."""
    w = np.maximum(w, 1.0)
    small = np.abs(delta) * w < 1e-6
    q = np.exp(-np.abs(np.where(small, 1.0, delta)))  # < 1
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        m = 1.0 / (1.0 - q) - w * q**w / (1.0 - q**w)  # mean for weights q^i (decreasing)
    m = np.where(np.isfinite(m), m, 1.0)
    m = np.where(delta > 0, w + 1.0 - m, m)
    return np.where(small, (w + 1.0) / 2.0, np.clip(m, 1.0, w))


def _population(lam, ndec, t_tab, c_tab, isl, b_grid, b_cap, ca):  # noqa: ANN001, ANN202
    """Moments of the decoding population N under the birth–death law (see the module docstring)."""
    K = len(b_grid)
    x = np.minimum(b_grid[None, :], b_cap[:, None])  # grid clipped at B_cap (zero-width segments beyond)
    denom = 1.0 - lam[:, None] * isl[:, None] * c_tab
    T = np.where(denom > 1e-3, t_tab / np.maximum(denom, 1e-3), np.inf)
    # T at B_cap for the clipped points (linear interpolation on the grid)
    j = np.minimum(np.searchsorted(b_grid, b_cap, side="right") - 1, K - 2)
    lo, hi = b_grid[j], b_grid[j + 1]
    w = np.clip((b_cap - lo) / (hi - lo), 0.0, 1.0)
    r_ = np.arange(len(b_cap))
    t_lo, t_hi = T[r_, j], T[r_, j + 1]
    with np.errstate(invalid="ignore"):  # inf·0 where a segment end is unstable; the ends are taken whole below
        t_mid = t_lo * (1 - w) + t_hi * w
    # B_cap on a grid point takes that point's T: with the next point unstable (T = ∞) the blend gave ∞·0 = NaN,
    # and a NaN population (E[N], P(wait), …) for a replica whose max_num_seqs sits on the grid (e.g. 256)
    t_cap = np.where(w <= 0.0, t_lo, np.where(w >= 1.0, t_hi, t_mid))
    T = np.where(b_grid[None, :] > b_cap[:, None], t_cap[:, None], T)
    mu = x / (ndec[:, None] * T)
    scale = 2.0 / (ca**2 + 1.0)
    r = np.log(np.maximum(lam[:, None], 1e-300) / np.maximum(mu, 1e-300)) * scale[:, None]
    # log π at the grid points (π(0) = 1): L(1) = r(1), then L(k) = L(k-1) + r(k)
    seg_w = np.diff(x, axis=1)
    # Σ_{j=x_{k-1}+1}^{x_k} r(j) with r linear between grid points (exact for unit segments)
    inc = seg_w * r[:, :-1] + (r[:, 1:] - r[:, :-1]) * (seg_w + 1.0) / 2.0
    inc = np.where(seg_w > 0, inc, 0.0)
    L = np.concatenate([r[:, :1], r[:, :1] + np.cumsum(inc, axis=1)], axis=1)
    dL = L[:, 1:] - L[:, :-1]
    # the integer states x_{k-1}+1 … x_k of each segment, log π linear across them (step δ)
    delta = np.where(seg_w > 0, dL / np.maximum(seg_w, 1.0), 0.0)
    log_seg = np.where(seg_w > 0, L[:, :-1] + _log_geom_sum(seg_w, delta), -np.inf)
    mean_seg = x[:, :-1] + np.where(seg_w > 0, _geom_mean_index(seg_w, delta), 0.0)
    # geometric tail beyond B_cap (the admission queue): ratio λ/μ(B_cap)
    mu_cap = b_cap / (ndec * t_cap)
    rho_c = np.minimum(lam / np.maximum(mu_cap, 1e-300), 1.0 - 1e-9)
    L_cap = L[:, -1]
    log_q = L_cap + np.log(rho_c) - np.log1p(-rho_c)  # Σ_{j≥1} π(cap)·ρ^j
    terms = np.concatenate([np.zeros((len(lam), 1)), L[:, :1], log_seg, log_q[:, None]], axis=1)
    m = np.max(terms, axis=1, keepdims=True)
    wts = np.exp(terms - m)
    Z = wts.sum(axis=1)
    p0, p1, pseg, pq = wts[:, 0] / Z, wts[:, 1] / Z, wts[:, 2:-1] / Z[:, None], wts[:, -1] / Z
    e_n = p1 * 1.0 + np.sum(pseg * mean_seg, axis=1) + pq * b_cap
    e_n2 = p1 + np.sum(pseg * (mean_seg**2 + (seg_w**2 - 1.0) / 12.0), axis=1) + pq * b_cap**2
    var_n = np.maximum(e_n2 - e_n**2, 0.0)
    e_q = pq / np.maximum(1.0 - rho_c, 1e-12)  # E[Q] = π(cap)·ρ/(1-ρ)² = P(queue>0)/(1-ρ)
    p_cap = np.exp(L_cap - m[:, 0]) / Z + pq  # P(all slots busy) = P(wait)
    # the law on atoms: 0, 1, each segment's mean state, B_cap (with the admission queue's mass)
    atoms = np.concatenate([np.zeros((len(lam), 1)), np.ones((len(lam), 1)), mean_seg, b_cap[:, None]], axis=1)
    weights = np.concatenate([p0[:, None], p1[:, None], pseg, pq[:, None]], axis=1)
    return e_n, var_n, e_q, p_cap, p0, mu_cap, atoms, weights


def solve(inp: LoadInputs) -> LoadResult:
    """Solve the steady state of every candidate at its offered load (see the module docstring)."""
    lam = np.asarray(inp.lam, dtype=float)
    n = lam.shape[0]
    ndec = np.maximum(inp.osl - 1.0, 1.0)
    b_cap = np.maximum(inp.b_cap, 1.0)
    rows = np.arange(n) if inp.rows is None else inp.rows
    bg = inp.b_grid

    # Chunk available to prompts in an iteration: the budget minus one token per decoding sequence.
    # Without chunked prefill a prompt is computed whole in one iteration (chunk = its length).
    def chunk_at(bseen: np.ndarray, isl: np.ndarray) -> np.ndarray:
        ch = np.maximum(inp.budget - bseen, 0.25 * inp.budget)
        return np.where(inp.chunked, ch, np.maximum(isl, 1.0))

    # ---- saturation: μ(B_cap) with the prompt load of λ itself: λ = B/(n·t + B·isl·c) -----------------
    t_cap, c_cap = interp_rows_many(bg, (inp.t_dec, inp.c_pf), b_cap, rows)
    lam_sat_dec = b_cap / (ndec * t_cap + b_cap * inp.isl * c_cap)
    t_step_cap = t_cap / np.maximum(1.0 - lam_sat_dec * inp.isl * c_cap, 1e-6)
    lam_sat_budget = np.where(inp.chunked, chunk_at(b_cap, inp.isl) / np.maximum(inp.isl * t_step_cap, 1e-12), np.inf)
    lam_sat = np.minimum(lam_sat_dec, lam_sat_budget)
    saturated = lam >= lam_sat * (1.0 - 1e-9)  # at saturation (a backlog) counts: the engine runs full
    lam_s = np.minimum(lam, lam_sat * (1.0 - 1e-6))

    # ---- the decoding population ---------------------------------------------------------------------
    e_n, var_n, e_q, p_cap, p0, _, atoms, weights = _population(
        np.maximum(lam_s, 1e-12), ndec, inp.t_dec[rows], inp.c_pf[rows], inp.isl, bg, b_cap, inp.ca
    )
    batch = np.where(saturated, b_cap, e_n)
    # iteration time at the mean population (what a sequence rides with)
    b_at = np.clip(batch, 1.0, b_cap)
    t_dec_b, c_b, c99_b = interp_rows_many(bg, (inp.t_dec, inp.c_pf, inp.c_pf_p99), b_at, rows)
    pf_time = inp.isl * c_b
    t_iter = t_dec_b / np.maximum(1.0 - lam_s * pf_time, 1e-6)
    # mean TPOT by Little's law over the decode loop (≥ one iteration at the mean batch)
    t_step = np.where(saturated, t_iter, np.maximum(batch / np.maximum(lam_s * ndec, 1e-12), t_dec_b))
    prefill_share = np.clip(1.0 - t_dec_b / t_iter, 0.0, 1.0)

    # ---- prefill service of one prompt -------------------------------------------------------------
    chunk = chunk_at(b_at, inp.isl)
    n_chunks = np.maximum(np.ceil(inp.isl / chunk), 1.0)
    # Each iteration a prompt rides in carries the decode batch and, on average, the other prompts'
    # chunks (T), plus its own tokens; the first token leaves with the last chunk.
    s_mean = n_chunks * t_iter + inp.isl * c_b
    chunk99 = chunk_at(b_at, inp.isl_p99)
    s_p99 = np.maximum(np.ceil(inp.isl_p99 / chunk99), 1.0) * t_iter + inp.isl_p99 * c99_b

    # ---- waits -----------------------------------------------------------------------------------------
    rho = lam / lam_sat
    w_slot = np.where(saturated, 0.0, e_q / np.maximum(lam_s, 1e-12))
    p_slot = np.where(saturated, 1.0, p_cap)
    s_budget = np.where(inp.chunked, inp.isl / chunk * t_iter, s_mean)
    rho_pf = np.clip(lam_s * s_budget, 0.0, RHO_CLIP)
    ca_e = inp.ca if inp.ca_engine is None else inp.ca_engine
    w_pf = kingman_wait(rho_pf, ca_e, inp.isl_cv, s_budget)
    over = np.maximum(lam / lam_sat - 1.0, 0.0)
    # at saturation the admission queue of one horizon; just below it the heavy-traffic wait
    w_sat = np.where(saturated, kingman_wait(np.full(n, RHO_CLIP), ca_e, inp.osl_cv, 1.0 / lam_sat), 0.0)
    w_over_mean = 0.5 * over * OVERLOAD_HORIZON_S + w_sat
    w_over_p99 = 0.99 * over * OVERLOAD_HORIZON_S + w_sat * math.log(100.0)
    busy = 1.0 - np.where(saturated, 0.0, p0)  # P(engine busy) = P(N > 0)
    w_iter = 0.5 * t_iter * busy
    wait_mean = w_slot + w_pf + w_over_mean + w_iter
    ttft_mean = wait_mean + s_mean
    ex_slot = _exp_tail_q99(w_slot, p_slot) - w_slot
    ex_pf = _exp_tail_q99(w_pf, rho_pf) - w_pf
    ex_s = np.maximum(s_p99 - s_mean, 0.0)
    ex_over = w_over_p99 - w_over_mean
    # prompts co-scheduled in the same iterations (arrived during the one in flight) lengthen them:
    # their count is that of the arrival stream within the prefill (Poisson(λ·T) for Poisson
    # arrivals, clustered for bursty ones), each costing δ (its spread from the length CV): its
    # tokens' compute plus its share of the iterations (isl/chunk of one, each carrying the decode
    # batch). A cluster's own work lengthens the window others join it in: the count is retaken
    # over T₀ + q·δ, CO_FIXED_POINT_STEPS times (module docstring, 4.).
    delta = pf_time + np.where(inp.chunked, inp.isl / chunk * t_dec_b, 0.0)
    win0 = t_iter * n_chunks
    q_co = renewal_count_q99(lam_s * win0, ca_e)
    for _ in range(CO_FIXED_POINT_STEPS):
        q_co = renewal_count_q99(lam_s * (win0 + q_co * delta), ca_e)
    co = lam_s * win0
    ex_co = np.maximum(q_co - co, 0.0) * np.sqrt(1.0 + inp.isl_cv**2) * delta
    ttft_p99 = ttft_mean + np.sqrt(
        np.maximum(ex_slot, 0) ** 2 + np.maximum(ex_pf, 0) ** 2 + ex_s**2 + ex_over**2 + (0.49 * t_iter * busy) ** 2
        + ex_co**2
    )

    # ---- p99 TPOT ------------------------------------------------------------------------------------------
    # population wander averaged over the request's lifetime (OU approximation)
    sd = np.sqrt(var_n)
    b_hi = np.clip(b_at + np.maximum(sd, 1.0), 1.0, b_cap)
    t_dec_hi, c_hi = interp_rows_many(bg, (inp.t_dec, inp.c_pf), b_hi, rows)
    t_hi = t_dec_hi / np.maximum(1.0 - lam_s * inp.isl * c_hi, 1e-6)
    mu_at = b_at / (ndec * t_iter)
    mu_hi = b_hi / (ndec * t_hi)
    dmu = np.maximum((mu_hi - mu_at) / np.maximum(b_hi - b_at, 1e-9), 1e-9)
    tau = 1.0 / dmu
    life = ndec * t_step
    k = np.maximum(tau / np.maximum(life, 1e-12), 1e-9)
    avg_var = var_n * np.minimum(2.0 * k * (1.0 - k * (-np.expm1(-1.0 / k))), 1.0)
    b99 = np.clip(b_at + Z99 * np.sqrt(avg_var), 1.0, b_cap)
    t_dec_99, c_99 = interp_rows_many(bg, (inp.t_dec, inp.c_pf), b99, rows)
    t99 = t_dec_99 / np.maximum(1.0 - lam_s * inp.isl * c_99, 1e-6)
    t99 = np.maximum(t99 * t_step / np.maximum(t_iter, 1e-12), t_step)
    # prompt interference inside a short request's lifetime
    n_short = np.maximum(inp.osl_p05 - 1.0, 1.0)
    arrivals = lam_s * t_step * n_short
    var_x = arrivals * (pf_time**2) * (inp.isl_cv**2 + inp.ca**2)
    tpot_p99 = np.where(saturated, t_iter, t99) + Z99 * np.sqrt(var_x) / n_short

    # Little's law over the wait before the prefill starts (module docstring, 3.); overloaded: the
    # served rate times the wait of the horizon's mean request, i.e. the backlog (λ − λ_sat)·H/2 and more
    queue_depth = np.minimum(lam, lam_sat) * wait_mean
    # saturated: every slot busy, the whole law at B_cap
    at_cap = np.zeros_like(weights)
    at_cap[:, -1] = 1.0
    weights = np.where(saturated[:, None], at_cap, weights)
    return LoadResult(
        lam_served=np.minimum(lam, lam_sat),
        lam_sat=lam_sat,
        rho=rho,
        batch=batch,
        batch_seen=b_at,
        t_step=t_step,
        ttft_mean=ttft_mean,
        ttft_p99=ttft_p99,
        tpot_p99=tpot_p99,
        wait_mean=wait_mean,
        queue_depth=queue_depth,
        prefill_share=prefill_share,
        saturated=saturated,
        batch_sd=np.where(saturated, 0.0, sd),
        prefill_s=s_mean,
        atoms=atoms,
        weights=weights,
    )


def solve_closed_loop(inp: LoadInputs, concurrency: np.ndarray, iters: int = 40) -> LoadResult:
    """Closed loop: N clients, each sending its next request when the previous one finishes.

    Little's law over the whole request: ``N = λ · (TTFT_mean + n_dec · T_step)``; λ is
    found by bisection on (0, λ_sat) (the left side grows with λ). Arrivals of a closed
    loop are smoother than Poisson; we keep ``inp.ca`` as given (the caller chooses).
    """
    n_cli = np.asarray(concurrency, dtype=float)
    ndec = np.maximum(inp.osl - 1.0, 1.0)
    probe = solve(_with_lam(inp, np.full_like(n_cli, 1e-9)))
    lam_sat = probe.lam_sat
    lo = np.zeros_like(n_cli)
    hi = lam_sat * (1.0 - 1e-6)
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        r = solve(_with_lam(inp, mid))
        in_system = mid * (r.ttft_mean + ndec * r.t_step)
        below = in_system < n_cli
        lo = np.where(below, mid, lo)
        hi = np.where(below, hi, mid)
    return solve(_with_lam(inp, 0.5 * (lo + hi)))


def _with_lam(inp: LoadInputs, lam: np.ndarray) -> LoadInputs:
    return LoadInputs(**{**{f: getattr(inp, f) for f in inp.__dataclass_fields__}, "lam": lam})
