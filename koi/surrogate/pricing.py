"""What a rank costs: the catalog's $/GPU-hour of a chain's instance in its environment (cached per
process; :func:`koi.surrogate.core.clear_caches` empties it) and the per-rank prices of a ladder.
Kept apart from :mod:`koi.surrogate.core`, which reads them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import lru_cache

from koi import catalog
from koi.domain.chain import Rank
from koi.domain.hardware import Environment
from koi.surrogate.outputs import SurrogateError


def catalog_gpu_hour_price(env: Environment, instance_type: str | None) -> float:
    """$/GPU-hour of the chain's instance in the environment's region and market (catalog list price).

    When the catalog does not sell that shape in that region (or has no spot price), the cheapest
    listed on-demand price of the shape is used.
    """
    insts = [catalog.instance(env.cloud, instance_type)] if instance_type else catalog.instances_for_gpu(env.gpu_type, env.cloud)
    if not insts:
        raise SurrogateError(f"no {env.gpu_type} instance on {env.cloud} to price")
    best = math.inf
    for inst in insts:
        try:
            p = inst.hourly_price(env.region, env.market)
        except ValueError:
            p = min(r.on_demand_hourly for r in inst.prices)
        best = min(best, p / inst.gpu_count)
    return float(best)


@lru_cache(maxsize=4096)
def _cached_price(env: Environment, instance_type: str | None) -> float:
    return catalog_gpu_hour_price(env, instance_type)


def _rank_prices(ranks: list[Rank], prices: Sequence[float] | Mapping[str, float] | None) -> list[float]:
    if prices is None:
        return [_cached_price(r.env, r.config.instance_type) for r in ranks]
    if isinstance(prices, Mapping):
        return [float(prices[r.env.env_id]) if r.env.env_id in prices else _cached_price(r.env, r.config.instance_type)
                for r in ranks]  # fmt: skip
    if len(prices) != len(ranks):
        raise SurrogateError(f"{len(prices)} prices for {len(ranks)} ranks")
    return [float(p) for p in prices]
