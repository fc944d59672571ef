"""Split ladders: one job's load over ranks in several pools (overview §2.6, "size_ladder";
the candidate generator's step 3, :mod:`koi.planning.candidates`).

A job whose best pool is short gets ladders that fill that pool and put the remainder on other
pools' chains. Two passes: over the *free* instances (plus, for an active job, the ones its
running ladder holds), and — for a pending job only — over *whole* pools, the reservation targets
for a job no single pool can carry in a full fleet (:func:`split_ladders`). An active job whose
running ladder breaches also gets *scale-out* ladders: that ladder unchanged plus one rank on
another pool's free instances (:func:`scale_out_ladders`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from koi.domain.chain import ChainConfig
from koi.domain.cluster import Pool
from koi.planning.capacity import instances_for, size_online
from koi.planning.context import PlanningContext
from koi.scoring.tchebycheff import reference_point, tchebycheff

if TYPE_CHECKING:
    from koi.planning.candidates import RankSpec


def ladder_key(ranks: Sequence[RankSpec]) -> str:
    """A ladder's identity among one job's candidates: its chains in their pools and replica counts."""
    return "+".join(sorted(f"{r.key}x{r.n}" for r in ranks))


@dataclass(frozen=True)
class SplitRows:
    """One job's scored (prototype, pool) rows, as the candidate generator holds them.

    ``proto_of[f]`` indexes ``protos`` (each with ``n``, ``instances``, ``config``, ``est``);
    ``y``/``p_brk`` are the rows' outcomes and breach probabilities as single-rank ladders;
    ``spec(f)`` builds row f's RankSpec.
    """

    proto_of: list[int]
    pool: list[Pool]
    pid: list[str]
    protos: list[Any]
    y: np.ndarray
    p_brk: np.ndarray
    spec: Callable[[int], RankSpec]


def row_scores(rows: SplitRows, ctx: PlanningContext, weights: np.ndarray) -> np.ndarray:
    """Each row's J − γ·p_brk as a single-rank ladder, against the rows' own reference point: how the
    split and scale-out builders rank chains before the ladders they build are evaluated."""
    z, rng = reference_point(rows.y).arrays()
    return tchebycheff(rows.y, weights, z, rng, ctx.knobs.rho) - ctx.knobs.gamma * rows.p_brk


def split_ladders(rows: SplitRows, ctx: PlanningContext, pools: Mapping[str, Pool], *, weights: np.ndarray,
                  online: bool, lam: float = 0.0, whole_pools: bool = False,
                  own: Mapping[str, int] | None = None) -> list[tuple[RankSpec, ...]]:
    """Fill the best pool's free capacity, put the remainder on the next-best chain in other pools.

    The ladder carries what its first prototype would: its headroom size (more replicas than
    the minimum, for risk) carries that many replicas' capacity; its minimum size carries the
    online demand ``lam`` (req/s) itself — that size was only rounded up to whole replicas of
    its own chain, which the other ranks need not repeat.

    ``own``: instances the job's running ladder holds per pool, free for its own swap (the
    selector counts a swap's usage net of the ladder it replaces): a split ladder that lost a
    spot node can be rebuilt on its remaining nodes plus the returned one.

    ``whole_pools``: fill pools up to their *total* instances instead. A pending job whose demand
    no single pool can carry (qwen3-235b at 6 req/s on hetero-3h: one MI300X pool holds four TP4
    replicas, a fifth is needed for the p99 TPOT) has no ladder that fits the fleet as it is *now*
    when it arrives in a full fleet; over whole pools it gets split ladders the selector can make
    room for with a reservation (selector, "Reservations") — C1 keeps them from being placed
    before that room exists.
    """
    e = ctx.enum
    rows_p, rows_pool, rows_pid, protos = rows.proto_of, rows.pool, rows.pid, rows.protos
    p_brk, row_spec = rows.p_brk, rows.spec
    F = len(rows_p)
    if e.hetero_top <= 0 or e.max_ranks < 2 or F == 0:
        return []
    # a ladder over whole pools has at most two ranks: every rank is a pool other jobs may have
    # to leave, and a rank that loses a node overloads the others (a reclaimed spot node of a
    # three-pool ladder left qwen3-235b at 15% on time on hetero-3h)
    max_ranks = min(e.max_ranks, 2) if whole_pools else e.max_ranks
    score = np.where(p_brk <= ctx.knobs.tau, row_scores(rows, ctx, weights), -np.inf)
    # every row, best first (rows over τ last): a filler carries part of the load only, so a
    # chain too small to carry the whole job within τ may still fill; first ranks need τ
    ranked = [int(i) for i in np.lexsort((np.arange(F), -np.nan_to_num(score, neginf=-1e300)))]
    own = own or {}
    free = {pid: (p.total_instances if whole_pools else p.free_instances + own.get(pid, 0))
            for pid, p in pools.items()}

    def fit_in(i: int, n: int) -> int:  # replicas of row i's chain that fit in what its pool has left
        pk, gpi = protos[rows_p[i]], rows_pool[i].gpus_per_instance
        while n > 0 and instances_for(pk.config.gpus, n, gpi) > free.get(rows_pid[i], 0):
            n -= 1
        return n

    def density(i: int) -> float:  # capacity per instance of row i's chain
        pk = protos[rows_p[i]]
        return (pk.est.cap_tps if online else pk.est.sat_tps) * pk.n / max(pk.instances, 1)

    seen: set[tuple[str, ChainConfig]] = set()
    firsts = []  # the first rank: the best rows whose pool is short, one per (pool, config)
    fillers: dict[str, int] = {}  # the remainder: the best row of every pool
    for i in ranked:
        k = (rows_pid[i], protos[rows_p[i]].config)
        n = protos[rows_p[i]].n
        first_ok = bool(np.isfinite(score[i]))
        # a first rank must carry its share of the ladder (≥ 1/max_ranks of it), or no split of
        # at most max_ranks ranks can cover the rest
        if (first_ok and k not in seen and protos[rows_p[i]].instances > free.get(rows_pid[i], 0)
                and fit_in(i, n) * max_ranks >= n):
            seen.add(k)
            firsts.append(i)
        if whole_pools:  # covering a remainder: the chain that carries most per instance
            j = fillers.get(rows_pid[i])
            if j is None or density(i) > density(j) + 1e-9:
                fillers[rows_pid[i]] = i
        else:
            fillers.setdefault(rows_pid[i], i)
    # free capacity: the best pools first (score order); whole pools: the densest first, so the
    # remainder lands on as few instances (and ranks) as possible
    pos = {i: n for n, i in enumerate(ranked)}
    filler_rows = sorted(fillers.values(), key=(lambda i: (-density(i), pos[i])) if whole_pools else pos.__getitem__)
    short: set[str] = set()  # ladders that keep only part of their headroom (whole pools)

    def build(i: int, fill: list[int]) -> tuple[RankSpec, ...] | None:
        p0 = protos[rows_p[i]]
        need = p0.n * (p0.est.cap_tps if online else p0.est.sat_tps)
        # what may stay uncovered: nothing, except that a headroom-sized ladder over whole pools,
        # for a job whose first pool cannot hold even the chain's minimum size (the split is
        # needed, not a choice), may keep the part of its headroom its (at most two) pools cannot
        # hold, as long as it carries the demand itself (C3 then judges whether what is left is enough)
        slack = 0.0
        if online and lam > 0:
            demand = lam * p0.est.cap_tps / max(p0.est.cap_rps, 1e-12)
            n_min = size_online(lam, p0.est.cap_rps)
            if p0.n == n_min:
                need = min(need, demand)
            elif whole_pools and fit_in(i, n_min) < n_min:
                slack = max(need - demand, 0.0)
        ranks: list[RankSpec] = []
        left = dict(free)
        used: set[str] = set()
        for k in [i, *fill]:
            if need <= 1e-9 or len(ranks) >= max_ranks:
                break
            pool, pid, pk = rows_pool[k], rows_pid[k], protos[rows_p[k]]
            if pid in used or left.get(pid, 0) <= 0:
                continue
            rate = pk.est.cap_tps if online else pk.est.sat_tps
            if rate <= 0:
                continue
            fit = math.ceil(need / rate - 1e-9)
            while fit > 0 and instances_for(pk.config.gpus, fit, pool.gpus_per_instance) > left[pid]:
                fit -= 1
            if fit <= 0:
                continue
            spec = row_spec(k).with_n(fit)
            ranks.append(spec)
            used.add(pid)
            left[pid] -= spec.instances
            need -= fit * rate
        if len(ranks) < 2 or need > slack + 1e-9:
            return None
        if need > 1e-9:
            short.add(ladder_key(ranks))
        return tuple(ranks)

    out: dict[str, tuple[RankSpec, ...]] = {}
    if not whole_pools:
        # the best ``hetero_top`` split ladders that cover the demand, from at most 4× as many
        # tries (a first rank whose remainder needs more than ``max_ranks`` pools yields none)
        for i in firsts[:4 * e.hetero_top]:
            if len(out) >= e.hetero_top:
                break
            lad = build(i, filler_rows)
            if lad is not None:
                out.setdefault(ladder_key(lad), lad)
        return [out[k] for k in sorted(out)]
    # whole pools: ladders a reservation must make room for, so the smallest footprints win; each
    # first rank is tried with every pool as its first filler (the rest densest first), since the
    # densest remainder pool may be the one every other job needs
    for i in firsts[:4 * e.hetero_top]:
        for j in range(len(filler_rows)):
            lad = build(i, [filler_rows[j], *filler_rows[:j], *filler_rows[j + 1:]])
            # one that fits the free instances now is the free-capacity pass's business, unless it
            # keeps only part of its headroom: that pass never builds those, and a reservation that
            # made room for one last tick must find it again once the room is free
            if lad is not None and (ladder_key(lad) in short
                                    or any(r.instances > pools[r.pool_id].free_instances for r in lad)):
                out.setdefault(ladder_key(lad), lad)
    # (3 × hetero_top of them: the tightest may fail C3 once evaluated)
    best = sorted(out, key=lambda k: (sum(r.instances * r.gpus_per_instance for r in out[k]), k))
    return [out[k] for k in sorted(best[:3 * e.hetero_top])]


def scale_out_ladders(rows: SplitRows, ctx: PlanningContext, current: Sequence[RankSpec], *,
                      weights: np.ndarray, online: bool, share: float) -> list[tuple[RankSpec, ...]]:
    """The running ladder unchanged plus one rank on another pool's free instances (module docstring).

    Why: a running ladder that breaches (an engine update slowed its GPU; the model has not caught
    up) is repaired by the planner's other ladders only by rebuilding it, and where its own pool is
    full that rebuild is in place — the job goes dark for a cold start (:mod:`koi.planning.transition`)
    — while split ladders need a first rank that meets τ on its own. An operator adds capacity
    next to what runs. These ladders do: the running ranks keep serving (no gap; SwitchCost pays
    only for the added rank), and the new rank takes its share of the traffic once warm.

    Sizing: the added rank carries ``share`` × the running ladder's capacity (per-replica SLO
    capacity for online jobs, saturation throughput for batch), the headroom step of online sizing
    (n_min + ⌊n_min/2⌋), as many replicas of the pool's best chain as that takes, capped at the
    pool's free instances; a rank that would carry less than half of it is not offered. One ladder
    per other pool, its best-scoring chain; the ``hetero_top`` best by that score (ties: pool id).
    Only while the running ladder has fewer than ``max_ranks`` ranks.
    """
    e = ctx.enum
    F = len(rows.proto_of)
    if not current or F == 0 or share <= 0 or len(current) >= e.max_ranks or e.hetero_top <= 0:
        return []
    cap = sum(r.n * (r.est.cap_tps if online else r.est.sat_tps) for r in current)
    extra = share * cap
    if extra <= 0:
        return []
    score = row_scores(rows, ctx, weights)
    busy = {r.pool_id for r in current}
    best: dict[str, int] = {}  # pool -> its best row (score, then enumeration order)
    for f in range(F):
        pid = rows.pid[f]
        if pid in busy or rows.pool[f].free_instances <= 0:
            continue
        pk = rows.protos[rows.proto_of[f]]
        if (pk.est.cap_tps if online else pk.est.sat_tps) <= 0:
            continue
        b = best.get(pid)
        if b is None or score[f] > score[b] + 1e-12:
            best[pid] = f
    out: list[tuple[float, str, tuple[RankSpec, ...]]] = []
    for pid, f in best.items():
        pool, pk = rows.pool[f], rows.protos[rows.proto_of[f]]
        rate = pk.est.cap_tps if online else pk.est.sat_tps
        n = math.ceil(extra / rate - 1e-9)
        while n > 0 and instances_for(pk.config.gpus, n, pool.gpus_per_instance) > pool.free_instances:
            n -= 1
        if n <= 0 or n * rate < 0.5 * extra:
            continue
        out.append((float(score[f]), pid, (*current, rows.spec(f).with_n(n))))
    out.sort(key=lambda t: (-t[0], t[1]))
    return [lad for _, _, lad in out[:e.hetero_top]]
