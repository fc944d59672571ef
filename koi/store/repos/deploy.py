"""Deploy idempotency log: every launch carries a key (cluster, tick, job, rank).

The UNIQUE key is claimed with ``INSERT ... ON CONFLICT DO NOTHING RETURNING``, so a
retried activity or a reset tick learns that its launch already happened and does
not launch twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any

import sqlalchemy as sa
from sqlmodel import Session

from koi.store.columns import to_json, utcnow
from koi.store.repos._query import fresh
from koi.store.tables import DeployLogRow
from koi.store.upsert import insert_if_absent


class DeployStatus(StrEnum):
    """Suggested statuses; any string is accepted."""

    REQUESTED = "requested"
    LAUNCHED = "launched"
    FAILED = "failed"
    DRAINED = "drained"


def deploy_key(cluster_id: str, tick: int, job_id: str, rank_id: str) -> str:
    """The idempotency key of one launch."""
    return f"{cluster_id}:{tick}:{job_id}:{rank_id}"


def record_deploy(
    session: Session,
    cluster_id: str,
    tick: int,
    job_id: str,
    rank_id: str,
    *,
    status: DeployStatus | str = DeployStatus.REQUESTED,
    detail: Mapping[str, Any] | None = None,
    idempotency_key: str | None = None,
) -> bool:
    """Claim the launch; True when this call recorded it first (go ahead), False when it exists."""
    key = idempotency_key or deploy_key(cluster_id, tick, job_id, rank_id)
    return insert_if_absent(
        session,
        DeployLogRow,
        {
            "cluster_id": cluster_id,
            "tick": tick,
            "job_id": job_id,
            "rank_id": rank_id,
            "idempotency_key": key,
            "status": str(status),
            "detail": None if detail is None else to_json(dict(detail)),
        },
        ("idempotency_key",),
    )


def update_deploy(
    session: Session,
    idempotency_key: str,
    status: DeployStatus | str,
    detail: Mapping[str, Any] | None = None,
) -> bool:
    """Set a recorded launch's status (and detail, when given); False when the key is unknown."""
    values: dict[str, Any] = {"status": str(status), "updated_at": utcnow()}
    if detail is not None:
        values["detail"] = to_json(dict(detail))
    t = DeployLogRow.__table__
    res = session.execute(sa.update(t).where(t.c.idempotency_key == idempotency_key).values(**values))
    return res.rowcount == 1


def get_deploy(session: Session, idempotency_key: str) -> DeployLogRow | None:
    return session.exec(fresh(DeployLogRow).where(DeployLogRow.idempotency_key == idempotency_key)).first()


def list_deploys(session: Session, cluster_id: str, tick: int | None = None) -> list[DeployLogRow]:
    stmt = fresh(DeployLogRow).where(DeployLogRow.cluster_id == cluster_id)
    if tick is not None:
        stmt = stmt.where(DeployLogRow.tick == tick)
    return list(session.exec(stmt.order_by(DeployLogRow.tick, DeployLogRow.idempotency_key)))
