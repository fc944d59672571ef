"""Ladder evaluation and switching costs: Ŷ, p_brk and the unserved share of each ladder of one job
(vectorised over the ladders: one predictor call), and each ladder's SwitchCost against the running
one. The candidate generator (:mod:`koi.planning.candidates`) scores every ladder it sizes with
these, the running one included; its docstring holds the sizing rules and the "Causal risk" design,
whose second DRO radius is computed here.

Choices:
- **Ladder outcomes.** Online load is split across ranks in proportion to their
  capacities, so every rank runs at the same fraction of its cap; the ladder's p99 is the
  worst rank's (a rank carrying ≥ 1% of requests sets the p99 if it breaches) and so is
  its breach probability — conservative on purpose: a predicted breach is a rank whose whole
  latency distribution may have shifted, and C3 gates *new* ladders on it. The running ladder's
  observed risk is instead its ranks' breach shares weighted by the traffic each is sent
  (:mod:`koi.evidence.observed`), because there the window measured each rank's share.
  Throughput is the served rate: min(λ, saturation) · osl for online, the sum of saturated
  replicas for batch. Cost per token and SLO margin come
  from :mod:`koi.outcomes`.
- **Unserved share.** Online: 1 − capacity/λ when the ladder's SLO-respecting capacity
  is short of the offered load; batch: 1 − throughput/required rate. 0 otherwise.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from koi import outcomes
from koi.domain.chain import Chain
from koi.domain.common import JobClass
from koi.domain.job import JobState
from koi.planning.context import PlanningContext
from koi.planning.demand import batch_remaining_tokens, batch_seconds_left
from koi.planning.options import RankSpec
from koi.scoring.risk import breach_probabilities, combine
from koi.scoring.switching import SwitchItem, switch_cost_items


@dataclass
class LadderEval:
    y: np.ndarray  # (L, 5) in OBJECTIVES order
    p_brk: np.ndarray
    unserved: np.ndarray
    served_tps: np.ndarray
    capacity_tps: np.ndarray
    price: np.ndarray  # $/hour
    #: p_brk at the widest causal radius ε(1 + κ) (koi.planning.candidates, "Causal risk"); None when off
    p_brk_hi: np.ndarray | None = None

    def rows(self, ix: np.ndarray | slice) -> LadderEval:
        """The evaluation of a subset of the ladders."""
        return LadderEval(self.y[ix], self.p_brk[ix], self.unserved[ix], self.served_tps[ix], self.capacity_tps[ix],
                          self.price[ix], None if self.p_brk_hi is None else self.p_brk_hi[ix])


def _residual_groups(ctx: PlanningContext, job, chains: list[Chain], objective: str) -> list[tuple[np.ndarray | None, np.ndarray]]:
    """Group rank indices by their residual history (same array → one vectorised breach call)."""
    if getattr(ctx.predictor, "residual_free", False):  # nothing learned yet: one cold group
        return [(None, np.arange(len(chains)))]
    by_chain: dict[tuple, tuple[np.ndarray | None, list[int]]] = {}
    cache: dict[tuple[int, int], tuple[np.ndarray | None, tuple]] = {}
    for i, c in enumerate(chains):
        ck = (id(c.env), id(c.config))  # environments and configs are shared objects within one pass
        hit = cache.get(ck)
        if hit is None:
            r = ctx.predictor.residuals(objective, job, c)
            r = None if r is None or len(r) == 0 else np.asarray(r, dtype=float)
            hit = cache[ck] = (r, ("cold",) if r is None else (r.tobytes(),))
        r, key = hit
        if key not in by_chain:
            by_chain[key] = (r, [])
        by_chain[key][1].append(i)
    return [(r, np.array(ix, dtype=int)) for r, ix in by_chain.values()]


def evaluate_ladders(
    js: JobState, ladders: Sequence[Sequence[RankSpec]], ctx: PlanningContext, now: float,
    startup_s: np.ndarray | float = 0.0,
) -> LadderEval:
    """Ŷ, p_brk and unserved share of each ladder of one job (vectorised; module docstring)."""
    job = js.job
    L = len(ladders)
    lad = np.array([i for i, lad_ in enumerate(ladders) for _ in lad_], dtype=int)
    ranks = [r for lad_ in ladders for r in lad_]
    if L == 0:
        z = np.zeros(0)
        return LadderEval(np.zeros((0, 5)), z, z, z, z, z)
    n = np.array([r.n for r in ranks], dtype=float)
    cap_rps = np.array([r.est.cap_rps for r in ranks])
    sat_rps = np.array([r.est.sat_rps for r in ranks])
    sat_tps = np.array([r.est.sat_tps for r in ranks])
    cap_tps = np.array([r.est.cap_tps for r in ranks])
    price = np.bincount(lad, weights=[r.price for r in ranks], minlength=L)
    unc = np.array([r.est.uncertainty for r in ranks])
    chains = [r.chain for r in ranks]
    osl = float(job.workload.osl)
    knobs = ctx.knobs
    # the radii: ε, and ε(1 + κ) when causal doubt can widen it (koi.planning.candidates, "Causal risk")
    causal = knobs.causal_risk > 0 and bool(ctx.exploration.mechanisms)
    radii = (knobs.eps, knobs.eps * (1.0 + knobs.causal_risk)) if causal else (knobs.eps,)
    startup = np.broadcast_to(np.asarray(startup_s, dtype=float), (L,))

    def lmax(v: np.ndarray) -> np.ndarray:
        out = np.full(L, -np.inf)
        np.maximum.at(out, lad, v)
        return out

    if job.job_class is JobClass.ONLINE:
        lam = job.workload.arrival.rate_rps
        cap_total = np.bincount(lad, weights=n * cap_rps, minlength=L)
        sat_total = np.bincount(lad, weights=n * sat_rps, minlength=L)
        # share the load by SLO capacity (by saturation when a ladder has none)
        share_base = np.where(cap_total[lad] > 0, cap_rps, sat_rps)
        denom = np.bincount(lad, weights=n * share_base, minlength=L)
        per_rep = np.where(denom[lad] > 0, lam * share_base / np.maximum(denom[lad], 1e-12), np.inf)
        ttft_r, tpot_r = ctx.predictor.latency(job, chains, per_rep)
        ttft, tpot = lmax(ttft_r), lmax(tpot_r)
        served = np.minimum(lam, sat_total) * osl
        capacity = cap_total * osl
        unserved = np.where(lam > 0, np.clip(1.0 - cap_total / max(lam, 1e-12), 0.0, 1.0), 0.0)
        margin = outcomes.online_slo_margin(ttft, tpot, job.slo.p99_ttft_ms, job.slo.p99_tpot_ms)
        p_rank = np.zeros((len(radii), len(ranks), 2))
        for col, (obj, vals, target) in enumerate(
            (("p99_ttft_ms", ttft_r, job.slo.p99_ttft_ms), ("p99_tpot_ms", tpot_r, job.slo.p99_tpot_ms))
        ):
            for res, ix in _residual_groups(ctx, job, chains, obj):
                ps = breach_probabilities(vals[ix], target, maximize=False, residuals=res, eps=radii,
                                          uncertainty=unc[ix])
                for k, p in enumerate(ps):
                    p_rank[k, ix, col] = p
        p_brks = [lmax(combine(p_rank[k], axis=1)) for k in range(len(radii))]
    else:
        thr = np.bincount(lad, weights=n * sat_tps, minlength=L)
        ttft = lmax(np.array([r.est.ttft_ms for r in ranks]))
        tpot = lmax(np.array([r.est.tpot_ms for r in ranks]))
        served = thr
        capacity = thr
        rem = batch_remaining_tokens(js)
        left = batch_seconds_left(js, now) - startup
        required = rem / np.maximum(left, ctx.switch.tick_s)  # demand_tps, vectorised over start-up times
        unserved = np.clip(1.0 - thr / np.maximum(required, 1e-12), 0.0, 1.0)
        margin = outcomes.batch_slo_margin(rem, np.maximum(left, 0.0), thr)
        # the ladder's throughput residuals: those of its first (largest) rank's chain
        first = np.array([np.flatnonzero(lad == i)[0] for i in range(L)])
        p_brks = [np.zeros(L) for _ in radii]
        lead_chains = [chains[k] for k in first]
        for res, ix in _residual_groups(ctx, job, lead_chains, "throughput_tokens_per_sec"):
            ps = breach_probabilities(thr[ix], required[ix], maximize=True, residuals=res, eps=radii,
                                      uncertainty=unc[first[ix]])
            for k, p in enumerate(ps):
                p_brks[k][ix] = p
    del cap_tps
    cost = outcomes.cost_per_token(price, served)
    y = np.column_stack([cost, ttft, tpot, served, margin])
    return LadderEval(y, p_brks[0], unserved, served, capacity, price, p_brks[1] if causal else None)


# ---- switching ----------------------------------------------------------------------------------
def _items(ranks: Sequence[RankSpec]) -> list[SwitchItem]:
    return [SwitchItem(r.key, r.n, r.cold_s, r.price_of) for r in ranks]


def switch_costs(current: Sequence[RankSpec] | None, ladders: Sequence[Sequence[RankSpec]], p_brk: np.ndarray,
                 ctx: PlanningContext) -> np.ndarray:
    """SwitchCost of each ladder against the running one (0 for a fresh placement)."""
    if not current:
        return np.zeros(len(ladders))
    old = _items(current)
    return np.array([switch_cost_items(old, _items(lad), float(p), ctx.switch).total
                     for lad, p in zip(ladders, p_brk, strict=True)])
