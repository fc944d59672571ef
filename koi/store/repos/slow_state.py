"""The slow loop's state per (cluster, tick): w, z*, β, B, λ, ε, CUSUM thresholds ...

Stored as one JSON document; its shape belongs to ``koi.calibration``.
"""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic import BaseModel
from sqlmodel import Session

from koi.store.columns import to_json
from koi.store.repos._query import fresh
from koi.store.tables import SlowStateRow
from koi.store.upsert import upsert

M = TypeVar("M", bound=BaseModel)


def save_slow_state(session: Session, cluster_id: str, tick: int, state: BaseModel | dict[str, Any]) -> None:
    """Record the slow state after tick ``tick`` (a pydantic model or a JSON-able dict)."""
    upsert(
        session,
        SlowStateRow,
        {"cluster_id": cluster_id, "tick": tick, "payload": to_json(state)},
        ("cluster_id", "tick"),
    )


def load_slow_state_row(session: Session, cluster_id: str, tick: int | None = None) -> SlowStateRow | None:
    """The newest row at or before ``tick`` (None = the newest); its ``tick`` says which."""
    stmt = fresh(SlowStateRow).where(SlowStateRow.cluster_id == cluster_id)
    if tick is not None:
        stmt = stmt.where(SlowStateRow.tick <= tick)
    return session.exec(stmt.order_by(SlowStateRow.tick.desc()).limit(1)).first()


def load_slow_state(session: Session, cluster_id: str, tick: int | None = None) -> dict[str, Any] | None:
    """The slow state as of ``tick`` (newest at or before it), or None before the first."""
    row = load_slow_state_row(session, cluster_id, tick)
    return None if row is None else row.payload


def load_slow_state_as(
    session: Session, cluster_id: str, model: type[M], tick: int | None = None
) -> M | None:
    """As :func:`load_slow_state`, validated into ``model``."""
    payload = load_slow_state(session, cluster_id, tick)
    return None if payload is None else model.model_validate(payload)
