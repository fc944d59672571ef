"""The running ladder's observed SLO risk: what its last window says, next to what the model says.

C3 bounds P(breach) under *prediction* uncertainty (whitepaper, "Risk: DRO"). For a ladder that
is already running there is a better estimate than the model's: its own last window. When the
model is wrong about it — an H100 rank slowed by a driver update a few minutes ago, its queue
growing, the residual learner not yet convinced — the keep option must not keep its predicted,
near-zero risk, or "no swap pays for its switching cost" while a third of the job's requests
time out (measured on hetero-3h, Koi seed 1: 17 ticks at 33–40% TTFT attainment).

**P̂_obs of a job** is the largest, over its settled ranks (serving through the whole window and
the one before: :func:`koi.evidence.perfdb.served_windows`, so launch transients do not count),
of the share of the window's telemetry samples whose p99 TTFT or p99 TPOT exceeds the job's
target — the spec's empirical exceedance P̂_emp, read off the deployment instead of the residual
history — and 1 for a rank whose window is overloaded (its queue growing:
:func:`koi.evidence.perfdb.overloaded`), whose breach only deepens while it is kept.
The planner keeps max(p_model, P̂_obs) for the keep option (:mod:`koi.planning.candidates`).
Choices: the maximum over ranks rather than a traffic-weighted mean, because the job's p99 is
breached as soon as one rank carrying more than 1% of its requests is; online jobs only (a
batch job's risk is its deadline, which the model's throughput already tracks).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from koi.domain import JobClass
from koi.evidence.perfdb import Served, overloaded, window_means


def rank_risk(s: Served) -> float:
    """P̂_obs of one rank's window (module docstring)."""
    slo = s.job.job.slo
    v, _ = window_means(s.window)
    if overloaded(v, s.deployment.rank.config.max_num_seqs):
        return 1.0
    breach = None
    for name, target in (("p99_ttft_ms", slo.p99_ttft_ms), ("p99_tpot_ms", slo.p99_tpot_ms)):
        xs = s.window.series.get(name)
        if not target or not xs:
            continue
        b = np.asarray(xs, dtype=float) > float(target)  # series are aligned with the window's times
        breach = b if breach is None else breach | b
    return float(breach.mean()) if breach is not None and len(breach) else 0.0


def observed_risk(served: Iterable[Served]) -> dict[str, float]:
    """job id → P̂_obs over its settled online ranks (jobs without one are absent)."""
    out: dict[str, float] = {}
    for s in served:
        if s.job.job.job_class is not JobClass.ONLINE:
            continue
        out[s.job.job.job_id] = max(out.get(s.job.job.job_id, 0.0), rank_risk(s))
    return out
