"""Tick history: one row per (cluster, tick) with its outcome and stage timings."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

from sqlmodel import Session

from koi.store.columns import to_json
from koi.store.repos._query import fresh
from koi.store.tables import TickRow
from koi.store.upsert import upsert


class TickStatus(StrEnum):
    """Suggested outcomes; any string is accepted."""

    RUNNING = "running"
    COMMITTED = "committed"  # the plan deployed
    KEEP_ALL = "keep_all"  # compensation: the running cluster stays as it is
    FAILED = "failed"


def save_tick(
    session: Session,
    cluster_id: str,
    tick: int,
    status: TickStatus | str,
    reason: str = "",
    timings: Mapping[str, float] | None = None,
) -> None:
    """Insert or replace the record of a tick (a retried or reset tick overwrites it)."""
    upsert(
        session,
        TickRow,
        {
            "cluster_id": cluster_id,
            "tick": tick,
            "status": str(status),
            "reason": reason,
            "timings": to_json(dict(timings or {})),
        },
        ("cluster_id", "tick"),
    )


def get_tick(session: Session, cluster_id: str, tick: int) -> TickRow | None:
    return session.exec(fresh(TickRow).where(TickRow.cluster_id == cluster_id, TickRow.tick == tick)).first()


def list_ticks(
    session: Session,
    cluster_id: str,
    *,
    status: TickStatus | str | None = None,
    limit: int | None = None,
    newest_first: bool = False,
) -> list[TickRow]:
    stmt = fresh(TickRow).where(TickRow.cluster_id == cluster_id)
    if status is not None:
        stmt = stmt.where(TickRow.status == str(status))
    stmt = stmt.order_by(TickRow.tick.desc() if newest_first else TickRow.tick)
    if limit is not None:
        stmt = stmt.limit(limit)
    return list(session.exec(stmt))
