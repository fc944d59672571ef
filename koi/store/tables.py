"""SQLModel tables: the store's schema.

Every table that a retried step may write again carries a named UNIQUE key, and the
repositories write it with :func:`koi.store.upsert.upsert`, so a repeated write leaves
one row. Domain objects are stored whole as JSON (``payload``) produced by
``model_dump(mode="json")``; the columns beside it are the ones we filter on.

The schema itself is created by the Alembic migrations in ``koi/store/migrations``;
these classes must match them (a test compares the two).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import sqlalchemy as sa
from sqlmodel import Field, SQLModel

from koi.store.columns import created_at_field, json_column, updated_at_field


def _uq(table: str, *cols: str) -> sa.UniqueConstraint:
    return sa.UniqueConstraint(*cols, name=f"uq_{table}_key")


# ---- jobs and ticks ------------------------------------------------------------------------
class JobRow(SQLModel, table=True):
    """A job of a cluster and its lifecycle status (payload: the domain ``Job``)."""

    __tablename__ = "jobs"
    __table_args__ = (
        _uq("jobs", "cluster_id", "job_id"),
        sa.Index("ix_jobs_cluster_status", "cluster_id", "status"),
    )

    id: int | None = Field(default=None, primary_key=True)
    cluster_id: str
    job_id: str
    tenant: str
    model: str
    job_class: str
    status: str
    priority: int
    submitted_at: float
    completed_requests: int = 0
    admitted_tick: int | None = None
    finished_at: float | None = None
    payload: dict[str, Any] = Field(sa_column=json_column())
    created_at: datetime | None = created_at_field()
    updated_at: datetime | None = updated_at_field()


class TickRow(SQLModel, table=True):
    """One planning tick: how it ended and how long its stages took."""

    __tablename__ = "ticks"
    __table_args__ = (_uq("ticks", "cluster_id", "tick"),)

    id: int | None = Field(default=None, primary_key=True)
    cluster_id: str
    tick: int
    status: str
    reason: str = ""
    timings: dict[str, Any] = Field(sa_column=json_column())
    created_at: datetime | None = created_at_field()
    updated_at: datetime | None = updated_at_field()


# ---- plans and actions ------------------------------------------------------------------------
class PlanRow(SQLModel, table=True):
    """The plan of a tick (payload: the domain ``Plan``); ``committed`` once S6 deployed it."""

    __tablename__ = "plans"
    __table_args__ = (_uq("plans", "cluster_id", "tick"),)

    id: int | None = Field(default=None, primary_key=True)
    cluster_id: str
    tick: int
    proposer: str
    committed: bool = False
    n_actions: int = 0
    digest: str
    payload: dict[str, Any] = Field(sa_column=json_column())
    created_at: datetime | None = created_at_field()
    updated_at: datetime | None = updated_at_field()


class ActionRow(SQLModel, table=True):
    """One action of a stored plan, kept as a row so history can be queried by job."""

    __tablename__ = "actions"
    __table_args__ = (
        _uq("actions", "cluster_id", "tick", "seq"),
        sa.ForeignKeyConstraint(
            ["cluster_id", "tick"],
            ["plans.cluster_id", "plans.tick"],
            name="fk_actions_plans",
            ondelete="CASCADE",
        ),
        sa.Index("ix_actions_cluster_job", "cluster_id", "job_id"),
    )

    id: int | None = Field(default=None, primary_key=True)
    cluster_id: str
    tick: int
    seq: int
    job_id: str
    action_type: str
    issuer: str
    mechanism_id: str | None = None
    ladder_key: str | None = None
    payload: dict[str, Any] = Field(sa_column=json_column())
    created_at: datetime | None = created_at_field()


class DeploymentRow(SQLModel, table=True):
    """The current state of one rank of one job (payload: the domain ``Deployment``)."""

    __tablename__ = "deployments"
    __table_args__ = (
        _uq("deployments", "cluster_id", "rank_id"),
        sa.Index("ix_deployments_cluster_job", "cluster_id", "job_id"),
    )

    id: int | None = Field(default=None, primary_key=True)
    cluster_id: str
    job_id: str
    rank_id: str
    env_id: str
    gpu_type: str
    state: str
    n_replicas: int
    replicas_ready: int
    since_tick: int
    updated_tick: int
    idempotency_key: str = ""
    payload: dict[str, Any] = Field(sa_column=json_column())
    created_at: datetime | None = created_at_field()
    updated_at: datetime | None = updated_at_field()


# ---- observations and evidence (one row per cluster, tick and rank) --------------------------------
class TelemetryRow(SQLModel, table=True):
    __tablename__ = "telemetry_windows"
    __table_args__ = (_uq("telemetry_windows", "cluster_id", "tick", "rank_id"),)

    id: int | None = Field(default=None, primary_key=True)
    cluster_id: str
    tick: int
    rank_id: str
    job_id: str
    env_id: str
    t_start: float
    t_end: float
    n_samples: int
    payload: dict[str, Any] = Field(sa_column=json_column())
    created_at: datetime | None = created_at_field()


class PredictionRow(SQLModel, table=True):
    __tablename__ = "predictions"
    __table_args__ = (_uq("predictions", "cluster_id", "tick", "rank_id"),)

    id: int | None = Field(default=None, primary_key=True)
    cluster_id: str
    tick: int
    rank_id: str
    job_id: str
    env_id: str
    payload: dict[str, Any] = Field(sa_column=json_column())
    created_at: datetime | None = created_at_field()


class EvidenceRowRecord(SQLModel, table=True):
    """Named ``...Record`` so it does not shadow the domain's ``EvidenceRow``."""

    __tablename__ = "evidence_rows"
    __table_args__ = (_uq("evidence_rows", "cluster_id", "tick", "rank_id"),)

    id: int | None = Field(default=None, primary_key=True)
    cluster_id: str
    tick: int
    rank_id: str
    job_id: str
    env_id: str
    n_samples: int
    payload: dict[str, Any] = Field(sa_column=json_column())
    created_at: datetime | None = created_at_field()


