"""Exploitation: the augmented Tchebycheff score J (whitepaper, "Exploitation: Augmented
Tchebycheff"; overview §2.2).

    J = −[ max_j w_j g_j + ρ Σ_j w_j g_j ],
    g_j = (z*_j − ŷ_j)/range_j  (j maximised: throughput, SLO margin)
    g_j = (ŷ_j − z*_j)/range_j  (j minimised: cost, p99 TTFT, p99 TPOT)

over the objectives in :data:`koi.variables.OBJECTIVES` order. Larger J (closer to 0)
is better. Everything here is vectorised over candidates: ``y`` is ``(n, 5)``; weights,
z* and ranges broadcast (``(5,)`` for one job, ``(n, 5)`` for many).

Choices where the spec is vague:
- **Gap clipping.** g is clipped to [G_MIN, G_MAX] = [−2, 5]. A prediction can be far
  outside the observed range (a stalled deployment has cost = ∞) and an unbounded J
  would let one job's outlier outweigh the unserved-demand penalty of another; five
  ranges from the ideal is already "as bad as it gets", and −2 keeps a candidate that
  beats the ideal from dominating by more than it deserves.
- **Reference point (cold start and per job).** The overview (§2.5) defines z* per
  job over its deployment history H_i; the white paper's Problem Formulation calls it
  "the best achievable value per objective". We take, per job and objective, the best
  of (its observed history, when the store has one) and (its current candidates'
  predictions), moved by a slack Δ_j = 5% of the range so that the best candidate
  still has a small positive gap (the margin that "preserves dominance"). The range is
  the spread of those same values, floored at 10% of |z*_j| (and 0.05 for the
  unit-less SLO margin) so that a job whose candidates all agree is not divided by 0.
  Normalising per job keeps J commensurate across jobs whose costs differ by 1000×
  (a 1B and a 235B model), which a per-class z* could not.
- **Cost's range is capped at its best value** (REL_RANGE_CAP): g_cost ≤ (ŷ − z*)/|best|, the
  fractional excess over the cheapest option, once the candidates' spread exceeds it. With the
  plain spread the dearest candidate's cost gap is ≈ 1 whatever its price, so w_cost·g_cost ≤
  ~0.1 for an online job while a third of a latency range weighs 0.35 × ⅓: a ladder at 5× the
  price won on a small latency gain, and an absurd candidate in the set (a 156-GPU split
  ladder) shrank every other candidate's cost gap, re-ranking two sensible ones by its mere
  presence. On hetero-12h (Koi, seed 0, tick 5) a repair moved agent-moe-30b from 40 GPUs to
  that 156-GPU ladder at $448/h over 24 H100 at $77/h, and J then preferred keeping it to
  every scale-in for six hours. Only cost is capped: it grows without bound with the ladder,
  while the latencies saturate at the hardware's floor and are held to their targets by C3 and
  γ·p_brk besides; capping them as well (tried on hetero-3h seed 0) made every gap a latency
  gap again and scored below the uncapped J.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from numpy.typing import ArrayLike
from pydantic import Field

from koi.domain.common import KoiModel
from koi.variables import OBJECTIVES, is_maximized

G_MIN = -2.0
G_MAX = 5.0
SLACK = 0.05
REL_RANGE_FLOOR = 0.10
ABS_RANGE_FLOOR = {"slo_margin": 0.05}
#: range_j ≤ cap·|best_j| (module docstring, "Cost's range is capped at its best value")
REL_RANGE_CAP = {"cost_per_token": 1.0}

#: +1 for maximised objectives, −1 for minimised, in OBJECTIVES order.
SENSE = np.array([1.0 if is_maximized(o) else -1.0 for o in OBJECTIVES])
N_OBJ = len(OBJECTIVES)


class ReferencePoint(KoiModel):
    """z* and range per objective for one job (OBJECTIVES order)."""

    z_star: tuple[float, float, float, float, float]
    ranges: tuple[float, float, float, float, float]
    source: str = Field(default="candidates", description="candidates | history+candidates | given")

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.z_star, dtype=float), np.asarray(self.ranges, dtype=float)


def gaps(y: ArrayLike, z_star: ArrayLike, ranges: ArrayLike) -> np.ndarray:
    """Normalised gaps g (> 0 means worse than ideal), clipped to [G_MIN, G_MAX]."""
    y = np.asarray(y, dtype=float)
    z = np.asarray(z_star, dtype=float)
    r = np.maximum(np.asarray(ranges, dtype=float), 1e-300)
    with np.errstate(invalid="ignore", over="ignore"):
        g = SENSE * (z - y) / r
    g = np.where(np.isnan(g), G_MAX, g)
    return np.clip(g, G_MIN, G_MAX)


def tchebycheff(
    y: ArrayLike, weights: ArrayLike, z_star: ArrayLike, ranges: ArrayLike, rho: float = 1e-3
) -> np.ndarray:
    """J for each row of ``y``; see the module docstring."""
    w = np.asarray(weights, dtype=float)
    wg = w * gaps(y, z_star, ranges)
    return -(np.max(wg, axis=-1) + rho * np.sum(wg, axis=-1))


def reference_point(
    y: ArrayLike, history_best: Mapping[str, float] | Sequence[float] | None = None
) -> ReferencePoint:
    """z* and ranges for one job from its candidates' predictions (and its history's best).

    ``y`` is ``(n, 5)``; non-finite predictions (e.g. cost = ∞) are ignored. See the
    module docstring for the slack and the range floors.
    """
    y = np.atleast_2d(np.asarray(y, dtype=float))
    cols = [y[:, j][np.isfinite(y[:, j])] for j in range(N_OBJ)]
    if history_best is not None:
        hb = [history_best.get(o) for o in OBJECTIVES] if isinstance(history_best, Mapping) else list(history_best)
        cols = [np.append(c, h) if h is not None and np.isfinite(h) else c for c, h in zip(cols, hb, strict=True)]
    z = np.zeros(N_OBJ)
    rng = np.zeros(N_OBJ)
    for j, c in enumerate(cols):
        if c.size == 0:
            z[j], rng[j] = 0.0, 1.0
            continue
        best = c.max() if SENSE[j] > 0 else c.min()
        spread = float(c.max() - c.min())
        floor = max(REL_RANGE_FLOOR * abs(best), ABS_RANGE_FLOOR.get(OBJECTIVES[j], 0.0), 1e-12)
        cap = REL_RANGE_CAP.get(OBJECTIVES[j])
        if cap is not None:
            spread = min(spread, cap * abs(best))
        rng[j] = max(spread, floor)
        z[j] = best + SENSE[j] * SLACK * rng[j]
    return ReferencePoint(
        z_star=tuple(float(v) for v in z),  # type: ignore[arg-type]
        ranges=tuple(float(v) for v in rng),  # type: ignore[arg-type]
        source="candidates" if history_best is None else "history+candidates",
    )


def outcome_vector(values: Mapping[str, float]) -> np.ndarray:
    """A prediction dict (registry names) as a vector in OBJECTIVES order; missing → NaN."""
    return np.array([float(values.get(o, np.nan)) for o in OBJECTIVES])
