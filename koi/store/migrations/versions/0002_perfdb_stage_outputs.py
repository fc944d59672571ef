"""The performance database and per-stage outputs (replay of a tick on stored inputs).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _s(name: str) -> sa.Column:
    return sa.Column(name, sa.String(), nullable=False)


def _i(name: str) -> sa.Column:
    return sa.Column(name, sa.Integer(), nullable=False)


def _f(name: str) -> sa.Column:
    return sa.Column(name, sa.Float(), nullable=False)


def _json(name: str) -> sa.Column:
    return sa.Column(name, sa.JSON(none_as_null=True), nullable=False)


def _ts(name: str, *, server_now: bool) -> sa.Column:
    if server_now:
        return sa.Column(
            name, sa.DateTime(timezone=True), server_default=sa.text("CURRENT_TIMESTAMP"), nullable=False
        )
    return sa.Column(name, sa.DateTime(timezone=True), nullable=True)


def upgrade() -> None:
    op.create_table(
        "perfdb",
        sa.Column("id", sa.Integer(), primary_key=True, nullable=False),
        *(_s(c) for c in ("cluster_id",)),
        _i("tick"),
        *(
            _s(c)
            for c in ("rank_id", "job_id", "env_id", "cloud", "market", "gpu_type", "model", "config_key")
        ),
        *(_s(c) for c in ("engine_name", "engine_version")),
        *(_i(c) for c in ("tp", "pp", "dp", "ep")),
        _s("weight_dtype"),
        _i("n_replicas"),
        _s("workload_kind"),
        *(_f(c) for c in ("isl", "osl", "rate_rps")),
        _i("n_samples"),
        *(_json(c) for c in ("config", "observed_v", "observed_y", "predicted")),
        _ts("created_at", server_now=True),
        sa.UniqueConstraint("cluster_id", "tick", "rank_id", name="uq_perfdb_key"),
    )
    op.create_index("ix_perfdb_model_gpu", "perfdb", ["model", "gpu_type", "config_key"])

    op.create_table(
        "stage_outputs",
        sa.Column("id", sa.Integer(), primary_key=True, nullable=False),
        _s("cluster_id"),
        _i("tick"),
        _s("stage"),
        _s("input_digest"),
        _s("output_digest"),
        _json("payload"),
        _ts("created_at", server_now=True),
        _ts("updated_at", server_now=False),
        sa.UniqueConstraint("cluster_id", "tick", "stage", name="uq_stage_outputs_key"),
    )


def downgrade() -> None:
    op.drop_table("stage_outputs")
    op.drop_index("ix_perfdb_model_gpu", table_name="perfdb")
    op.drop_table("perfdb")
