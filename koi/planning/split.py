"""Split ladders: one job's load over ranks in several pools (overview §2.6, "size_ladder";
the candidate generator's step 3, :mod:`koi.planning.candidates`).

A job whose best pool is short gets ladders that fill that pool and put the remainder on other
pools' chains. Two passes: over the *free* instances (plus, for an active job, the ones its
running ladder holds), and — for a pending job only — over *whole* pools, the reservation targets
for a job no single pool can carry in a full fleet (:func:`split_ladders`). An active job whose
running ladder breaches also gets *scale-out* ladders: that ladder with one rank grown or one rank
added, on free instances and — as reservation targets — on whole pools (:func:`scale_out_ladders`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from koi.domain.chain import ChainConfig
from koi.domain.cluster import Pool
from koi.domain.common import Market
from koi.planning.capacity import filled_replicas, instances_for, size_online
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
                      weights: np.ndarray, online: bool, share: float, demand_tps: float = 0.0,
                      pools: Mapping[str, Pool] | None = None, whole_pools: bool = False,
                      ) -> list[tuple[RankSpec, ...]]:
    """The running ladder plus capacity next to it: one rank grown on its own pool's free instances,
    or one new rank on another pool's (module docstring).

    Why: a running ladder that breaches (an engine update slowed its GPU; the model has not caught
    up; a replica was lost) is repaired by the planner's other ladders only by rebuilding it, and
    where its own pool is full that rebuild is in place — the job goes dark for a cold start
    (:mod:`koi.planning.transition`) — while split ladders need a first rank that meets τ on its
    own. An operator adds capacity next to what runs. These ladders do: the running ranks keep
    serving (no gap; SwitchCost pays only for the replicas added), and the new ones take their
    share of the traffic once warm.

    Sizing: the added capacity targets ``share`` × the running ladder's capacity (per-replica SLO
    capacity for online jobs, saturation throughput for batch), the headroom step of online sizing
    (n_min + ⌊n_min/2⌋), capped at the pool's free instances. Two kinds:

    - **grow**: a running rank with more replicas of its own chain where its pool has free
      instances (a degraded rank's lost replicas are free again once its pool has them back: growing
      it to its planned size is S6's "recover"), or where its own instances have idle slots — in a
      full pool too, and whatever the floor below, since those replicas cost nothing (instances are
      billed whole). One ladder per running rank.
    - **add**: one new rank on another pool, that pool's best-scoring chain whose replicas clear the
      floor below (the next chain when the best one's replicas are too big for the free
      instances). The ``hetero_top`` best pools by that score (ties: pool id), while the running
      ladder has fewer than ``max_ranks`` ranks.

    ``whole_pools``: the room is a pool's whole size (less what this job holds there), not its free
    instances — the targets of a reservation ("keep now, swap next tick", :mod:`koi.planning.selector`)
    when the pools next to the running ladder are full: another job must move first, and only the
    selector sees which can. Without them a breaching job in a full fleet had no option at all (on
    homo-12h, Koi, seed 1: agent-235b at eleven of twelve TP8 replicas after a spot reclaim met 85% of
    its requests for 40 ticks, every 8-GPU pool full).

    The floor: what is added must carry half the target, or — when the running ladder's capacity
    is short of the demand — at least that shortfall. Choice: the half-target floor alone kept
    small, sufficient repairs out: on homo-12h (Koi, seed 1) agent-235b lost one of its twelve
    TP8 replicas to a pool outage; three free instances in another pool would have covered the
    1.2k tok/s it lacked but carried less than half of the 7.3k target, so the job had no option
    but its breaching ladder for 23 ticks (it met 67–95% of its requests; the lost replica's
    instance came back after 12 ticks and another job took it). Candidates that clear the floor
    but not C3 are dropped by the generator as any other.

    Idle slots. A rank sized to its point, or shrunk, can leave slots of its last instance empty (five
    TP2 replicas hold two 8-GPU nodes). On hetero-12h (Koi, seed 0, tick 80) rag-70b's H200 rank was
    scaled in from 8 TP2 replicas to 5 on the same two nodes; the model gave 5 enough capacity, the
    rank's queue grew past it and the job breached its p99 TPOT in every window for 42 ticks
    (observed risk 0.57), while the pool was full and no repair was offered: a grow needed a free
    instance. Now the grow into the three idle slots is an option. Choice, measured on hetero-3h (Koi,
    seeds 0–5): the grow alone −0.04 (level; hetero-12h seeds 0–3 −0.01, rag-70b's p99 windows 86.5%
    → 95.0%); with scale-ins that free whole instances only, −0.11; filling *every* rank the generator
    proposes to its instances (the sizing points, split, scale-out and rehomed ranks) −1.24 and $147 a
    run more — better-latency ladders on the same footprint re-ranked the jobs' J and moved agent-235b
    off reserved capacity.
    """
    e = ctx.enum
    F = len(rows.proto_of)
    if not current or share <= 0 or e.hetero_top <= 0:
        return []
    cap = sum(r.n * (r.est.cap_tps if online else r.est.sat_tps) for r in current)
    extra = share * cap
    if extra <= 0:
        return []
    short = demand_tps - cap
    floor = min(0.5 * extra, short) if short > 0 else 0.5 * extra

    def replicas(rate: float, gpus: int, gpi: int, free: int, base: int = 0) -> int:
        """Replicas to add (up to the target) whose instances beyond ``base`` replicas fit in ``free``; the
        floor does not bind replicas that take no new instance (the rank's idle slots: free capacity)."""
        n = math.ceil(extra / rate - 1e-9)
        held = instances_for(gpus, base, gpi) if base else 0
        while n > 0 and instances_for(gpus, base + n, gpi) - held > free:
            n -= 1
        return n if n > 0 and (n * rate >= floor or instances_for(gpus, base + n, gpi) <= held) else 0

    own: dict[str, int] = {}
    for r in current:
        own[r.pool_id] = own.get(r.pool_id, 0) + r.instances

    def room(pool: Pool, pid: str) -> int:
        return pool.total_instances - own.get(pid, 0) if whole_pools else pool.free_instances

    out: list[tuple[RankSpec, ...]] = []
    for i, r in enumerate(current):  # grow
        pool = (pools or {}).get(r.pool_id)
        rate = r.est.cap_tps if online else r.est.sat_tps
        idle = filled_replicas(r.config.gpus, r.n, r.gpus_per_instance) > r.n  # paid-for slots it leaves empty
        if pool is None or (room(pool, r.pool_id) <= 0 and not idle) or rate <= 0:
            continue
        k = replicas(rate, r.config.gpus, r.gpus_per_instance, max(room(pool, r.pool_id), 0), base=r.n)
        if k:
            out.append((*current[:i], r.with_n(r.n + k), *current[i + 1:]))
    if F == 0 or len(current) >= e.max_ranks:
        return out
    score = row_scores(rows, ctx, weights)
    busy = {r.pool_id for r in current}
    by_pool: dict[str, list[int]] = {}
    for f in range(F):
        pid = rows.pid[f]
        if pid in busy or room(rows.pool[f], pid) <= 0:
            continue
        pk = rows.protos[rows.proto_of[f]]
        if (pk.est.cap_tps if online else pk.est.sat_tps) > 0:
            by_pool.setdefault(pid, []).append(f)
    added: list[tuple[float, str, tuple[RankSpec, ...]]] = []
    for pid, fs in by_pool.items():
        for f in sorted(fs, key=lambda f: (-score[f], f)):  # the pool's best chain that clears the floor
            pool, pk = rows.pool[f], rows.protos[rows.proto_of[f]]
            n = replicas(pk.est.cap_tps if online else pk.est.sat_tps, pk.config.gpus, pool.gpus_per_instance,
                         room(pool, pid))
            if n:
                added.append((float(score[f]), pid, (*current, rows.spec(f).with_n(n))))
                break
    added.sort(key=lambda t: (-t[0], t[1]))
    return out + [lad for _, _, lad in added[:e.hetero_top]]


def scale_in_ladders(current: Sequence[RankSpec], *, demand_tps: float, headroom: float,
                     settling: Sequence[bool] = ()) -> list[tuple[RankSpec, ...]]:
    """The running online ladder with one rank shrunk: the mirror of :func:`scale_out_ladders`.

    Why: capacity added next to a running ladder (a scale-out, a grown rank) stayed until a full
    rebuild, which pays a cold start and, in a full pool, a gap; so a repair bought for a transient
    breach was held for the rest of the run. On hetero-3h (Koi, seed 0) the scale-out and repair
    options alone added 6–12% GPU-ticks for 0.2% more SLO tokens. A scale-in keeps every chain where
    it runs and gives replicas back: SwitchCost is a drain, there is no gap, and S6 scales the rank in.

    Sizing: per rank, the fewest replicas that keep the ladder's SLO capacity (per-replica capacity
    under the p99 targets and the 0.8 utilisation cap, as online sizing) at the demand — the n_min
    point — and at demand × (1 + ``headroom``), the headroom point; a rank of a multi-rank ladder
    may go entirely. Nothing when every replica is needed at the n_min point. A rank flagged in
    ``settling`` (launched inside the settle window, :func:`sheds_settling`) is not shrunk.
    The selector takes one when the cost it saves outweighs the risk it adds (J, γ·p_brk), and C3
    drops one that would breach.
    """
    rates = [r.est.cap_tps for r in current]
    total = sum(r.n * x for r, x in zip(current, rates, strict=True))
    out: dict[str, tuple[RankSpec, ...]] = {}
    for target in (demand_tps, demand_tps * (1.0 + headroom)):
        spare = total - target
        if demand_tps <= 0 or spare <= 0:
            continue
        for i, (r, rate) in enumerate(zip(current, rates, strict=True)):
            if rate <= 0 or (i < len(settling) and settling[i]):
                continue
            k = min(int(spare // rate), r.n if len(current) > 1 else r.n - 1)
            if k <= 0:
                continue
            lad = (*current[:i], *((r.with_n(r.n - k),) if k < r.n else ()), *current[i + 1:])
            out.setdefault(ladder_key(lad), lad)
    return [out[k] for k in sorted(out)]


def sheds_settling(current: Sequence[RankSpec], ladders: Sequence[Sequence[RankSpec]], settling: Sequence[bool],
                   *, healthy: bool) -> np.ndarray:
    """Which ``ladders`` take replicas from a settling rank of ``current`` (a rank launched inside the settle
    window): fewer of them, or none, in its pool on its chain config. Such ladders are not options this tick
    while the running ladder is ``healthy`` (within C3, nothing unserved); when it breaches or falls short,
    any ladder may replace it (a repair) except a pure scale-in — every rank already running, none grown —
    which only removes capacity.

    Why (a stabilisation window, as Kubernetes' HPA keeps one for scale-down, 300 s by default): a rank is
    bought with a cold start, and one tick later — still warming or just warm, its own windows unread — the
    surrogate's J may prefer another ladder by a margin inside its own error, so the rank went again and a
    later breach bought capacity back with another cold start. On hetero-3h (Koi, seeds 0–11, at ``b82ce70``)
    holding a new rank the tick after its launch unless the running ladder breaches gave +0.21 ± 0.10 composite (8 of 12) at
    4% fewer dollars and 4 fewer swaps a run; homo-12h (seeds 0–2, −0.12 ± 0.22) and hetero-12h (seeds 0–1,
    −0.04 ± 0.32) level. Holding it against pure scale-ins alone did worse (hetero-3h seeds 0–5 −0.17 ± 0.15,
    8 more swaps a run): the selector reached the same capacity by a rebuild, a cold start for every replica.
    Holding it two ticks did worse than one (hetero-3h seeds 0–5 −0.49 ± 0.31): the default is one tick.
    """
    out = np.zeros(len(ladders), dtype=bool)
    if not current or not any(settling):
        return out
    held = {(r.pool_id, r.config): r.n for r in current}
    young = {(r.pool_id, r.config) for r, s in zip(current, settling, strict=False) if s}
    for i, lad in enumerate(ladders):
        has: dict[tuple[str, ChainConfig], int] = {}
        for r in lad:
            has[(r.pool_id, r.config)] = has.get((r.pool_id, r.config), 0) + r.n
        if not healthy and any(k not in held or n > held[k] for k, n in has.items()):
            continue  # a repair that adds or grows something
        out[i] = any(has.get(k, 0) < held[k] for k in young)
    return out


def rehome_ladders(rows: SplitRows, current: Sequence[RankSpec], *, top: int) -> list[tuple[RankSpec, ...]]:
    """The running ladder with one rank's replicas moved, chain unchanged, to free reserved instances of the
    same GPU type that are cheaper at their planning price: what an operator does when committed capacity
    falls idle.

    Why: the generator's other options for a healthy job rebuild its whole ladder (a cold start for every
    replica, in a full pool a gap) or shrink it; none moves a rank. When a reserved instance is freed (a
    job leaves, a ladder scales in) it is paid for whether it serves or idles, but the job whose
    on-demand or spot rank could run there had only a rebuild to reach it: on hetero-3h (seed 0, at
    ``8e6ff55``) a reserved H100 instance sat idle for the last ten ticks while agent-235b held an
    on-demand H100 instance of the same chain, and Koi left $89 a run of reserved capacity idle (six
    seeds) against the oracle's $53.

    A rehome moves as many replicas of one running rank as the reserved pool's free instances hold, to
    that pool's row of the same chain config (instance shape aside), when the pool's planning price per
    GPU (:func:`koi.planning.capacity.planning_price`: a fifth of list when idle, 0.6 when half held by
    other jobs) is below the rank's. The running replicas serve until the moved ones are warm; SwitchCost
    pays the moved replicas' cold start; J and C3 judge the rest as for any ladder. The ``top`` moves
    saving the most dollars an hour (ties: ladder key). Choice: reserved targets only. Spot and
    on-demand targets at half the price per GPU or less were measured too (same hetero-3h runs +0.15 ±
    0.10 for Koi; homo-12h, one GPU type over every market, −1.14 on seed 1): a move onto spot buys a
    reclaim the planner does not price, and on homo-12h rag-70b swapped 25–39 times a run against 19.5.
    """
    F = len(rows.proto_of)
    if not current or F == 0 or top <= 0:
        return []
    held = {r.pool_id for r in current}
    moves: list[tuple[float, str, tuple[RankSpec, ...]]] = []
    for i, r in enumerate(current):
        per_gpu = r.unit_price / r.gpus_per_instance
        shape = r.config.model_copy(update={"instance_type": None})
        for f in range(F):
            pool, pid = rows.pool[f], rows.pid[f]
            if (pid in held or pool.free_instances <= 0 or pool.env.market is not Market.RESERVED
                    or pool.env.gpu_type != r.env.gpu_type):
                continue
            if rows.protos[rows.proto_of[f]].config.model_copy(update={"instance_type": None}) != shape:
                continue
            spec = rows.spec(f)
            if spec.unit_price / spec.gpus_per_instance >= per_gpu:
                continue
            k = r.n
            while k > 0 and instances_for(r.config.gpus, k, spec.gpus_per_instance) > pool.free_instances:
                k -= 1
            if k <= 0 or (len(current) == 1 and k == r.n and any(  # the whole ladder moved: a rebuild row offers it
                    rows.pid[g] == pid and rows.protos[rows.proto_of[g]].n == k
                    and rows.protos[rows.proto_of[g]].config == rows.protos[rows.proto_of[f]].config for g in range(F))):
                continue
            moved = spec.with_n(k)
            rest = (r.with_n(r.n - k),) if k < r.n else ()
            lad = (*current[:i], *rest, *current[i + 1:], moved)
            moves.append((r.price - sum(x.price for x in rest) - moved.price, ladder_key(lad), lad))
    moves.sort(key=lambda t: (-t[0], t[1]))
    seen: set[str] = set()
    out: list[tuple[RankSpec, ...]] = []
    for _, key, lad in moves:
        if key not in seen and len(out) < top:
            seen.add(key)
            out.append(lad)
    return out


def running_moves(rows: SplitRows, ctx: PlanningContext, current: Sequence[RankSpec], *, pools: Mapping[str, Pool],
                  weights: np.ndarray, online: bool, demand_tps: float, breaching: bool,
                  known: set[str], settling: Sequence[bool] = ()) -> list[tuple[RankSpec, ...]]:
    """An active job's ladders built from its running one, none already in ``known`` (ladder keys):
    scale-out when it breaches (free instances first, then whole pools for a reservation), scale-in for
    an online job (never shrinking a ``settling`` rank), rehome (each gated by its
    :class:`~koi.planning.context.EnumerationParams` knob)."""
    e = ctx.enum
    seen = set(known)
    out: list[tuple[RankSpec, ...]] = []

    def take(ladders: list[tuple[RankSpec, ...]]) -> None:
        for lad in ladders:
            if (k := ladder_key(lad)) not in seen:
                seen.add(k)
                out.append(lad)

    if breaching and e.scale_out_share > 0:
        for whole in (False, True):  # free instances first; then whole pools, for a reservation
            take(scale_out_ladders(rows, ctx, current, weights=weights, online=online, share=e.scale_out_share,
                                   demand_tps=demand_tps, pools=pools, whole_pools=whole))
    if online and e.scale_in:
        if len(current) == 1:  # a single-pool row of the running chain may already be the same ladder
            seen |= {ladder_key((rows.spec(f),)) for f in range(len(rows.proto_of))
                     if rows.pid[f] == current[0].pool_id and rows.protos[rows.proto_of[f]].config == current[0].config}
        take(scale_in_ladders(current, demand_tps=demand_tps, headroom=e.scale_out_share, settling=settling))
    if e.rehome:
        take(rehome_ladders(rows, current, top=e.hetero_top))
    return out
