"""Persistence of the causal state: the mechanism registry and Beta beliefs per tick.

Thin layer over :mod:`koi.store` (the store room's repositories). Beliefs are written
as a history row per (cluster, id, tick) for the ids whose Beta changed at that tick;
"as of t" reads the newest row at or before t per id, and an id without rows sits at
its seed prior. A mechanism's row carries its definition, so the registry as of t is
the seed table overlaid with every stored definition (admitted or changed since).
"""

from __future__ import annotations

from collections.abc import Mapping

from sqlmodel import Session

from koi.causal.beta import Belief
from koi.causal.graph import CausalGraph, default_graph
from koi.causal.mechanisms import Mechanism, default_mechanisms
from koi.causal.updates import BeliefState, changed
from koi.logging import get_logger

log = get_logger(__name__)


def load_registry(session: Session, cluster_id: str, tick: int | None = None,
                  seeds: Mapping[str, Mechanism] | None = None) -> dict[str, Mechanism]:
    """Seed mechanisms overlaid with the stored definitions as of ``tick`` (None: newest)."""
    from koi.store import load_mechanism_beliefs

    reg = dict(seeds if seeds is not None else default_mechanisms())
    for mid, mb in load_mechanism_beliefs(session, cluster_id, tick).items():
        try:
            reg[mid] = Mechanism.model_validate(mb.definition)
        except Exception as exc:  # a stored definition from an older schema: keep the seed, say so
            log.warning("causal.bad_definition", cluster=cluster_id, mechanism=mid, error=str(exc))
    return dict(sorted(reg.items()))


def load_beliefs(
    session: Session,
    cluster_id: str,
    tick: int | None,
    registry: Mapping[str, Mechanism] | None = None,
    graph: CausalGraph | None = None,
) -> BeliefState:
    """The belief state after tick ``tick`` (−1 or earlier: the seed; None: the newest stored)."""
    from koi.store import load_edge_beliefs, load_mechanism_beliefs

    graph = graph or default_graph()
    reg = registry if registry is not None else load_registry(session, cluster_id, tick)
    edges = graph.priors()
    mechs = {k: m.prior for k, m in reg.items()}
    newest = -1
    if tick is None or tick >= 0:
        for eid, (a, b) in load_edge_beliefs(session, cluster_id, tick).items():
            if eid in edges:
                edges[eid] = Belief(alpha=a, beta=b)
        for mid, mb in load_mechanism_beliefs(session, cluster_id, tick).items():
            mechs[mid] = Belief(alpha=mb.alpha, beta=mb.beta)
            newest = max(newest, mb.tick)
    if tick is None:
        from koi.store.repos._query import fresh
        from koi.store.tables import EdgeBeliefRow

        row = session.exec(fresh(EdgeBeliefRow).where(EdgeBeliefRow.cluster_id == cluster_id)
                           .order_by(EdgeBeliefRow.tick.desc()).limit(1)).first()
        newest = max(newest, row.tick if row is not None else -1)
    at = newest if tick is None else max(tick, -1)
    return BeliefState(cluster_id=cluster_id, tick=at, edges=dict(sorted(edges.items())),
                       mechanisms=dict(sorted(mechs.items())))


def save_beliefs(session: Session, prev: BeliefState, new: BeliefState,
                 registry: Mapping[str, Mechanism]) -> tuple[int, int]:
    """Write the edges and mechanisms whose Beta changed from ``prev`` to ``new`` at ``new.tick``."""
    from koi.store import save_edge_beliefs, save_mechanism_beliefs

    e, m = changed(prev, new)
    if e:
        save_edge_beliefs(session, new.cluster_id, new.tick, {k: (b.alpha, b.beta) for k, b in e.items()})
    if m:
        defs = {k: registry[k] for k in m if k in registry}
        unknown = sorted(set(m) - set(defs))
        if unknown:
            raise ValueError(f"cannot persist beliefs of unregistered mechanism(s) {unknown}")
        save_mechanism_beliefs(session, new.cluster_id, new.tick, {k: (b.alpha, b.beta) for k, b in m.items()}, defs)
    return len(e), len(m)


def persist_admitted(session: Session, cluster_id: str, tick: int, mechanism: Mechanism) -> None:
    """Record a newly admitted mechanism at ``tick`` at its prior (Beta(1, 1) for a proposal, Appendix D)."""
    from koi.store import save_mechanism_beliefs

    save_mechanism_beliefs(session, cluster_id, tick, {mechanism.mechanism_id: (mechanism.prior.alpha, mechanism.prior.beta)},
                           {mechanism.mechanism_id: mechanism})
