"""Plans per tick, their actions as queryable rows, and which plan was committed."""

from __future__ import annotations

import sqlalchemy as sa
from sqlmodel import Session

from koi.domain import Plan, stable_hash
from koi.store.columns import utcnow
from koi.store.repos._query import fresh
from koi.store.tables import ActionRow, PlanRow
from koi.store.upsert import upsert


def save_plan(session: Session, cluster_id: str, plan: Plan, committed: bool = False) -> None:
    """Insert or replace the plan of ``plan.tick``; its action rows are rewritten to match.

    ``plan.cluster_id``, when set, must equal ``cluster_id``.
    """
    if plan.cluster_id is not None and plan.cluster_id != cluster_id:
        raise ValueError(f"plan belongs to cluster {plan.cluster_id!r}, not {cluster_id!r}")
    payload = plan.model_dump(mode="json")
    upsert(
        session,
        PlanRow,
        {
            "cluster_id": cluster_id,
            "tick": plan.tick,
            "proposer": plan.proposer,
            "committed": committed,
            "n_actions": len(plan.actions),
            "digest": stable_hash(payload, n=16),
            "payload": payload,
        },
        ("cluster_id", "tick"),
    )
    # Replace, not upsert: a re-proposed plan may have fewer actions than the stored one.
    session.execute(
        sa.delete(ActionRow).where(ActionRow.cluster_id == cluster_id, ActionRow.tick == plan.tick)
    )
    rows = [
        {
            "cluster_id": cluster_id,
            "tick": plan.tick,
            "seq": i,
            "job_id": a.job_id,
            "action_type": a.type.value,
            "issuer": a.issuer.value,
            "mechanism_id": a.mechanism_id,
            "ladder_key": a.ladder.key if a.ladder is not None else None,
            "payload": payload["actions"][i],
        }
        for i, a in enumerate(plan.actions)
    ]
    upsert(session, ActionRow, rows, ("cluster_id", "tick", "seq"))


def get_plan(session: Session, cluster_id: str, tick: int) -> Plan | None:
    row = session.exec(fresh(PlanRow).where(PlanRow.cluster_id == cluster_id, PlanRow.tick == tick)).first()
    return None if row is None else Plan.model_validate(row.payload)


def get_plan_row(session: Session, cluster_id: str, tick: int) -> PlanRow | None:
    """The stored row (committed flag, digest, proposer) rather than the domain plan."""
    return session.exec(fresh(PlanRow).where(PlanRow.cluster_id == cluster_id, PlanRow.tick == tick)).first()


def mark_plan_committed(session: Session, cluster_id: str, tick: int) -> bool:
    """Flag the plan of ``tick`` as committed; False when no plan is stored for it."""
    res = session.execute(
        sa.update(PlanRow)
        .where(PlanRow.cluster_id == cluster_id, PlanRow.tick == tick)
        .values(committed=True, updated_at=utcnow())
    )
    return res.rowcount == 1


def latest_committed_plan(session: Session, cluster_id: str, before: int | None = None) -> Plan | None:
    """The newest committed plan, optionally only among ticks strictly before ``before``."""
    stmt = fresh(PlanRow).where(PlanRow.cluster_id == cluster_id, PlanRow.committed.is_(True))
    if before is not None:
        stmt = stmt.where(PlanRow.tick < before)
    row = session.exec(stmt.order_by(PlanRow.tick.desc()).limit(1)).first()
    return None if row is None else Plan.model_validate(row.payload)


def list_actions(
    session: Session, cluster_id: str, *, job_id: str | None = None, tick: int | None = None
) -> list[ActionRow]:
    """Stored action rows, by tick then position; filter by job to see one job's history."""
    stmt = fresh(ActionRow).where(ActionRow.cluster_id == cluster_id)
    if job_id is not None:
        stmt = stmt.where(ActionRow.job_id == job_id)
    if tick is not None:
        stmt = stmt.where(ActionRow.tick == tick)
    return list(session.exec(stmt.order_by(ActionRow.tick, ActionRow.seq)))
