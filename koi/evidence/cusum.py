"""Two-sided CUSUM on residual streams (whitepaper "CUSUM on Mediators and Outcomes"; overview §2.3).

S⁺_k = max(0, S⁺_{k−1} + r_k − δ), S⁻_k = min(0, S⁻_{k−1} + r_k + δ); DIVERGED when
S⁺ > h or S⁻ < −h anywhere in the window, else MATCHED. δ = k_δ σ, h = k_h σ with
(k_δ, k_h) = (0.5, 4) unless the slow loop's meta recalibration has retuned them
(:class:`CusumTable`).

Choices where the spec is vague (and why):
- **σ is a robust noise scale**, 1.4826 · MAD(Δr) / √2 over first differences of the
  residuals. Differencing removes a constant bias and all but one sample of a step, so
  a persistent bias or a drift does not inflate its own threshold and hide itself (an
  RMS around zero would), and the MAD ignores spikes.
- **σ history**: σ is the median of this window's estimate and the rank's last
  ``sigma_history`` windows (whitepaper: "σ from that variable's residual history");
  a new rank self-calibrates on its own window (the spec's cold-start fallback).
- **Long-run σ from the rank's past windows.** The sums accumulate *every* sample, so the
  σ that sets δ and h must be the residual stream's long-run σ (√ of n × the variance of a
  window's mean), not the sample-to-sample one. For a series of independent samples the two
  agree; for one that is an aggregate over a trailing window longer than the sampling
  interval — the p99 latencies over 120 s sampled every 15 s, cost per token over 120 s of
  throughput, the SLO margin built on them — consecutive samples share most of their
  requests, the first differences see one 15-s slice entering and one leaving (a windowed
  p99 mostly does not move at all: MAD 0), and the within-window σ̂ falls far below the
  noise the sums really carry. Measured on the oracle's predictions (the simulator's true
  performance, hetero-3h seed 0, median bias 0.3%), the within-window σ made p99 TTFT
  diverge in 78–81% of rank-windows, p99 TPOT and cost per token in 61–62%; with the
  long-run σ, on ranks with history, 16–28%, 17–26% and 24–35% (two oracle runs,
  ``benchmarks/cusum_false_alarms.py``). So, once the rank has ``min_levels`` past windows,
  σ is also at least √n × the robust spread of the rank's window-mean residuals (the same
  1.4826·MAD of first differences / √2, over its last ``level_history`` windows): how far a
  five-minute window's mean strays from the prediction when nothing is wrong (arrivals
  fluctuate, a p99 rides on a few requests). Differencing the means keeps what made the
  within-window estimate blind to bias: a constant error cancels, a step is one outlier the
  MAD ignores, so a model that is wrong by the same amount every window does not raise its
  own threshold. The current window is not in its own history. A window offset b then
  fires when b ≳ (0.5 + 4/n)·√n ≈ 3σ of a window mean (n = 20); isolated spikes still
  cannot (the clip below). The spec's "σ from that variable's residual history" reads both
  ways; this one is the scale on which the spec's 0.5σ / 4σ make sense for windowed series.
- **A new rank borrows the fleet's long-run σ.** Until a rank has ``min_levels`` windows of
  its own, its long-run σ is the median, over this tick's ranks that have them, of each
  rank's long-run σ relative to its prediction's scale (:func:`fleet_relative_sigma`),
  times its own prediction's scale: an empirical-Bayes prior, so a new ladder is judged on
  the noise every windowed series shows instead of on its smooth first differences (on the
  oracle's predictions p99 TTFT diverged in 93% of such windows without the prior, 69% with
  it: what remains is the post-launch transient and the A/B handover's traffic split, which
  a steady-state prediction does not describe). A rank's own history replaces the prior as
  soon as it exists; a fleet with no history yet has no prior.
- **σ floor**: σ ≥ ``rel_floor`` × scale(variable, prediction) (:mod:`koi.evidence.scales`).
  Without it a noise-free series (σ̂ = 0) makes any error, however small, diverge.
  With the default 5% floor, a noise-free window of 30 samples flags a sustained bias
  above ≈ 3.2% of the prediction ((b − 2.5%)·30 > 20%) and matches below it.
- **Winsorised increments**: each residual enters the sums clipped to ±``clip_k``·σ
  (1.5σ, a Huberised CUSUM; Huber's usual c is 1.345). One spike then adds at most
  (1.5 − 0.5)σ = σ, a quarter of h = 4σ, so isolated deviations do not fire (overview
  §2.3: "separates persistent prediction error from isolated deviations") — a wider
  clip gives each spike a head start from which ordinary noise finishes the alarm —
  while a sustained bias b fires after about h / (min(b, 1.5σ) − δ) samples (≥ 4).
- ``s_plus`` / ``s_minus`` in :class:`CusumResult` are the extremes over the window
  (max S⁺, min S⁻), so the stored numbers explain the verdict; ``residual_std`` is the
  window's robust σ̂ before pooling and flooring (what the next window's history reads).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import numpy as np
from pydantic import Field

from koi.domain.common import KoiModel
from koi.domain.telemetry import CusumResult, Verdict
from koi.evidence.scales import scale

MAD_TO_SIGMA = 1.482602218505602


class CusumEntry(KoiModel):
    delta_k: float = Field(default=0.5, gt=0, description="slack δ in units of σ")
    h_k: float = Field(default=4.0, gt=0, description="threshold h in units of σ")


class CusumTable(KoiModel):
    """Per-variable (δ, h) multipliers, owned by the slow loop's meta recalibration."""

    entries: dict[str, CusumEntry] = Field(default_factory=dict)
    default: CusumEntry = Field(default_factory=CusumEntry)

    def get(self, variable: str) -> CusumEntry:
        return self.entries.get(variable, self.default)


