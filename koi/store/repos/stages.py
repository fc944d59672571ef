"""Outputs of the tick stages S0–S6, keyed (cluster, tick, stage).

Every stage persists what it produced and a digest of what it was given, so a
replay of the stage on stored inputs can be checked against the stored output
(same input digest, same output digest).
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, TypeVar

from pydantic import BaseModel
from sqlmodel import Session

from koi.domain import stable_hash
from koi.store.columns import to_json
from koi.store.repos._query import fresh
from koi.store.tables import StageOutputRow
from koi.store.upsert import upsert

M = TypeVar("M", bound=BaseModel)

#: Digest length (hex chars) of stage inputs and outputs.
DIGEST_CHARS = 32


class Stage(StrEnum):
    """The spec's tick stages; stage names are free strings, these are the usual ones."""

    S0_SNAPSHOT = "S0_snapshot"
    S1_OBSERVE = "S1_observe"
    S2_VALIDATE = "S2_validate"
    S3_SLOW = "S3_slow"
    S4_PLAN = "S4_plan"
    S4_SEARCH = "S4_search"  # a policy's own search (not the deterministic proposer's), e.g. EvoX's generations
    S5_VALIDATE_PLAN = "S5_validate_plan"
    S6_DEPLOY = "S6_deploy"


def digest(obj: Any) -> str:
    """The digest stages use for inputs and outputs: sha256 of canonical JSON."""
    return stable_hash(to_json(obj), n=DIGEST_CHARS)


def save_stage_output(
    session: Session, cluster_id: str, tick: int, stage: Stage | str, payload: Any, input_digest: str
) -> str:
    """Insert or replace a stage's output; returns the output digest."""
    if not str(stage):
        raise ValueError("stage name must not be empty")
    body = to_json(payload)
    out = stable_hash(body, n=DIGEST_CHARS)
    upsert(
        session,
        StageOutputRow,
        {
            "cluster_id": cluster_id,
            "tick": tick,
            "stage": str(stage),
            "input_digest": input_digest,
            "output_digest": out,
            "payload": body,
        },
        ("cluster_id", "tick", "stage"),
    )
    return out


def load_stage_output(
    session: Session, cluster_id: str, tick: int, stage: Stage | str
) -> StageOutputRow | None:
    """The stored row: ``payload``, ``input_digest``, ``output_digest``."""
    stmt = fresh(StageOutputRow).where(
        StageOutputRow.cluster_id == cluster_id,
        StageOutputRow.tick == tick,
        StageOutputRow.stage == str(stage),
    )
    return session.exec(stmt).first()


def load_stage_model(
    session: Session, cluster_id: str, tick: int, stage: Stage | str, model: type[M]
) -> M | None:
    """The stored output validated into ``model`` (e.g. ``ClusterSnapshot`` for S0)."""
    row = load_stage_output(session, cluster_id, tick, stage)
    return None if row is None else model.model_validate(row.payload)


def list_stage_outputs(session: Session, cluster_id: str, tick: int) -> list[StageOutputRow]:
    stmt = fresh(StageOutputRow).where(StageOutputRow.cluster_id == cluster_id, StageOutputRow.tick == tick)
    return list(session.exec(stmt.order_by(StageOutputRow.stage)))


def list_stage_outputs_like(session: Session, cluster_id: str, *prefixes: str) -> list[StageOutputRow]:
    """Every tick's outputs of the stages named ``<prefix>/…`` (e.g. the planners' per-attempt reports),
    ordered by tick and stage; read without touching the other stages' (large) payloads."""
    from sqlalchemy import or_

    stmt = fresh(StageOutputRow).where(StageOutputRow.cluster_id == cluster_id,
                                       or_(*(StageOutputRow.stage.like(f"{p}/%") for p in prefixes)))  # type: ignore[attr-defined]
    return list(session.exec(stmt.order_by(StageOutputRow.tick, StageOutputRow.stage)))
