"""The deploy fence: the last committed tick of a cluster, moved only forward.

A tick whose plan is older than the last committed plan must not deploy (a stale
retry, or a reset of an old tick). :func:`advance_fence` is a compare-and-set done by
one conditional UPDATE, so of two concurrent callers exactly one wins, on SQLite
(one writer at a time) and on PostgreSQL (the row lock makes the loser re-check the
condition against the winner's committed value).
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlmodel import Session

from koi.store.columns import utcnow
from koi.store.tables import ClusterStateRow
from koi.store.upsert import insert_if_absent

_T = ClusterStateRow.__table__


def get_fence(session: Session, cluster_id: str) -> int | None:
    """The last committed tick, or None before the first commit."""
    return session.execute(
        sa.select(_T.c.last_committed_tick).where(_T.c.cluster_id == cluster_id)
    ).scalar_one_or_none()


def advance_fence(session: Session, cluster_id: str, tick: int) -> bool:
    """Move the fence to ``tick`` if it is strictly ahead of it; True when this call moved it.

    False means another tick at or after ``tick`` committed first. A retried step that
    already moved the fence sees False too: it can tell by ``get_fence(...) == tick``.
    The move is visible to others when the session commits.
    """
    insert_if_absent(
        session, ClusterStateRow, {"cluster_id": cluster_id, "last_committed_tick": None}, ("cluster_id",)
    )
    res = session.execute(
        sa.update(_T)
        .where(
            _T.c.cluster_id == cluster_id,
            sa.or_(_T.c.last_committed_tick.is_(None), _T.c.last_committed_tick < tick),
        )
        .values(last_committed_tick=tick, updated_at=utcnow())
    )
    return res.rowcount == 1


def fence_allows(session: Session, cluster_id: str, tick: int) -> bool:
    """True when a plan of ``tick`` may deploy: no later tick has committed."""
    last = get_fence(session, cluster_id)
    return last is None or tick >= last
