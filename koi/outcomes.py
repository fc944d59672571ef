"""Derived outcomes, defined once: cost per token and SLO margin (Appendix C, Y).

The simulator's telemetry, the surrogate's predictions and the evaluator all compute
these two from the same inputs with these functions, so an observed value and a
predicted one mean the same thing.

Choices where the spec is vague ("headroom to TTFT/TPOT targets"):
- online jobs: ``slo_margin = min(1 - p99_ttft/target_ttft, 1 - p99_tpot/target_tpot)``,
  the relative headroom of the tighter target; positive means both targets are met;
- batch jobs: ``slo_margin = 1 - required_rate / achieved_rate``, where the required
  rate is the output tokens still owed divided by the time left to the deadline; 0
  means exactly on schedule, negative means the deadline will be missed at this pace;
- both are clipped to [-10, 1] so a stalled deployment does not produce -inf.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

MARGIN_FLOOR = -10.0


def cost_per_token(hourly_cost: ArrayLike, tokens_per_sec: ArrayLike) -> np.ndarray:
    """$ per output token: the provisioned fleet's $/h over its output tokens per hour.

    A deployment producing nothing has an infinite cost per token; we return NaN-free
    ``inf`` so comparisons stay meaningful.
    """
    cost = np.asarray(hourly_cost, dtype=float)
    tps = np.asarray(tokens_per_sec, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        out = np.where(tps > 0, cost / (3600.0 * np.maximum(tps, 1e-12)), np.inf)
    return out


def online_slo_margin(
    p99_ttft_ms: ArrayLike, p99_tpot_ms: ArrayLike, target_ttft_ms: float, target_tpot_ms: float
) -> np.ndarray:
    ttft = np.asarray(p99_ttft_ms, dtype=float)
    tpot = np.asarray(p99_tpot_ms, dtype=float)
    m = np.minimum(1.0 - ttft / target_ttft_ms, 1.0 - tpot / target_tpot_ms)
    return np.clip(m, MARGIN_FLOOR, 1.0)


def batch_slo_margin(tokens_remaining: ArrayLike, seconds_left: ArrayLike, tokens_per_sec: ArrayLike) -> np.ndarray:
    rem = np.asarray(tokens_remaining, dtype=float)
    left = np.asarray(seconds_left, dtype=float)
    tps = np.asarray(tokens_per_sec, dtype=float)
    with np.errstate(divide="ignore", invalid="ignore"):
        required = np.where(left > 0, rem / np.maximum(left, 1e-9), np.where(rem > 0, np.inf, 0.0))
        m = np.where(tps > 0, 1.0 - required / np.maximum(tps, 1e-12), np.where(required > 0, MARGIN_FLOOR, 1.0))
    return np.clip(np.nan_to_num(m, nan=MARGIN_FLOOR, neginf=MARGIN_FLOOR), MARGIN_FLOOR, 1.0)