# ---- beliefs and the slow loop (a history row per tick) ---------------------------------------------
class EdgeBeliefRow(SQLModel, table=True):
    """Beta(alpha, beta) of one edge after tick ``tick``'s update.

    The key is ordered (cluster, edge, tick) so "latest at or before t per edge" is an
    index range scan.
    """

    __tablename__ = "edge_beliefs"
    __table_args__ = (_uq("edge_beliefs", "cluster_id", "edge_id", "tick"),)

    id: int | None = Field(default=None, primary_key=True)
    cluster_id: str
    tick: int
    edge_id: str
    alpha: float
    beta: float
    created_at: datetime | None = created_at_field()


class MechanismBeliefRow(SQLModel, table=True):
    """Beta(alpha, beta) of one mechanism after tick ``tick``, with its definition then."""

    __tablename__ = "mechanism_beliefs"
    __table_args__ = (_uq("mechanism_beliefs", "cluster_id", "mechanism_id", "tick"),)

    id: int | None = Field(default=None, primary_key=True)
    cluster_id: str
    tick: int
    mechanism_id: str
    alpha: float
    beta: float
    definition: dict[str, Any] = Field(sa_column=json_column())
    created_at: datetime | None = created_at_field()


class SlowStateRow(SQLModel, table=True):
    """The slow loop's state (w, z*, β, B, λ, ε, CUSUM thresholds ...) after a tick."""

    __tablename__ = "slow_state"
    __table_args__ = (_uq("slow_state", "cluster_id", "tick"),)

    id: int | None = Field(default=None, primary_key=True)
    cluster_id: str
    tick: int
    payload: dict[str, Any] = Field(sa_column=json_column())
    created_at: datetime | None = created_at_field()


# ---- deploy: idempotency log and the fence ------------------------------------------------------------
class DeployLogRow(SQLModel, table=True):
    """One launch request; the UNIQUE idempotency key makes a retried launch a no-op."""

    __tablename__ = "deploy_log"
    __table_args__ = (
        sa.UniqueConstraint("idempotency_key", name="uq_deploy_log_key"),
        sa.Index("ix_deploy_log_cluster_tick", "cluster_id", "tick"),
    )

    id: int | None = Field(default=None, primary_key=True)
    cluster_id: str
    tick: int
    job_id: str
    rank_id: str
    idempotency_key: str
    status: str
    detail: dict[str, Any] | None = Field(default=None, sa_column=json_column(nullable=True))
    created_at: datetime | None = created_at_field()
    updated_at: datetime | None = updated_at_field()


class ClusterStateRow(SQLModel, table=True):
    """Per-cluster state; ``last_committed_tick`` is the deploy fence."""

    __tablename__ = "cluster_state"

    cluster_id: str = Field(primary_key=True)
    last_committed_tick: int | None = None
    created_at: datetime | None = created_at_field()
    updated_at: datetime | None = updated_at_field()


# ---- revision 0002: the performance database and stage outputs ----------------------------------------
class PerfRow(SQLModel, table=True):
    """Observed performance of one rank (chain config, environment) on one workload at a tick."""

    __tablename__ = "perfdb"
    __table_args__ = (
        _uq("perfdb", "cluster_id", "tick", "rank_id"),
        sa.Index("ix_perfdb_model_gpu", "model", "gpu_type", "config_key"),
    )

    id: int | None = Field(default=None, primary_key=True)
    cluster_id: str
    tick: int
    rank_id: str
    job_id: str
    env_id: str
    cloud: str
    market: str
    gpu_type: str
    model: str
    config_key: str
    engine_name: str
    engine_version: str
    tp: int
    pp: int
    dp: int
    ep: int
    weight_dtype: str
    n_replicas: int
    workload_kind: str
    isl: float
    osl: float
    rate_rps: float
    n_samples: int
    config: dict[str, Any] = Field(sa_column=json_column())
    observed_v: dict[str, Any] = Field(sa_column=json_column())
    observed_y: dict[str, Any] = Field(sa_column=json_column())
    predicted: dict[str, Any] = Field(sa_column=json_column())
    created_at: datetime | None = created_at_field()


class StageOutputRow(SQLModel, table=True):
    """The output of one tick stage (S0–S6) and the digest of the inputs it came from."""

    __tablename__ = "stage_outputs"
    __table_args__ = (_uq("stage_outputs", "cluster_id", "tick", "stage"),)

    id: int | None = Field(default=None, primary_key=True)
    cluster_id: str
    tick: int
    stage: str
    input_digest: str
    output_digest: str
    payload: Any = Field(sa_column=json_column())
    created_at: datetime | None = created_at_field()
    updated_at: datetime | None = updated_at_field()


#: Every table of the store, in creation order.
ALL_TABLES: tuple[type[SQLModel], ...] = (
    JobRow,
    TickRow,
    PlanRow,
    ActionRow,
    DeploymentRow,
    TelemetryRow,
    PredictionRow,
    EvidenceRowRecord,
    EdgeBeliefRow,
    MechanismBeliefRow,
    SlowStateRow,
    DeployLogRow,
    ClusterStateRow,
    PerfRow,
    StageOutputRow,
)

#: Names of the store's tables (the filter for Alembic comparisons on a shared database).
TABLE_NAMES: frozenset[str] = frozenset(t.__tablename__ for t in ALL_TABLES)  # type: ignore[attr-defined]
