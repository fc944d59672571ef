"""The slow loop's band check κ_t: did this tick's outcomes fall inside the band the planner used?

Whitepaper "Risk: DRO" and "Slow Loop": ε grows when realised outcomes fall outside the DRO band
more often than the target rate (κ* = 0.90) and shrinks when they sit comfortably inside, "so
Koi's SLO promises are honest about its own prediction error". The band whose coverage that
describes is the planner's (:func:`koi.scoring.risk.dro_band`): around the surrogate's
**corrected** prediction, widened by the residual learner's prequential relative residuals of
the finest scope with enough of them (``ResidualModel.residuals``), at ε_{t−1}.

So a PerfDB record of tick t (the window ``(t−1, t]``) is checked against the model the plan of
t − 1 was made with, the fit on the records before t (:func:`check_records`):

- prediction: that model's corrected prediction for the rank at its served rate
  (``ResidualModel.predict_record``: the physics re-run at the learned speed, then the output
  factors — as the model's own prequential residuals are computed; a first-order speed scaling
  would miss how a slower GPU's TTFT grows near saturation);
- band: that model's residuals for the record's scope, at ε_{t−1}; with none yet, ``ŷ ± ε`` (the
  band's cold fallback, as the planner's);
- objectives: the bands the planner reads for the job (:func:`koi.planning.ladder_eval.evaluate_ladders`)
  — an online rank's p99 TTFT and TPOT against its SLO, a batch rank's throughput against its
  deadline's need. An online rank's throughput is its demand, predicted at the served rate almost
  exactly: its tight band is not one the planner plans with, and counting it moved ε.

Before this, the check used the base (physics) prediction and the job's own base residuals: it
measured a band the planner never uses (on hetero-3h seed 0's PerfDB that band needed ε ≈ 0.5 to
hold 90% of the outcomes, the planner's needs ≈ 0.3).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

from koi.calibration.state import CoveragePoint

#: The bands the planner plans with, by job class (module docstring).
ONLINE_BANDS = ("p99_ttft_ms", "p99_tpot_ms")
BATCH_BANDS = ("throughput_tokens_per_sec",)


def check_records(model: Any, records: Sequence[Any], eps: float,
                  batch_jobs: Iterable[str] = ()) -> tuple[int, int]:
    """(inside, checked) of ``records`` (PerfRecords of one tick) against ``model``'s bands at ``eps``.

    ``model`` is the fitted ``ResidualModel`` the planner held before the records' tick (an empty one
    before any record: the cold band ``ŷ ± ε``)."""
    from koi.scoring.risk import dro_band
    from koi.surrogate.residual import ResidualModel, scope_of_record

    batch = set(batch_jobs)
    model = model if model is not None else ResidualModel.empty()
    inside = total = 0
    for r in records:
        objectives = BATCH_BANDS if r.job_id in batch else ONLINE_BANDS
        scope = scope_of_record(r)
        y_hat = model.predict_record(r, objectives)
        for obj in objectives:
            y, p = r.observed_y.get(obj), y_hat.get(obj)
            if y is None or p is None or not (np.isfinite(y) and np.isfinite(p)) or p <= 0:
                continue
            lo, hi = dro_band(p, model.residuals(obj, scope), eps)  # none yet: the cold band ŷ ± ε
            total += 1
            inside += bool(float(lo) <= y <= float(hi))
    return inside, total


def band_coverage(model: Any, records: Sequence[Any], tick: int, eps: float,
                  batch_jobs: Iterable[str] = ()) -> CoveragePoint | None:
    """κ_t's counts for the records of ``tick`` (None when none was checked)."""
    inside, total = check_records(model, [r for r in records if r.tick == tick], eps, batch_jobs)
    return CoveragePoint(tick=tick, n_inside=inside, n_total=total) if total else None
