"""The per-cluster lock and the deploy fence, as the first statement of a transaction.

Every unit of work that changes a cluster's world (a launch, a teardown, an advance of
the simulated clock, compensation) begins by writing the cluster's row in
``cluster_state``: on PostgreSQL that takes the row lock, on SQLite the database's
write lock, held until the transaction ends. World changes of one cluster are thereby
serialised across workers and processes, and a checkpoint cannot be lost to a
concurrent read-modify-write.

:func:`hold_fence` is the same write with the fence's condition (``last_committed_tick``
is NULL or ≤ tick): when it matches no row, a newer tick has committed and this one
must not deploy. The move of the fence itself is the store's
:func:`koi.store.advance_fence`, done when S6 commits.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.orm import Session

from koi.store.columns import utcnow
from koi.store.tables import ClusterStateRow
from koi.store.upsert import insert_if_absent

_T = ClusterStateRow.__table__


def _touch(session: Session, cluster_id: str, condition: sa.ColumnElement[bool] | None) -> bool:
    stmt = sa.update(_T).where(_T.c.cluster_id == cluster_id)
    if condition is not None:
        stmt = stmt.where(condition)
    res = session.execute(stmt.values(updated_at=utcnow()))
    if res.rowcount == 1:
        return True
    # No row yet: create it (a write, so the lock is held from here on), then retry once.
    insert_if_absent(session, ClusterStateRow, {"cluster_id": cluster_id, "last_committed_tick": None}, ("cluster_id",))
    stmt = sa.update(_T).where(_T.c.cluster_id == cluster_id)
    if condition is not None:
        stmt = stmt.where(condition)
    return session.execute(stmt.values(updated_at=utcnow())).rowcount == 1


def lock_cluster(session: Session, cluster_id: str) -> None:
    """Take the cluster's write lock for the rest of the transaction."""
    _touch(session, cluster_id, None)


def hold_fence(session: Session, cluster_id: str, tick: int) -> bool:
    """Take the cluster lock if ``tick`` may still deploy (no newer tick committed)."""
    ok = _touch(
        session,
        cluster_id,
        sa.or_(_T.c.last_committed_tick.is_(None), _T.c.last_committed_tick <= tick),
    )
    if not ok:
        lock_cluster(session, cluster_id)  # keep the lock anyway: the caller may still record things
    return ok
