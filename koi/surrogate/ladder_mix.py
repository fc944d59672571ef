"""A ladder's outcomes from its ranks' predictions (:meth:`Surrogate.predict_ladder
<koi.surrogate.core.Surrogate.predict_ladder>`, whose docstring states the rules): the p99 of the
load-weighted latency mixture, sums and load-weighted means of the rest, then cost per token and SLO
margin from koi.outcomes. Kept apart from :mod:`koi.surrogate.core`, which splits the load.
"""

from __future__ import annotations

import math

import numpy as np

from koi import outcomes
from koi.domain.common import JobClass
from koi.domain.job import Job
from koi.surrogate.outputs import _ALL_NAMES
from koi.surrogate.types import RankPrediction


def _mixture_p99(means: np.ndarray, p99s: np.ndarray, w: np.ndarray) -> float:
    """p99 of a mixture whose components have exponential tails through (mean, p99)."""
    w = w / max(w.sum(), 1e-12)
    keep = w > 0
    means, p99s, w = means[keep], p99s[keep], w[keep]
    if len(w) == 1:
        return float(p99s[0])
    scale = np.maximum(p99s - means, 1e-9) / math.log(100.0)

    def tail(x: float) -> float:
        return float(np.sum(w * np.minimum(1.0, 0.01 * np.exp(-(x - p99s) / scale))))

    lo, hi = float(np.min(means)), float(np.max(p99s))
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        if tail(mid) > 0.01:
            lo = mid
        else:
            hi = mid
    return 0.5 * (lo + hi)


def _combine_ladder(preds: list[RankPrediction], split: np.ndarray, job: Job, hourly: float, **kw) -> dict[str, float]:
    vals = [p.values for p in preds]
    w = np.asarray(split, dtype=float)
    out: dict[str, float] = {}
    out["throughput_tokens_per_sec"] = float(sum(v["throughput_tokens_per_sec"] for v in vals))
    # p99 of the mixture; the mean of each rank's distribution from its stored p99 and the prior σ shape
    for key in ("p99_ttft_ms", "p99_tpot_ms"):
        p99 = np.array([v[key] for v in vals])
        mean = p99 / 1.5  # shape choice when only the p99 is carried: mean ≈ p99/1.5
        out[key] = _mixture_p99(mean, p99, w)
    for key in ("queue_depth", "preemption_rate"):
        out[key] = float(sum(v[key] for v in vals))
    for key in _ALL_NAMES:
        if key not in out and key not in ("cost_per_token", "slo_margin"):
            out[key] = float(np.sum(w * np.array([v[key] for v in vals])) / max(w.sum(), 1e-12))
    out["cost_per_token"] = float(outcomes.cost_per_token(hourly, out["throughput_tokens_per_sec"]))
    if job.job_class is JobClass.ONLINE:
        out["slo_margin"] = float(
            outcomes.online_slo_margin(out["p99_ttft_ms"], out["p99_tpot_ms"], job.slo.p99_ttft_ms, job.slo.p99_tpot_ms)
        )
    else:
        rem = kw.get("tokens_remaining", job.total_token_budget)
        left = kw.get("seconds_left", job.slo.deadline_s)
        out["slo_margin"] = float(outcomes.batch_slo_margin(rem, left, out["throughput_tokens_per_sec"]))
    return out
