"""The fleet: pools of whole instances, what is allocated to which rank, and what it costs.

A pool's *capacity* is how many instances the cloud will give right now; spot
reclaims and node failures lower it, and it returns after a delay. Allocated
instances never exceed capacity: when capacity drops below the allocation, the
instances that go are allocated ones (a reclaim notice hits running machines), picked
by the world's seeded generator.

Cost accrues per instance from allocation to release, idle or busy, at the pool's
hourly price. Reserved pools are a commitment: their whole capacity is paid whether
allocated or not (reported separately as idle reserved cost).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from koi.domain import Environment, InstanceType, Market, Pool, ResourceMap
from koi.sim.scenario import PoolSpec, Scenario


@dataclass
class PoolRT:
    idx: int
    spec: PoolSpec
    env: Environment
    itype: InstanceType
    price: float
    capacity: int
    allocated: int = 0
    # (time, capacity) change points, for the reserved-commitment integral
    history: list[tuple[float, int]] = field(default_factory=list)

    @property
    def free(self) -> int:
        return max(self.capacity - self.allocated, 0)

    @property
    def pool_id(self) -> str:
        return f"{self.env.env_id}/{self.itype.name}"


@dataclass
class InstanceRT:
    iid: int
    pool: int
    rank: int  # rank index owning it
    alloc_t: float
    release_t: float = np.inf
    epoch: int = 0

    @property
    def live(self) -> bool:
        return not np.isfinite(self.release_t)


class Fleet:
    def __init__(self, scenario: Scenario):
        self.pools: list[PoolRT] = []
        for i, p in enumerate(scenario.pools):
            pr = PoolRT(
                idx=i,
                spec=p,
                env=scenario.environment(p),
                itype=scenario.instance_type(p),
                price=scenario.price(p),
                capacity=p.instances,
            )
            pr.history.append((0.0, p.instances))
            self.pools.append(pr)
        self.instances: list[InstanceRT] = []

    # ---- lookups -----------------------------------------------------------------------------------
    def find(self, env: Environment, instance_type: str | None, min_gpus: int = 1) -> list[PoolRT]:
        """Pools in ``env`` (optionally of one instance type); larger instances first when untyped."""
        out = [
            p
            for p in self.pools
            if p.env.env_id == env.env_id and (instance_type is None or p.itype.name == instance_type)
        ]
        if instance_type is None:
            # an untyped chain takes the smallest instance that holds one replica, else the largest
            fits = sorted((p for p in out if p.itype.gpu_count >= min_gpus), key=lambda p: p.itype.gpu_count)
            rest = sorted((p for p in out if p.itype.gpu_count < min_gpus), key=lambda p: -p.itype.gpu_count)
            out = fits + rest
        return out

    # ---- allocation ---------------------------------------------------------------------------------
    def allocate(self, pool: PoolRT, k: int, rank: int, t: float) -> list[int]:
        k = min(k, pool.free)
        ids = []
        for _ in range(k):
            inst = InstanceRT(iid=len(self.instances), pool=pool.idx, rank=rank, alloc_t=t)
            self.instances.append(inst)
            ids.append(inst.iid)
        pool.allocated += k
        return ids

    def release(self, iid: int, t: float) -> bool:
        inst = self.instances[iid]
        if not inst.live:
            return False
        inst.release_t = t
        inst.epoch += 1
        self.pools[inst.pool].allocated -= 1
        return True

    def set_capacity(self, pool: PoolRT, cap: int, t: float) -> None:
        pool.capacity = max(cap, 0)
        pool.history.append((t, pool.capacity))

    def live_instances(self, pool: PoolRT) -> list[int]:
        return [i.iid for i in self.instances if i.pool == pool.idx and i.live]

    # ---- observation ---------------------------------------------------------------------------------
    def resource_map(self) -> ResourceMap:
        pools = [
            Pool(
                env=p.env,
                instance_type=p.itype.name,
                gpus_per_instance=p.itype.gpu_count,
                total_instances=p.capacity,
                free_instances=p.free,
                hourly_price=p.price,
            )
            for p in self.pools
        ]
        return ResourceMap(pools=pools)

    # ---- cost -----------------------------------------------------------------------------------------
    def _accrued(self, t: float) -> Iterator[tuple[InstanceRT, PoolRT, float]]:
        """Every instance that was allocated before t, its pool, and its $ over [0, t]."""
        for inst in self.instances:
            end = min(inst.release_t, t)
            if end > inst.alloc_t:
                pool = self.pools[inst.pool]
                yield inst, pool, pool.price * (end - inst.alloc_t) / 3600.0

    def instance_cost(self, t: float, ranks: set[int] | None = None) -> float:
        """$ of allocated instances over [0, t] (optionally only those of ``ranks``)."""
        total = 0.0
        for inst, _pool, usd in self._accrued(t):
            if ranks is None or inst.rank in ranks:
                total += usd
        return total

    def instance_cost_by_rank(self, t: float) -> dict[tuple[int, str], float]:
        """$ of allocated instances over [0, t] by (rank index, market): showback of the allocated
        part of the bill (idle reserved capacity belongs to no rank). Sums to :meth:`instance_cost`."""
        out: dict[tuple[int, str], float] = {}
        for inst, pool, usd in self._accrued(t):
            key = (inst.rank, pool.env.market.value)
            out[key] = out.get(key, 0.0) + usd
        return out

    def reserved_commitment(self, t: float) -> tuple[float, float]:
        """($ of all reserved capacity over [0, t], $ of it that was allocated)."""
        commit = 0.0
        for p in self.pools:
            if p.env.market is not Market.RESERVED:
                continue
            hist = [*p.history, (t, p.capacity)]
            for (a, cap), (b, _) in zip(hist, hist[1:], strict=False):
                lo, hi = min(a, t), min(b, t)
                if hi > lo:
                    commit += cap * p.price * (hi - lo) / 3600.0
        used = 0.0
        for _inst, pool, usd in self._accrued(t):
            if pool.env.market is Market.RESERVED:
                used += usd
        return commit, used

    def fleet_cost(self, t: float) -> dict[str, float]:
        alloc = self.instance_cost(t)
        commit, used = self.reserved_commitment(t)
        idle_reserved = max(commit - used, 0.0)
        return {"allocated": alloc, "idle_reserved": idle_reserved, "total": alloc + idle_reserved}

    def hourly(self, iids: list[int]) -> float:
        return sum(self.pools[self.instances[i].pool].price for i in iids if self.instances[i].live)
