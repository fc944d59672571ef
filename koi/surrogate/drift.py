"""Regime changes in the residual learner's evidence: when did a GPU type or an environment
start running at another speed? (whitepaper, "Why it cannot be solved directly": the map from
ladder to outcome is *non-stationary*; "CUSUM on Mediators and Outcomes" for the test.)

The residual learner (:mod:`koi.surrogate.residual`) explains each record's speed as a sum of
effects and, by itself, treats every level as stationary: after a driver update makes every
H100 20% slower an hour into the run, an hour of "H100 at 1.0×" outweighs ten minutes of
"H100 at 0.8×", the learned H100 speed moves a few percent, and the planner keeps moving jobs
onto H100 chains it still believes fast. This module finds such a step so the learner can
forget what came before it, for that level only.

**Test.** For one level (a GPU type, an environment) we take the per-tick mean of its records'
speed residuals r_t (log speed observed minus the fitted log factor) in tick order and the
offline CUSUM change-point statistic (Page; the estimator behind the spec's two-sided CUSUM):

    T_c = |mean(r_{≥c}) − mean(r_{<c})| / (σ · √(1/n_{<c} + 1/n_{≥c}))

maximised over split ticks c. A change is declared at ĉ = argmax T_c when T_ĉ > h and the step
|Δ| is material. Choices where the spec is vague:

- **h = 4σ** (the spec's CUSUM threshold, ``H_SIGMA``), σ the pooled spread of the per-tick
  means *within* the two segments (the two-sample t statistic: the step itself does not inflate
  it), floored at ``SIGMA_FLOOR`` (2% in log speed) so that a near-noise-free simulated series
  does not call every wobble a regime. (The CUSUM detector's MAD of first differences was tried
  first: on eight ticks of two records each it read pure 20% noise as σ ≈ 4% and declared a
  regime.)
- **Material step**: |Δ| ≥ ``MIN_STEP`` (log 1.08: an 8% change of iteration time). Smaller
  drifts are left to the effects' ordinary shrinkage.
- **At least two ticks on each side** (``MIN_TICKS``), and every tick after the split past half
  the step on its side: one window after a change could be a burst; two in a row at the new
  speed are a regime.
- **Forgetting is not deleting.** The test is rerun on every fit over all records, so a
  change declared on a burst is withdrawn at the next fit and the old records count again.
- **Only the latest change** per level counts (we forget before it); a level with several
  steps is handled one step per refit, newest evidence winning as ticks pass.
- **Levels tested**: the ``gpu`` and ``env`` effects, where fleet-wide changes live (a driver
  rollout, a noisy zone). Job, scope and fine levels are one deployment's own history.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

H_SIGMA = 4.0
SIGMA_FLOOR = 0.02
MIN_STEP = math.log(1.08)
MIN_TICKS = 2
#: residual effects whose levels are tested for regime changes
TESTED_EFFECTS: tuple[str, ...] = ("gpu", "env")


def change_tick(ticks: np.ndarray, residuals: np.ndarray) -> int | None:
    """The first tick of the latest regime of one level's residual series, or None (stationary).

    ``ticks`` and ``residuals`` are per record (any order); records of a tick are averaged.
    """
    t = np.asarray(ticks, dtype=np.int64)
    r = np.asarray(residuals, dtype=float)
    ok = np.isfinite(r)
    t, r = t[ok], r[ok]
    if len(t) == 0:
        return None
    uniq, inv = np.unique(t, return_inverse=True)
    if len(uniq) < 2 * MIN_TICKS:
        return None
    m = np.bincount(inv, weights=r) / np.bincount(inv)
    n = len(m)
    csum, csq = np.cumsum(m), np.cumsum(m * m)
    c = np.arange(MIN_TICKS, n - MIN_TICKS + 1)  # split before index c: [0, c) vs [c, n)
    before = csum[c - 1] / c
    after = (csum[-1] - csum[c - 1]) / (n - c)
    step = after - before
    # pooled within-segment spread of the per-tick means (the two-sample t statistic's σ)
    ss = (csq[c - 1] - c * before**2) + ((csq[-1] - csq[c - 1]) - (n - c) * after**2)
    sigma = np.maximum(np.sqrt(np.maximum(ss, 0.0) / max(n - 2, 1)), SIGMA_FLOOR)
    stat = np.abs(step) / (sigma * np.sqrt(1.0 / c + 1.0 / (n - c)))
    # every tick of the new regime must sit on its side, past half the step (a burst is not a regime)
    dev = np.sign(step)[:, None] * (m[None, :] - before[:, None]) - 0.5 * np.abs(step)[:, None]
    dev = np.where(np.arange(n)[None, :] >= c[:, None], dev, np.inf)
    stat = np.where(dev.min(axis=1) > 0, stat, 0.0)
    k = int(np.argmax(stat))
    if stat[k] <= H_SIGMA or abs(step[k]) < MIN_STEP:
        return None
    return int(uniq[c[k]])


def regime_starts(ticks: np.ndarray, residuals: np.ndarray, levels: dict[str, Sequence[str]]
                  ) -> dict[tuple[str, str], int]:  # fmt: skip
    """(effect, level) → first tick of its current regime, for every tested level that changed.

    ``levels[effect][i]`` is record i's level for that effect (the residual learner's keys).
    """
    out: dict[tuple[str, str], int] = {}
    t = np.asarray(ticks, dtype=np.int64)
    r = np.asarray(residuals, dtype=float)
    for effect in TESTED_EFFECTS:
        keys = np.asarray(levels[effect], dtype=object)
        for level in sorted(set(keys.tolist())):
            sel = keys == level
            start = change_tick(t[sel], r[sel])
            if start is not None:
                out[(effect, str(level))] = start
    return out
