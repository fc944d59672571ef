"""Capacity accounting in whole instances (C1), shared by the selector, validation and baselines.

Choices where the spec is vague:
- **Packing.** A chain of g GPUs on instances of G GPUs: when g ≤ G, ⌊G/g⌋ replicas
  share one instance (a TP2 replica uses a quarter of an 8-GPU node); when g > G the
  chain spans ⌈g/G⌉ instances (pipeline stages across nodes). Ranks of different jobs,
  and different ranks of one job, never share an instance (the executor launches per rank).
- **Pool of a rank.** The pool (environment, instance type) named by the rank; a rank
  without ``instance_type`` takes the pool of its environment with the smallest instance
  that holds one chain (else the largest), by instance type name on ties.
- **What a swap needs (A/B overlap).** A swap brings the new ladder up while the old one
  still serves, so in a pool the old ladder does not use, the new ranks need free
  instances and the old ranks' instances are released only after the overlap — not
  usable by other jobs this tick. In a pool both use, the new ladder replaces the old
  in place (rolling): it needs only the difference, and a smaller new ladder returns the
  difference. Terminate and preempt release their instances at once.
- **What a running rank holds.** A rank's deployment names the replicas the plan asked for
  (``rank.n_replicas``), but a *degraded* one (the world reports it so only when nothing is
  booting) holds instances for its ready replicas only: a reclaimed or failed instance is
  gone from the pool and a replica that failed to materialise released its instances (the
  snapshot's ``free_instances`` already reflect both). :func:`held_replicas` is that count,
  and the selector's running ladder (``CandidateGenerator.current_specs``), C1's swap and
  release credits (:meth:`PoolIndex.held_usage`) and S6's scale operations
  (``koi.pipeline.deploy.plan_ops``) all use it, so all three count what the executor will
  allocate. ``instances_for`` of the ready replicas is a lower bound on the instances they
  occupy (two of four TP4 replicas lost from different nodes still hold both nodes), so the
  model errs on needing more, never less. Counting the requested size instead made a
  degraded rank's scale-up look one node cheaper than the executor's: at tick 122 of
  hetero-12h (seed 0) a 3→6 scale of a TP4 rank holding one H100 node (3 asked, 2 ready
  since a spot reclaim at tick 61) took both free nodes, where S6 had planned one, and
  the launch it had placed beside it was refused (``no free capacity``): keep-all.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping

from koi.domain.chain import Ladder, Rank
from koi.domain.cluster import Deployment, DeploymentState, Pool, ResourceMap
from koi.domain.common import Market


def instances_for(gpus_per_chain: int, n_replicas: int, gpus_per_instance: int) -> int:
    g, G = max(gpus_per_chain, 1), max(gpus_per_instance, 1)
    if g <= G:
        return math.ceil(n_replicas / (G // g))
    return n_replicas * math.ceil(g / G)


def filled_replicas(gpus_per_chain: int, n_replicas: int, gpus_per_instance: int) -> int:
    """The replicas the instances of ``n_replicas`` hold when every one is full: ⌈n/k⌉·k with k = ⌊G/g⌋
    replicas per instance; n itself when a replica spans whole instances (g ≥ G) or n ≤ 0. The slots
    beyond n are paid for (instances are billed whole) and idle."""
    g, G = max(gpus_per_chain, 1), max(gpus_per_instance, 1)
    if n_replicas <= 0 or g >= G:
        return n_replicas
    k = G // g
    return math.ceil(n_replicas / k) * k


def held_replicas(d: Deployment) -> int:
    """Replicas a running rank holds instances for (module docstring, "What a running rank
    holds"): a degraded rank's ready replicas, else the replicas it was asked for."""
    if d.state is DeploymentState.DEGRADED:
        return max(min(d.replicas_ready, d.rank.n_replicas), 0)
    return d.rank.n_replicas


class PoolIndex:
    """Fast lookups over a ResourceMap: pool by id, by (env, instance), default pool of an env."""

    def __init__(self, resources: ResourceMap) -> None:
        self.resources = resources
        self.by_id: dict[str, Pool] = {p.pool_id: p for p in resources.pools}
        self.by_env: dict[str, list[Pool]] = defaultdict(list)
        for p in sorted(resources.pools, key=lambda p: p.pool_id):
            self.by_env[p.env.env_id].append(p)

    def pool_of(self, rank: Rank) -> Pool | None:
        pools = self.by_env.get(rank.env.env_id, [])
        if rank.config.instance_type:
            for p in pools:
                if p.instance_type == rank.config.instance_type:
                    return p
            return None
        if not pools:
            return None
        g = rank.config.gpus
        fits = [p for p in pools if p.gpus_per_instance >= g]
        if fits:
            return min(fits, key=lambda p: (p.gpus_per_instance, p.instance_type))
        return max(pools, key=lambda p: (p.gpus_per_instance, p.instance_type))

    def rank_instances(self, rank: Rank) -> tuple[str | None, int]:
        p = self.pool_of(rank)
        if p is None:
            return None, 0
        return p.pool_id, instances_for(rank.config.gpus, rank.n_replicas, p.gpus_per_instance)

    def rank_price(self, rank: Rank) -> float:
        """$/hour of a rank: its instances at the pool's price (0 when the pool is unknown)."""
        p = self.pool_of(rank)
        if p is None:
            return 0.0
        return instances_for(rank.config.gpus, rank.n_replicas, p.gpus_per_instance) * p.hourly_price

    def ladder_usage(self, ladder: Ladder | None) -> dict[str, int]:
        """Instances per pool of a ladder (ranks on one pool add up)."""
        out: dict[str, int] = defaultdict(int)
        if ladder is None:
            return {}
        for r in ladder.ranks:
            pid, k = self.rank_instances(r)
            if pid is not None:
                out[pid] += k
        return dict(out)

    def held_usage(self, deployments: Iterable[Deployment]) -> dict[str, int]:
        """Instances per pool the live ``deployments`` hold (:func:`held_replicas`): what a swap
        reuses in place and what a preemption or termination gives back."""
        out: dict[str, int] = defaultdict(int)
        for d in deployments:
            if not d.is_live:
                continue
            p = self.pool_of(d.rank)
            if p is not None:
                out[p.pool_id] += instances_for(d.rank.config.gpus, held_replicas(d), p.gpus_per_instance)
        return dict(out)

    def ladder_price(self, ladder: Ladder | None) -> float:
        return 0.0 if ladder is None else sum(self.rank_price(r) for r in ladder.ranks)


def planning_price(pool: Pool, committed_share: float, own: int = 0) -> float:
    """$/hour per instance of ``pool`` as the planner weighs it: the list price, except idle committed capacity.

    A reserved instance is paid for whether it serves or idles (the fleet's cost counts idle reserved
    capacity, and so does the evaluator's cost per SLO token, :mod:`koi.bench.evaluator`). What placing
    a rank on one costs the fleet is therefore not its price but its *opportunity cost*: the value of
    the other jobs that would have used it. Priced at its commitment rate (60% of on-demand) a reserved
    GPU looks dearer than a spot one: on hetero-3h (seed 0) 24 of the 32 reserved A100-80GB sat idle
    from the second hour to the end under Koi and the rolling MILP alike, while other jobs paid
    on-demand and spot prices. Priced flat at a fraction of its list (``7a2c0f1``, reverted) it filled
    with over-provisioned ladders where every job could use it (homo-12h, one GPU type: the jobs the
    near-free reserved H100s no longer held went on demand, +$4.5k a run for Koi and the MILP alike).

    Choice where the spec is silent: the opportunity cost is estimated by how much of the pool *other*
    jobs hold at the start of the tick, u = (total − free − own) / total — the chance that an instance
    is one another job wants — and the planner prices a reserved instance at list × (s + (1 − s)·u),
    s = ``committed_share`` (:class:`koi.scoring.params.PlanningKnobs`). A pool full of other jobs is
    priced at its list price (nothing changes where committed capacity is contended), an idle one at
    s of it (not 0: the cost objective is normalised by the cheapest candidate's cost,
    :mod:`koi.scoring.tchebycheff`, and reserved options still rank among themselves by size), and as
    other jobs move onto a pool its price rises, so it fills only while it is the better buy. The
    job's *own* instances are not counted: they signal no other job's demand, and counting them
    priced a job's running ladder at list once it had filled the pool, so it moved to spot, the pool
    emptied and the next job moved on (homo-12h, the rolling MILP: 40–71 swaps a run against 32, and
    more reserved capacity idle, not less). On-demand and spot capacity is bought for as long as it
    runs and is planned at its list price. What the fleet is billed is unchanged.
    """
    if pool.env.market != Market.RESERVED or pool.total_instances <= 0:
        return pool.hourly_price
    used = min(max((pool.total_instances - pool.free_instances - own) / pool.total_instances, 0.0), 1.0)
    return pool.hourly_price * (committed_share + (1.0 - committed_share) * used)


class PlanningPrices:
    """:func:`planning_price` of each pool as each job weighs it, for one snapshot (a job's own held
    instances computed once). Priced on the snapshot's pool: a budget slice's copy may show fewer free
    instances."""

    def __init__(self, pools: PoolIndex, deployments: Iterable[Deployment], committed_share: float) -> None:
        self.pools, self.share = pools, committed_share
        self._deps = [d for d in deployments if d.is_live]
        self._own: dict[str, dict[str, int]] = {}

    def unit(self, pid: str, pool: Pool, job_id: str) -> float:
        """$/h per instance of pool ``pid`` to ``job_id``'s plan (``pool.hourly_price`` when it is not the snapshot's)."""
        snap = self.pools.by_id.get(pid)
        if snap is None:
            return pool.hourly_price
        own = self._own.get(job_id)
        if own is None:
            own = self._own[job_id] = self.pools.held_usage(d for d in self._deps if d.job_id == job_id)
        return planning_price(snap, self.share, own.get(pid, 0))


def swap_delta(new_usage: Mapping[str, int], old_usage: Mapping[str, int]) -> dict[str, int]:
    """Net instances a swap needs per pool (module docstring): new in pools the old ladder
    does not use; new − old (possibly negative) in pools both use; 0 for pools only the old uses."""
    out: dict[str, int] = {}
    for pid, k in new_usage.items():
        out[pid] = k - old_usage.get(pid, 0)
    return out


def gpus_by_type(ladder: Ladder | None) -> dict[str, int]:
    out: dict[str, int] = defaultdict(int)
    if ladder is not None:
        for r in ladder.ranks:
            out[r.env.gpu_type] += r.gpus
    return dict(out)


def add_usage(total: dict[str, int], usage: Iterable[tuple[str, int]], sign: int = 1) -> None:
    for pid, k in usage:
        total[pid] = total.get(pid, 0) + sign * k


def size_online(rate_rps: float, cap_rps: float) -> int:
    """n_min = ⌈λ / capacity per replica⌉ (0 capacity → 0: the chain is rejected)."""
    if cap_rps <= 0:
        return 0
    return max(1, math.ceil(rate_rps / cap_rps - 1e-9))
