"""Switching cost: what churning a live deployment costs (whitepaper, "The Cluster
Objective"; overview §2.4 "Switching cost").

    SwitchCost = C_cold + C_parallel + C_kill + C_risk

All terms are 0 for an unchanged ladder, and a fresh placement (no previous ladder)
pays none: there is nothing to churn.

Pricing, with ranks matched by chain (the same chain in both ladders only pays for
the replicas it adds or removes):
- C_cold: the added replicas sit idle while weights load and engines warm:
  t_cold = weight bytes per node / load bandwidth + warm-up, paid at the added replicas' $/s.
  A chain loads its shards in parallel across its nodes, so a TP8 chain on one node
  loads the whole model over one node's link and a PP2 chain over two nodes loads half
  per node. Replicas load in parallel, so the slowest added chain sets t_cold.
- C_parallel: the A/B overlap: the removed replicas keep running (and being paid for)
  while the added ones come up and take traffic: t_overlap at the removed replicas' $/s
  (only when the swap adds replicas; a pure scale-down has no overlap).
- C_kill: draining and tearing down the removed replicas: t_drain at their $/s.
- C_risk: the chance the new ladder underperforms inside its DRO band, p_brk(new),
  for one tick, at the added replicas' $/s.

Units (so that λ·SwitchCost is commensurate with J): the dollars above are divided by
what the larger of the old and new ladders costs over one tick interval. SwitchCost is
thus "tick-equivalents of the ladder's spend", a dimensionless number of order 1 for a
full swap (≈ (t_cold + t_overlap + t_drain)/t_tick + p_brk), like J's normalised gaps,
and λ_t (the slow loop's churn price) converts it. Defaults: load bandwidth 2 GB/s per
node (object storage / local NVMe into HBM, what vLLM's safetensors loader sustains),
warm-up 60 s (CUDA graphs, KV allocation, health checks), overlap 120 s, drain 30 s,
tick 300 s (Appendix B).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pydantic import Field

from koi.domain.chain import Ladder, Rank
from koi.domain.common import KoiModel
from koi.domain.model import ModelArch


class SwitchParams(KoiModel):
    load_bw_gbs: float = Field(default=2.0, gt=0, description="weight load bandwidth per node, GB/s")
    warmup_s: float = Field(default=60.0, ge=0)
    overlap_s: float = Field(default=120.0, ge=0, description="A/B canary overlap")
    drain_s: float = Field(default=30.0, ge=0)
    tick_s: float = Field(default=300.0, gt=0)
    gpus_per_node: int = Field(default=8, ge=1, description="when a rank's instance size is unknown")


class SwitchBreakdown(KoiModel):
    cold: float = 0.0
    parallel: float = 0.0
    kill: float = 0.0
    risk: float = 0.0
    cold_start_s: float = 0.0

    @property
    def total(self) -> float:
        return self.cold + self.parallel + self.kill + self.risk


#: $/hour of a rank; the planner passes one that knows pool prices and instance packing.
RankPrice = Callable[[Rank], float]


def cold_start_seconds(model: ModelArch, rank: Rank, params: SwitchParams, gpus_per_node: int | None = None) -> float:
    """Seconds from launch to serving for one chain of ``rank`` (all replicas load in parallel)."""
    per_node = gpus_per_node or params.gpus_per_node
    nodes = max(1, math.ceil(rank.config.gpus / per_node))
    gb = model.weight_bytes(rank.config.weight_dtype) / 1e9
    return gb / nodes / params.load_bw_gbs + params.warmup_s


@dataclass(frozen=True, slots=True)
class SwitchItem:
    """One rank as switching sees it: its chain identity, replicas, cold start and price."""

    chain_key: str
    n_replicas: int
    cold_s: float
    price: Callable[[int], float]  # $/hour of k replicas of this chain


def switch_cost_items(
    old: Sequence[SwitchItem] | None,
    new: Sequence[SwitchItem] | None,
    p_brk_new: float = 0.0,
    params: SwitchParams | None = None,
) -> SwitchBreakdown:
    """SwitchCost on rank items; see the module docstring for the pricing and units.

    Ranks are matched by chain: a chain present in both ladders only pays for the
    replicas it adds (cold start, risk) or removes (drain). The A/B overlap is paid on
    removed replicas only when the swap also adds replicas (a replacement); a pure
    scale-down drains without an overlap. ``old`` None (a fresh placement) or an
    unchanged ladder pays 0.
    """
    params = params or SwitchParams()
    if not old or not new:
        return SwitchBreakdown()
    o: dict[str, tuple[int, SwitchItem]] = {}
    n: dict[str, tuple[int, SwitchItem]] = {}
    for src, dst in ((old, o), (new, n)):
        for it in src:
            k, prev = dst.get(it.chain_key, (0, it))
            dst[it.chain_key] = (k + it.n_replicas, prev)
    if o.keys() == n.keys() and all(o[k][0] == n[k][0] for k in o):
        return SwitchBreakdown()
    usd_new = sum(it.price(k) for k, it in n.values()) / 3600.0
    usd_old = sum(it.price(k) for k, it in o.values()) / 3600.0
    norm = max(usd_new, usd_old, 1e-12) * params.tick_s
    cold_s = 0.0
    usd_added = usd_removed = 0.0
    for key in sorted(set(o) | set(n)):
        no = o[key][0] if key in o else 0
        nn = n[key][0] if key in n else 0
        if nn > no:
            it = n[key][1]
            cold_s = max(cold_s, it.cold_s)
            usd_added += it.price(nn - no) / 3600.0
        elif no > nn:
            usd_removed += o[key][1].price(no - nn) / 3600.0
    return SwitchBreakdown(
        cold=cold_s * usd_added / norm,
        parallel=(params.overlap_s * usd_removed / norm) if usd_added > 0 else 0.0,
        kill=params.drain_s * usd_removed / norm,
        risk=float(p_brk_new) * params.tick_s * usd_added / norm,
        cold_start_s=cold_s,
    )


def switch_cost(
    old: Ladder | None,
    new: Ladder | None,
    model: ModelArch,
    price: RankPrice,
    p_brk_new: float = 0.0,
    params: SwitchParams | None = None,
    gpus_per_node: Callable[[Rank], int | None] | None = None,
) -> SwitchBreakdown:
    """SwitchCost(L_old → L_new) for domain ladders (``price`` gives a rank's $/hour)."""
    params = params or SwitchParams()
    if old is None or new is None or old.key == new.key:
        return SwitchBreakdown()

    def items(ladder: Ladder) -> list[SwitchItem]:
        out = []
        for r in ladder.ranks:
            cold = cold_start_seconds(model, r, params, gpus_per_node(r) if gpus_per_node else None)
            out.append(SwitchItem(r.chain.key, r.n_replicas, cold,
                                  lambda k, _r=r: price(_r.model_copy(update={"n_replicas": k}))))
        return out

    return switch_cost_items(items(old), items(new), p_brk_new, params)
