"""What a swap costs in service while it happens (the dollars are SwitchCost's,
:mod:`koi.scoring.switching`)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from koi.planning.candidates import RankSpec


def transition_gaps(current: Sequence[RankSpec] | None, ladders: Sequence[Sequence[RankSpec]],
                    free: Mapping[str, int], tick_s: float) -> np.ndarray:
    """Share of a tick's demand each swap leaves unserved while it happens (0 for a placement).

    S6 replaces a running rank *in place* when its pool has no free room for the successor
    (:func:`koi.pipeline.deploy.plan_ops`, wave 1): it gives back only the instances the launches
    lack (a rolling replacement) and hands the rest of the old rank over; elsewhere the old ranks
    keep serving until the new ones do (make before break). An in-place replacement therefore
    leaves the released part of the old rank's share — short / held instances, short = the
    successor's instances beyond the pool's free ones — without a server for the new chain's
    cold start. SwitchCost prices churn in dollars (whitepaper, "The Cluster Objective"); this is the
    service it costs, in the selector's currency for lost service (the unserved share, priced at
    W·priority), so a swap that buys a few hundredths of J by going dark for two minutes does not
    look free. Choices: a pool "has room" when its free instances hold the successor's (the plan's
    other launches there are not known per candidate); a rank whose chain the new ladder keeps in
    the same pool is rescaled, not replaced (no gap); traffic shares are the gateway weights
    (replicas × per-replica SLO capacity, as :meth:`RankSpec.to_rank`).
    """
    out = np.zeros(len(ladders))
    if not current:
        return out
    w = np.array([r.n * (r.est.cap_rps if r.est.cap_rps > 0 else r.est.sat_rps) for r in current], dtype=float)
    share = w / w.sum() if w.sum() > 0 else np.full(len(current), 1.0 / len(current))
    cur_keys = [r.key for r in current]
    by_pool: dict[str, list[int]] = defaultdict(list)
    for i, r in enumerate(current):
        by_pool[r.pool_id].append(i)
    old_keys = {pid: {cur_keys[i] for i in old} for pid, old in by_pool.items()}
    for k, lad in enumerate(ladders):
        gap = 0.0
        for pid, old in by_pool.items():
            new = [(r, r.key) for r in lad if r.pool_id == pid]
            keys = {key for _, key in new}
            replaced = [i for i in old if cur_keys[i] not in keys]
            launched = [r for r, key in new if key not in old_keys[pid]]
            short = sum(r.instances for r in launched) - free.get(pid, 0)
            if not replaced or not launched or short <= 0:
                continue
            held = sum(current[i].instances for i in replaced)
            dark = min(1.0, short / held) if held > 0 else 1.0
            gap += float(share[replaced].sum()) * dark * min(1.0, max(r.cold_s for r in launched) / tick_s)
        out[k] = min(gap, 1.0)
    return out