class CusumConfig(KoiModel):
    rel_floor: float = Field(default=0.05, ge=0, description="σ ≥ rel_floor × scale(variable, prediction)")
    clip_k: float = Field(default=1.5, gt=0, description="residuals enter the sums clipped to ±clip_k·σ")
    sigma_history: int = Field(default=5, ge=0, description="past windows of the rank pooled into σ")
    level_history: int = Field(default=12, ge=0, description="past windows' mean residuals behind the long-run σ")
    min_levels: int = Field(default=4, ge=3, description="past windows needed before the long-run σ applies")
    min_samples: int = Field(default=8, ge=1, description="windows shorter than this decide no mechanism")


def robust_noise_sigma(r: np.ndarray) -> float:
    """1.4826 · MAD of first differences / √2: the noise σ, blind to bias, steps and spikes."""
    r = np.asarray(r, dtype=float)
    if r.size < 3:
        return float(np.std(r)) if r.size == 2 else 0.0
    d = np.diff(r)
    mad = float(np.median(np.abs(d - np.median(d))))
    return MAD_TO_SIGMA * mad / math.sqrt(2.0)


def robust_noise_sigmas(R: np.ndarray) -> np.ndarray:
    """:func:`robust_noise_sigma` of each row of ``R`` at once."""
    R = np.atleast_2d(np.asarray(R, dtype=float))
    if R.shape[1] < 3:
        return np.array([robust_noise_sigma(r) for r in R])
    d = np.diff(R, axis=1)
    mad = np.median(np.abs(d - np.median(d, axis=1, keepdims=True)), axis=1)
    return MAD_TO_SIGMA * mad / math.sqrt(2.0)


def long_run_sigma(levels: Sequence[float], n: int, config: CusumConfig) -> float:
    """√n × the robust spread of past windows' mean residuals; 0 until ``min_levels`` windows exist."""
    vals = [float(x) for x in levels if math.isfinite(x)][-config.level_history:] if config.level_history else []
    if len(vals) < config.min_levels:
        return 0.0
    return math.sqrt(n) * robust_noise_sigma(np.asarray(vals))


def fleet_relative_sigma(streams: Iterable[tuple[str, Sequence[float], int, float]],
                         config: CusumConfig) -> dict[str, float]:
    """variable → median over streams with ``min_levels`` past windows of long-run σ / scale(prediction).

    ``streams`` holds (variable, past windows' mean residuals, samples in this window, prediction),
    one per rank and variable; those without enough history are skipped.
    """
    rel: dict[str, list[float]] = {}
    for var, levels, n, pred in streams:
        lr = long_run_sigma(levels, n, config)
        if lr > 0:
            rel.setdefault(var, []).append(lr / scale(var, pred))
    return {v: float(np.median(xs)) for v, xs in sorted(rel.items())}


