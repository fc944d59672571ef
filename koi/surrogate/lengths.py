"""Moments and tail quantiles of request-length distributions (``LengthDist``).

The queueing model needs more than the mean input length: the prefill service
time's variability (Kingman's c_s) and the p99 of a single request's prefill both
come from the input-length spread, and the p99 of per-request TPOT comes from the
*short* outputs (few decode steps average out little interference).

Choices where the spec is vague: a ``uniform`` LengthDist is read as uniform on
[min, max] (its mean/std fields are then descriptive only); ``normal`` and
``lognormal`` use (mean, std) and are clipped to [min, max] at the quantile, not
renormalised (the clipped mass is small for every shipped workload).
"""

from __future__ import annotations

import math

from koi.domain.workload import LengthDist, LengthKind

_Z = {0.01: -2.3263, 0.05: -1.6449, 0.10: -1.2816, 0.5: 0.0, 0.9: 1.2816, 0.95: 1.6449, 0.99: 2.3263}


def _z(q: float) -> float:
    if q in _Z:
        return _Z[q]
    from scipy.stats import norm

    return float(norm.ppf(q))


def quantile(d: LengthDist, q: float) -> float:
    """The q-quantile of ``d`` in tokens, clipped to [min, max]."""
    if d.kind is LengthKind.FIXED or d.std <= 0 and d.kind is not LengthKind.UNIFORM:
        x = d.mean
    elif d.kind is LengthKind.UNIFORM:
        x = d.min + q * (d.max - d.min)
    elif d.kind is LengthKind.NORMAL:
        x = d.mean + _z(q) * d.std
    else:  # lognormal with the given mean and std
        s2 = math.log1p((d.std / d.mean) ** 2)
        mu = math.log(d.mean) - 0.5 * s2
        x = math.exp(mu + _z(q) * math.sqrt(s2))
    return float(min(max(x, d.min), d.max))


def cv(d: LengthDist) -> float:
    """Coefficient of variation (std / mean); uniform uses its [min, max] spread."""
    if d.kind is LengthKind.FIXED:
        return 0.0
    if d.kind is LengthKind.UNIFORM:
        return (d.max - d.min) / math.sqrt(12.0) / max(d.mean, 1e-9)
    return d.std / max(d.mean, 1e-9)


def mean(d: LengthDist) -> float:
    """The declared mean (``WorkloadProfile.isl``/``osl`` use the same field)."""
    return float(d.mean)
