"""The running ladder's observed SLO risk: what its last window says, next to what the model says.

C3 bounds P(breach) under *prediction* uncertainty (whitepaper, "Risk: DRO"). For a ladder that
is already running there is a better estimate than the model's: its own last window. When the
model is wrong about it — an H100 rank slowed by a driver update a few minutes ago, its queue
growing, the residual learner not yet convinced — the keep option must not keep its predicted,
near-zero risk, or "no swap pays for its switching cost" while a third of the job's requests
time out (measured on hetero-3h, Koi seed 1: 17 ticks at 33–40% TTFT attainment).

**P̂_obs of a rank** is the share of its window's telemetry samples whose p99 TTFT or p99 TPOT
exceeds the job's target — the spec's empirical exceedance P̂_emp, read off the deployment instead
of the residual history — and 1 for a rank whose window is overloaded (its queue growing:
:func:`koi.evidence.perfdb.overloaded`), whose breach only deepens while it is kept. Only settled
ranks count (serving through the whole window and the one before:
:func:`koi.evidence.perfdb.served_windows`), so launch transients do not.

**P̂_obs of a job** is its ranks' P̂_obs weighted by the share of the job's requests each is sent
(the gateway's split: route weight × ready replicas, when every rank carries a route weight; else
its share of the output throughput served in the window): the chance that a request lands on a rank
whose p99 is past the target. The gateway's split rather than the throughput served, where it is
known, because a stalled rank serves nothing while its requests still arrive: weighed by what it
served, it would vanish from its job's risk exactly when it is worst. The planner keeps
max(p_model, P̂_obs) for the keep option (:mod:`koi.planning.candidates`). Choices:

- *Weighted, not the worst rank.* A rank's p99 over target means over 1% of *its* requests miss;
  a rank carrying a share w of the job's traffic moves the job's miss share by w times that, so a
  small rank past its p99 does not put the job's p99 past it. The worst rank, used before,
  overstated the job's risk whenever a small rank of a split ladder breached, and every repair
  bought for it cost a swap; measured on hetero-3h (Koi, 3 seeds): composite 85.89 → 86.00,
  $/M SLO tokens 4.85 → 4.75 at the same goodput.
- *An overloaded rank decides alone.* Its queue grows, so in time every request it takes misses:
  once it carries at least 1% of the job's traffic the job's p99 is certainly breached (P̂_obs = 1),
  whatever the other ranks do.
- Online jobs only (a batch job's risk is its deadline, which the model's throughput already
  tracks).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from koi.domain import JobClass
from koi.evidence.perfdb import Served, overloaded, window_means

#: An overloaded rank carrying at least this share of a job's traffic breaches the job's p99 alone.
OVERLOAD_SHARE = 0.01


def _breach_share(s: Served) -> float:
    """The share of the window's samples whose p99 TTFT or p99 TPOT is past the job's target."""
    slo = s.job.job.slo
    breach = None
    for name, target in (("p99_ttft_ms", slo.p99_ttft_ms), ("p99_tpot_ms", slo.p99_tpot_ms)):
        xs = s.window.series.get(name)
        if not target or not xs:
            continue
        b = np.asarray(xs, dtype=float) > float(target)  # series are aligned with the window's times
        breach = b if breach is None else breach | b
    return float(breach.mean()) if breach is not None and len(breach) else 0.0


def _hot(s: Served, observed_v: dict[str, float]) -> bool:
    return overloaded(observed_v, s.deployment.rank.config.max_num_seqs)


def rank_risk(s: Served) -> float:
    """P̂_obs of one rank's window (module docstring)."""
    v, _ = window_means(s.window)
    return 1.0 if _hot(s, v) else _breach_share(s)


def _shares(offered: list[float | None], served_tps: list[float]) -> np.ndarray:
    """Each rank's share of the job's requests: the gateway's split when every rank carries a route
    weight (the share it is *sent*, so a stalled rank keeps its share), else its share of the output
    throughput served in the window; equal shares when neither says anything."""
    known = [o for o in offered if o is not None]
    if len(known) == len(offered) and sum(known) > 0:
        w = np.asarray(known, dtype=float)
    else:
        w = np.maximum(np.asarray(served_tps, dtype=float), 0.0)
    total = float(w.sum())
    return w / total if total > 0 else np.full(len(offered), 1.0 / len(offered))


def observed_risk(served: Iterable[Served]) -> dict[str, float]:
    """job id → P̂_obs over its settled online ranks (jobs without one are absent; module docstring)."""
    ranks: dict[str, list[tuple[float | None, float, float, bool]]] = {}
    for s in served:
        if s.job.job.job_class is not JobClass.ONLINE:
            continue
        v, y = window_means(s.window)  # once per rank: the risk and the traffic share both read it
        hot = _hot(s, v)
        rw = s.deployment.rank.route_weight
        offered = float(rw) * s.replicas if rw is not None else None
        tps = float(y.get("throughput_tokens_per_sec", 0.0))
        ranks.setdefault(s.job.job.job_id, []).append((offered, tps, 1.0 if hot else _breach_share(s), hot))
    out: dict[str, float] = {}
    for jid, rows in ranks.items():
        share = _shares([r[0] for r in rows], [r[1] for r in rows])
        risk = np.array([r[2] for r in rows])
        hot = np.array([r[3] for r in rows])
        if np.any(hot & (share >= OVERLOAD_SHARE)):
            out[jid] = 1.0
        else:
            out[jid] = float(np.clip(np.dot(share, risk), 0.0, 1.0))
    return out