def pooled_sigma(window_sigma: float, history: Sequence[float] = ()) -> float:
    vals = [float(x) for x in history if math.isfinite(x) and x >= 0] + [window_sigma]
    return float(np.median(vals))


def cusum_extremes(r: np.ndarray, delta: np.ndarray, h: np.ndarray, clip: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Max S⁺ and min S⁻ of a two-sided CUSUM for several streams at once.

    ``r`` has shape (n_streams, n_samples); ``delta``, ``h`` (unused here, kept for the
    signature's symmetry) and ``clip`` are per stream. Sequential in samples, vectorised in
    streams: the hot path of S2 on many ranks.
    """
    r = np.atleast_2d(np.asarray(r, dtype=float))
    delta = np.asarray(delta, dtype=float)
    clip = np.asarray(clip, dtype=float)
    rc = np.clip(r, -clip[:, None], clip[:, None])
    sp = np.zeros(r.shape[0])
    sm = np.zeros(r.shape[0])
    sp_max = np.zeros(r.shape[0])
    sm_min = np.zeros(r.shape[0])
    for k in range(r.shape[1]):
        x = rc[:, k]
        sp = np.maximum(0.0, sp + x - delta)
        sm = np.minimum(0.0, sm + x + delta)
        np.maximum(sp_max, sp, out=sp_max)
        np.minimum(sm_min, sm, out=sm_min)
    return sp_max, sm_min


def run_cusum(
    residuals: Mapping[str, Sequence[float]],
    predicted: Mapping[str, float],
    table: CusumTable | None = None,
    config: CusumConfig | None = None,
    sigma_history: Mapping[str, Sequence[float]] | None = None,
    level_history: Mapping[str, Sequence[float]] | None = None,
    fleet_sigma: Mapping[str, float] | None = None,
) -> dict[str, CusumResult]:
    """CUSUM verdicts for every variable with residuals; pure and deterministic.

    ``sigma_history`` holds the rank's past windows' within-window σ̂ and ``level_history``
    their mean residuals (oldest first), per variable; ``fleet_sigma`` the fleet's relative
    long-run σ (:func:`fleet_relative_sigma`), used for a variable without enough level history.
    """
    table = table or CusumTable()
    config = config or CusumConfig()
    names = sorted(residuals)
    if not names:
        return {}
    n = len(residuals[names[0]])
    if any(len(residuals[v]) != n for v in names):
        raise ValueError("residual streams of one window must have equal lengths")
    R = np.array([np.asarray(residuals[v], dtype=float) for v in names]).reshape(len(names), n)
    sig_w = robust_noise_sigmas(R)
    sigma = np.empty(len(names))
    for i, v in enumerate(names):
        hist = list((sigma_history or {}).get(v, ()))[-config.sigma_history:] if config.sigma_history else []
        floor = config.rel_floor * scale(v, predicted.get(v, 0.0))
        lr = long_run_sigma((level_history or {}).get(v, ()), n, config)
        if lr == 0.0 and fleet_sigma and v in fleet_sigma:
            lr = fleet_sigma[v] * scale(v, predicted.get(v, 0.0))
        sigma[i] = max(pooled_sigma(sig_w[i], hist), lr, floor, 1e-300)
    dk = np.array([table.get(v).delta_k for v in names])
    hk = np.array([table.get(v).h_k for v in names])
    delta, h = dk * sigma, hk * sigma
    sp, sm = cusum_extremes(R, delta, h, config.clip_k * sigma)
    out: dict[str, CusumResult] = {}
    for i, v in enumerate(names):
        diverged = bool(sp[i] > h[i] or sm[i] < -h[i])
        out[v] = CusumResult(
            variable=v,
            verdict=Verdict.DIVERGED if diverged else Verdict.MATCHED,
            s_plus=float(sp[i]),
            s_minus=float(sm[i]),
            delta=float(delta[i]),
            h=float(h[i]),
            residual_mean=float(R[i].mean()) if n else 0.0,
            residual_std=float(sig_w[i]),
            n=n,
        )
    return out
