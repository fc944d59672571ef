"""Live deployments: the current state of every rank, one row per (cluster, rank).

History lives in the S0 snapshots (stage outputs); this table is what S0 reads.
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlmodel import Session

from koi.domain import Deployment, DeploymentState
from koi.store.repos._query import fresh
from koi.store.tables import DeploymentRow
from koi.store.upsert import upsert

_LIVE = (DeploymentState.LAUNCHING, DeploymentState.SERVING, DeploymentState.DEGRADED)


def _values(cluster_id: str, d: Deployment, tick: int) -> dict:
    return {
        "cluster_id": cluster_id,
        "job_id": d.job_id,
        "rank_id": d.rank_id,
        "env_id": d.rank.env.env_id,
        "gpu_type": d.rank.env.gpu_type,
        "state": d.state.value,
        "n_replicas": d.rank.n_replicas,
        "replicas_ready": d.replicas_ready,
        "since_tick": d.since_tick,
        "updated_tick": tick,
        "idempotency_key": d.idempotency_key,
        "payload": d.model_dump(mode="json"),
    }


def save_deployments(session: Session, cluster_id: str, deployments: Iterable[Deployment], tick: int) -> int:
    """Insert or replace deployments as observed or changed at ``tick``."""
    return upsert(
        session, DeploymentRow, [_values(cluster_id, d, tick) for d in deployments], ("cluster_id", "rank_id")
    )


def save_deployment(session: Session, cluster_id: str, deployment: Deployment, tick: int) -> None:
    save_deployments(session, cluster_id, [deployment], tick)


def get_deployments(
    session: Session, cluster_id: str, *, job_id: str | None = None, live_only: bool = False
) -> list[Deployment]:
    """Deployments of a cluster (or one job), ordered by job and rank id."""
    stmt = fresh(DeploymentRow).where(DeploymentRow.cluster_id == cluster_id)
    if job_id is not None:
        stmt = stmt.where(DeploymentRow.job_id == job_id)
    if live_only:
        stmt = stmt.where(DeploymentRow.state.in_([s.value for s in _LIVE]))
    stmt = stmt.order_by(DeploymentRow.job_id, DeploymentRow.rank_id)
    return [Deployment.model_validate(r.payload) for r in session.exec(stmt)]
