"""Beta beliefs over edges and mechanisms: a history row per (cluster, tick, id).

A row at tick t holds the belief after t's update (S3). Loading "as of t" takes, per
edge or mechanism, the newest row at or before t, so a tick that updated only some
ids need not rewrite the others.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple

import sqlalchemy as sa
from sqlmodel import Session

from koi.store.columns import check_finite, to_json
from koi.store.repos._query import fresh
from koi.store.tables import EdgeBeliefRow, MechanismBeliefRow
from koi.store.upsert import upsert


class MechanismBelief(NamedTuple):
    alpha: float
    beta: float
    definition: dict[str, Any]
    tick: int


def _ab(what: str, alpha: float, beta: float) -> tuple[float, float]:
    a, b = check_finite(f"{what} alpha", alpha), check_finite(f"{what} beta", beta)
    if a <= 0 or b <= 0:
        raise ValueError(f"{what}: Beta parameters must be positive, got alpha={a}, beta={b}")
    return a, b


def _as_of(session: Session, table: Any, id_col: str, cluster_id: str, tick: int | None) -> list[Any]:
    """Per id, the newest row at or before ``tick`` (None: the newest overall)."""
    ident = getattr(table, id_col)
    cond = [table.cluster_id == cluster_id]
    if tick is not None:
        cond.append(table.tick <= tick)
    newest = (
        sa.select(ident.label("ident"), sa.func.max(table.tick).label("tick"))
        .where(*cond)
        .group_by(ident)
        .subquery()
    )
    stmt = (
        fresh(table)
        .join(newest, sa.and_(ident == newest.c.ident, table.tick == newest.c.tick))
        .where(table.cluster_id == cluster_id)
        .order_by(ident)
    )
    return list(session.exec(stmt))


# ---- edges ------------------------------------------------------------------------------------------
def save_edge_beliefs(
    session: Session, cluster_id: str, tick: int, beliefs: Mapping[str, tuple[float, float]]
) -> int:
    """Record {edge_id: (alpha, beta)} after tick ``tick``'s update."""
    rows = []
    for edge_id, (alpha, beta) in beliefs.items():
        a, b = _ab(f"edge {edge_id!r}", alpha, beta)
        rows.append({"cluster_id": cluster_id, "tick": tick, "edge_id": edge_id, "alpha": a, "beta": b})
    return upsert(session, EdgeBeliefRow, rows, ("cluster_id", "edge_id", "tick"))


def load_edge_beliefs(
    session: Session, cluster_id: str, tick: int | None = None
) -> dict[str, tuple[float, float]]:
    """{edge_id: (alpha, beta)} as of ``tick`` (newest at or before it; None = newest)."""
    return {r.edge_id: (r.alpha, r.beta) for r in _as_of(session, EdgeBeliefRow, "edge_id", cluster_id, tick)}


def edge_belief_history(session: Session, cluster_id: str, edge_id: str) -> list[tuple[int, float, float]]:
    """(tick, alpha, beta) of one edge over time, oldest first (reports, figures)."""
    stmt = (
        fresh(EdgeBeliefRow)
        .where(EdgeBeliefRow.cluster_id == cluster_id, EdgeBeliefRow.edge_id == edge_id)
        .order_by(EdgeBeliefRow.tick)
    )
    return [(r.tick, r.alpha, r.beta) for r in session.exec(stmt)]


# ---- mechanisms --------------------------------------------------------------------------------------
def save_mechanism_beliefs(
    session: Session,
    cluster_id: str,
    tick: int,
    beliefs: Mapping[str, tuple[float, float]],
    definitions: Mapping[str, Any],
) -> int:
    """Record {mechanism_id: (alpha, beta)} after tick ``tick``, each with its definition.

    ``definitions`` maps every mechanism id to its definition (a pydantic model or a
    JSON-able dict): a mechanism's scope and lifecycle can change, so each history row
    keeps the definition it had then.
    """
    missing = sorted(set(beliefs) - set(definitions))
    if missing:
        raise ValueError(f"no definition given for mechanism(s) {missing}")
    rows = []
    for mid, (alpha, beta) in beliefs.items():
        a, b = _ab(f"mechanism {mid!r}", alpha, beta)
        rows.append(
            {
                "cluster_id": cluster_id,
                "tick": tick,
                "mechanism_id": mid,
                "alpha": a,
                "beta": b,
                "definition": to_json(definitions[mid]),
            }
        )
    return upsert(session, MechanismBeliefRow, rows, ("cluster_id", "mechanism_id", "tick"))


def load_mechanism_beliefs(
    session: Session, cluster_id: str, tick: int | None = None
) -> dict[str, MechanismBelief]:
    """{mechanism_id: MechanismBelief} as of ``tick`` (newest at or before it; None = newest)."""
    rows = _as_of(session, MechanismBeliefRow, "mechanism_id", cluster_id, tick)
    return {r.mechanism_id: MechanismBelief(r.alpha, r.beta, r.definition, r.tick) for r in rows}
