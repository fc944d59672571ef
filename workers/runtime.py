"""The runtime a worker process hands its activities: the store, the world, the planners."""

from __future__ import annotations

from typing import Any

from koi.config import Settings, get_settings
from koi.pipeline.runtime import Runtime


def build_runtime(settings: Settings | None = None, *, world: str = "sim", **kw: Any) -> Runtime:
    """``world``: ``sim`` (the simulator, checkpointed in the store) or ``ledger`` (bookkeeping only)."""
    from koi.store import init_db, make_engine

    s = settings or get_settings()
    engine = make_engine(s.resolved_database_url)
    init_db(engine)
    if world == "sim":
        from infra.sim import sim_world_provider

        provider = sim_world_provider(**kw.pop("world_options", {}))
    elif world == "ledger":
        from infra.ledger import ledger_provider

        provider = ledger_provider(kw.pop("resources"))
    else:
        raise ValueError(f"unknown world {world!r}: sim or ledger")
    kw.setdefault("interval_s", s.tick_interval_s)
    kw.setdefault("seed", s.seed)
    return Runtime(engine=engine, world=provider, **kw)
