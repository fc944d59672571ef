"""The runtime a worker process hands its activities: the store, the world, the planners."""

from __future__ import annotations

from typing import Any

from koi.config import Settings, get_settings
from koi.pipeline.runtime import Runtime


def build_runtime(settings: Settings | None = None, *, world: str = "sim", **kw: Any) -> Runtime:
    """``world``: ``sim`` (the simulator, checkpointed in the store), ``aws`` / ``gcp`` / ``azure`` (EC2 / Compute
    Engine / Azure VMs and the engines' vLLM metrics, :mod:`infra.cloud`; ``fleet``: the fleet file, default ``KOI_FLEET_FILE``) or
    ``ledger`` (bookkeeping only)."""
    from koi.store import init_db, make_engine

    s = settings or get_settings()
    if world == "sim":
        from infra.sim import sim_world_provider

        provider = sim_world_provider(**kw.pop("world_options", {}))
    elif world in ("aws", "gcp", "azure"):
        from infra.cloud import CloudWorldProvider, load_fleet

        fleet = kw.pop("fleet", None) or s.fleet_file
        if fleet is None:
            raise ValueError(f"the {world} world needs a fleet file: --fleet PATH or KOI_FLEET_FILE")
        provider = CloudWorldProvider(load_fleet(fleet), cloud=world, **kw.pop("world_options", {}))
    elif world == "ledger":
        from infra.ledger import ledger_provider

        provider = ledger_provider(kw.pop("resources"))
    else:
        raise ValueError(f"unknown world {world!r}: sim, aws, gcp, azure or ledger")
    engine = make_engine(s.resolved_database_url)  # after the world: a bad fleet file fails before the store is touched
    init_db(engine)
    kw.setdefault("interval_s", s.tick_interval_s)
    kw.setdefault("seed", s.seed)
    return Runtime(engine=engine, world=provider, **kw)
