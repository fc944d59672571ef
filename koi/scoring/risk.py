"""Risk: the DRO band and the SLO-breach probability (whitepaper, "Risk: Distributionally
Robust Prediction"; overview §2.4).

    upper_j = ŷ_j + Q_q(r_j) + 2ε σ̂_j,    lower_j = ŷ_j + Q_{1−q}(r_j) − 2ε σ̂_j,   q = 0.95
    p_j     = P̂_emp,j + ε · Lip_j · σ̂_j                     (capped at 1)
    p_brk   = 1 − Π_{j ∈ S_i} (1 − p_j)

Choices where the spec is vague:
- **Residual units.** Residuals are *relative*, r = (observed − predicted)/predicted,
  so that one residual history transfers across ranks whose scales differ (a 1B model's
  TTFT in tens of ms, a 235B model's in seconds). The absolute band is ŷ·(1 + Q(r)) ±
  2ε·ŷ·σ̂(r), i.e. the spec's formula with r and σ̂ scaled by ŷ.
- **P̂_emp.** The empirical exceedance: the share of residuals r_k for which the
  corrected prediction ŷ(1 + r_k) breaches the threshold.
- **Lip_j.** The Lipschitz constant of the exceedance probability with respect to a
  shift of the outcome distribution, i.e. the density of ŷ(1 + r) at the threshold,
  estimated with a Gaussian kernel (Silverman bandwidth). Then ε·Lip·σ̂ is the
  first-order extra mass that crosses the threshold when the distribution moves by ε·σ̂
  (a Wasserstein-1 ball of radius ε·σ̂): near zero for a prediction far from its target,
  at most ≈ 0.4ε right at it.
- **Cold start** (no residuals yet): the band is ŷ ± w·|ŷ| with w = ε·u, u ≥ 1 the
  surrogate's σ multiplier for predictions resting on borrowed data (a rescaled GPU, a
  nearest-architecture profile; 1 otherwise). The spec writes "ŷ ± ε"; relative keeps it
  unit-free, and u widens it where the surrogate itself says it is guessing. The error is taken as uniform on that band: P̂_emp is
  the share of the band beyond the threshold, σ̂ = w|ŷ|/√3 and Lip = 1/(2w|ŷ|) inside
  the band (0 outside), so the inflation is ε/(2√3) ≈ 0.043 when the target lies in the
  band.
- **SLO objectives S_i.** Online: p99 TTFT ≤ target and p99 TPOT ≤ target. Batch:
  throughput ≥ the rate that finishes the remaining tokens by the deadline.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

MAX_RESIDUALS = 512
_SQRT3 = math.sqrt(3.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)


def _residuals(r: ArrayLike | None) -> np.ndarray:
    if r is None:
        return np.zeros(0)
    a = np.asarray(r, dtype=float).ravel()
    a = a[np.isfinite(a)]
    return a[-MAX_RESIDUALS:]


def dro_band(
    y_hat: ArrayLike, residuals: ArrayLike | None, eps: float, q: float = 0.95, uncertainty: ArrayLike = 1.0
) -> tuple[np.ndarray, np.ndarray]:
    """(lower, upper) bands for predictions ``y_hat`` (any shape) under relative residuals."""
    y = np.asarray(y_hat, dtype=float)
    r = _residuals(residuals)
    if r.size == 0:
        w = eps * np.maximum(np.asarray(uncertainty, dtype=float), 1.0)
        half = w * np.abs(y)
        return y - half, y + half
    s = float(np.std(r, ddof=1)) if r.size > 1 else 0.0
    qu, ql = np.quantile(r, [q, 1.0 - q])
    upper = y * (1.0 + qu) + 2.0 * eps * s * np.abs(y)
    lower = y * (1.0 + ql) - 2.0 * eps * s * np.abs(y)
    return lower, upper


def breach_probability(
    y_hat: ArrayLike,
    threshold: ArrayLike,
    *,
    maximize: bool,
    residuals: ArrayLike | None,
    eps: float,
    uncertainty: ArrayLike = 1.0,
) -> np.ndarray:
    """p_j = P̂_emp + ε·Lip·σ̂ for one objective, vectorised over predictions.

    ``maximize`` says which side breaches: a maximised objective (throughput) breaches
    below its threshold, a minimised one (latency) above it. A non-finite threshold means
    "no target": probability 0. A non-finite prediction on the breaching side is 1.
    """
    return breach_probabilities(y_hat, threshold, maximize=maximize, residuals=residuals, eps=(eps,),
                                uncertainty=uncertainty)[0]


def breach_probabilities(
    y_hat: ArrayLike,
    threshold: ArrayLike,
    *,
    maximize: bool,
    residuals: ArrayLike | None,
    eps: tuple[float, ...],
    uncertainty: ArrayLike = 1.0,
) -> list[np.ndarray]:
    """:func:`breach_probability` at several radii ε at once (one array per radius).

    With residuals, P̂_emp and Lip·σ̂ do not depend on ε, so the kernel density is computed
    once and each further radius costs one multiply-add (the planner's causal-risk radius,
    :mod:`koi.planning.candidates`, "Causal risk"). Cold, the band itself scales with ε and
    is recomputed per radius (cheap: no residual samples).
    """
    y = np.asarray(y_hat, dtype=float)
    t = np.broadcast_to(np.asarray(threshold, dtype=float), y.shape)
    sign = -1.0 if maximize else 1.0  # breach when sign*(value - t) > 0
    r = _residuals(residuals)
    raw: list[np.ndarray] = []
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        if r.size == 0:
            u = np.maximum(np.broadcast_to(np.asarray(uncertainty, dtype=float), y.shape), 1.0)
            for e in eps:
                half = np.maximum(e * u * np.abs(y), 1e-300)
                # share of the uniform band [y-half, y+half] on the breaching side of t
                frac_above = np.clip((y + half - t) / (2.0 * half), 0.0, 1.0)
                p_emp = frac_above if sign > 0 else 1.0 - frac_above
                inside = (t >= y - half) & (t <= y + half)
                raw.append(p_emp + np.where(inside, e / (2.0 * _SQRT3), 0.0))  # ε · 1/(2w|ŷ|) · w|ŷ|/√3
        else:
            samples = y[..., None] * (1.0 + r)  # (..., k)
            p_emp = np.mean(sign * (samples - t[..., None]) > 0, axis=-1)
            s_rel = float(np.std(r, ddof=1)) if r.size > 1 else 0.0
            sigma = s_rel * np.abs(y)
            h = np.maximum(1.06 * sigma * r.size ** (-0.2), 1e-9 * np.maximum(np.abs(y), 1e-12))
            z = (t[..., None] - samples) / h[..., None]
            dens = np.mean(np.exp(-0.5 * z * z), axis=-1) * _INV_SQRT_2PI / h
            raw.extend(p_emp + e * dens * sigma for e in eps)  # ε · Lip · σ̂, in the original order
    fin = np.isfinite(t)
    bad = ~np.isfinite(y) & fin
    breached = (np.isnan(y) | ((y > t) if sign > 0 else (y < t))) if np.any(bad) else None
    out = []
    for p in raw:
        p = np.where(fin, p, 0.0)
        if breached is not None:
            p = np.where(bad, np.where(breached, 1.0, 0.0), p)
        out.append(np.clip(np.nan_to_num(p, nan=1.0), 0.0, 1.0))
    return out


def combine(p: ArrayLike, axis: int = -1) -> np.ndarray:
    """p_brk = 1 − Π_j (1 − p_j): independence across objectives (conservative, overview §2.4)."""
    a = np.clip(np.asarray(p, dtype=float), 0.0, 1.0)
    return 1.0 - np.prod(1.0 - a, axis=axis)
