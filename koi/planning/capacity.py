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


def instances_for(gpus_per_chain: int, n_replicas: int, gpus_per_instance: int) -> int:
    g, G = max(gpus_per_chain, 1), max(gpus_per_instance, 1)
    if g <= G:
        return math.ceil(n_replicas / (G // g))
    return n_replicas * math.ceil(g / G)


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
