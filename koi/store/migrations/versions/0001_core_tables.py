"""Core tables: jobs, ticks, plans, actions, deployments, observations, beliefs, slow state, deploy log, fence.

Revision ID: 0001
Revises:
Create Date: 2026-11-29

Written by hand to be dialect-neutral (SQLite and PostgreSQL): plain JSON for
payloads, VARCHAR without length, timestamps with time zone. The helpers below are
frozen copies, not imports, so later edits to the tables cannot change this revision.
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _id() -> sa.Column:
    return sa.Column("id", sa.Integer(), primary_key=True, nullable=False)


def _s(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.String(), nullable=nullable)


def _i(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.Integer(), nullable=nullable)


def _f(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.Float(), nullable=nullable)


def _json(name: str, nullable: bool = False) -> sa.Column:
    return sa.Column(name, sa.JSON(none_as_null=True), nullable=nullable)


def _created() -> sa.Column:
    return sa.Column(
        "created_at", sa.DateTime(timezone=True), server_default=sa.text("CURRENT_TIMESTAMP"), nullable=False
    )


def _updated() -> sa.Column:
    return sa.Column("updated_at", sa.DateTime(timezone=True), nullable=True)


def _per_rank(name: str, *extra: sa.Column) -> None:
    """telemetry_windows, predictions, evidence_rows: one row per (cluster, tick, rank)."""
    op.create_table(
        name,
        _id(),
        _s("cluster_id"),
        _i("tick"),
        _s("rank_id"),
        _s("job_id"),
        _s("env_id"),
        *extra,
        _json("payload"),
        _created(),
        sa.UniqueConstraint("cluster_id", "tick", "rank_id", name=f"uq_{name}_key"),
    )


def upgrade() -> None:
    op.create_table(
        "jobs",
        _id(),
        _s("cluster_id"),
        _s("job_id"),
        _s("tenant"),
        _s("model"),
        _s("job_class"),
        _s("status"),
        _i("priority"),
        _f("submitted_at"),
        _i("completed_requests"),
        _i("admitted_tick", nullable=True),
        _f("finished_at", nullable=True),
        _json("payload"),
        _created(),
        _updated(),
        sa.UniqueConstraint("cluster_id", "job_id", name="uq_jobs_key"),
    )
    op.create_index("ix_jobs_cluster_status", "jobs", ["cluster_id", "status"])

    op.create_table(
        "ticks",
        _id(),
        _s("cluster_id"),
        _i("tick"),
        _s("status"),
        _s("reason"),
        _json("timings"),
        _created(),
        _updated(),
        sa.UniqueConstraint("cluster_id", "tick", name="uq_ticks_key"),
    )

    op.create_table(
        "plans",
        _id(),
        _s("cluster_id"),
        _i("tick"),
        _s("proposer"),
        sa.Column("committed", sa.Boolean(), nullable=False),
        _i("n_actions"),
        _s("digest"),
        _json("payload"),
        _created(),
        _updated(),
        sa.UniqueConstraint("cluster_id", "tick", name="uq_plans_key"),
    )

    op.create_table(
        "actions",
        _id(),
        _s("cluster_id"),
        _i("tick"),
        _i("seq"),
        _s("job_id"),
        _s("action_type"),
        _s("issuer"),
        _s("mechanism_id", nullable=True),
        _s("ladder_key", nullable=True),
        _json("payload"),
        _created(),
        sa.ForeignKeyConstraint(
            ["cluster_id", "tick"],
            ["plans.cluster_id", "plans.tick"],
            name="fk_actions_plans",
            ondelete="CASCADE",
        ),
        sa.UniqueConstraint("cluster_id", "tick", "seq", name="uq_actions_key"),
    )
    op.create_index("ix_actions_cluster_job", "actions", ["cluster_id", "job_id"])

    op.create_table(
        "deployments",
        _id(),
        _s("cluster_id"),
        _s("job_id"),
        _s("rank_id"),
        _s("env_id"),
        _s("gpu_type"),
        _s("state"),
        _i("n_replicas"),
        _i("replicas_ready"),
        _i("since_tick"),
        _i("updated_tick"),
        _s("idempotency_key"),
        _json("payload"),
        _created(),
        _updated(),
        sa.UniqueConstraint("cluster_id", "rank_id", name="uq_deployments_key"),
    )
    op.create_index("ix_deployments_cluster_job", "deployments", ["cluster_id", "job_id"])

    _per_rank("telemetry_windows", _f("t_start"), _f("t_end"), _i("n_samples"))
    _per_rank("predictions")
    _per_rank("evidence_rows", _i("n_samples"))

    op.create_table(
        "edge_beliefs",
        _id(),
        _s("cluster_id"),
        _i("tick"),
        _s("edge_id"),
        _f("alpha"),
        _f("beta"),
        _created(),
        sa.UniqueConstraint("cluster_id", "edge_id", "tick", name="uq_edge_beliefs_key"),
    )
    op.create_table(
        "mechanism_beliefs",
        _id(),
        _s("cluster_id"),
        _i("tick"),
        _s("mechanism_id"),
        _f("alpha"),
        _f("beta"),
        _json("definition"),
        _created(),
        sa.UniqueConstraint("cluster_id", "mechanism_id", "tick", name="uq_mechanism_beliefs_key"),
    )
    op.create_table(
        "slow_state",
        _id(),
        _s("cluster_id"),
        _i("tick"),
        _json("payload"),
        _created(),
        sa.UniqueConstraint("cluster_id", "tick", name="uq_slow_state_key"),
    )

    op.create_table(
        "deploy_log",
        _id(),
        _s("cluster_id"),
        _i("tick"),
        _s("job_id"),
        _s("rank_id"),
        _s("idempotency_key"),
        _s("status"),
        _json("detail", nullable=True),
        _created(),
        _updated(),
        sa.UniqueConstraint("idempotency_key", name="uq_deploy_log_key"),
    )
    op.create_index("ix_deploy_log_cluster_tick", "deploy_log", ["cluster_id", "tick"])

    op.create_table(
        "cluster_state",
        sa.Column("cluster_id", sa.String(), primary_key=True, nullable=False),
        _i("last_committed_tick", nullable=True),
        _created(),
        _updated(),
    )


def downgrade() -> None:
    op.drop_table("cluster_state")
    op.drop_index("ix_deploy_log_cluster_tick", table_name="deploy_log")
    op.drop_table("deploy_log")
    for name in (
        "slow_state",
        "mechanism_beliefs",
        "edge_beliefs",
        "evidence_rows",
        "predictions",
        "telemetry_windows",
    ):
        op.drop_table(name)
    op.drop_index("ix_deployments_cluster_job", table_name="deployments")
    op.drop_table("deployments")
    op.drop_index("ix_actions_cluster_job", table_name="actions")
    op.drop_table("actions")
    op.drop_table("plans")
    op.drop_table("ticks")
    op.drop_index("ix_jobs_cluster_status", table_name="jobs")
    op.drop_table("jobs")
