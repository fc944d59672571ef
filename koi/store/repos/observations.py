"""Per-rank records of a tick: telemetry windows (S1), predictions (plan time), EvidenceRows (S2).

Each is keyed (cluster, tick, rank), so S1 and S2 may run again and leave one row.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, TypeVar

from pydantic import BaseModel
from sqlmodel import Session

from koi.domain import EvidenceRow, Prediction, TelemetryWindow
from koi.store.repos._query import fresh, tick_filter
from koi.store.tables import EvidenceRowRecord, PredictionRow, TelemetryRow
from koi.store.upsert import upsert

_KEY = ("cluster_id", "tick", "rank_id")
M = TypeVar("M", bound=BaseModel)


def _base(m: TelemetryWindow | Prediction | EvidenceRow) -> dict[str, Any]:
    return {
        "cluster_id": m.cluster_id,
        "tick": m.tick,
        "rank_id": m.rank_id,
        "job_id": m.job_id,
        "env_id": m.env_id,
        "payload": m.model_dump(mode="json"),
    }


def _read(
    session: Session,
    table: Any,
    model: type[M],
    cluster_id: str,
    tick: int | None,
    start: int | None,
    end: int | None,
    rank_id: str | None,
    job_id: str | None,
) -> list[M]:
    stmt = tick_filter(fresh(table).where(table.cluster_id == cluster_id), table, tick, start, end)
    if rank_id is not None:
        stmt = stmt.where(table.rank_id == rank_id)
    if job_id is not None:
        stmt = stmt.where(table.job_id == job_id)
    stmt = stmt.order_by(table.tick, table.rank_id)
    return [model.model_validate(r.payload) for r in session.exec(stmt)]


# ---- telemetry (S1) -------------------------------------------------------------------------
def save_telemetry(session: Session, windows: TelemetryWindow | Iterable[TelemetryWindow]) -> int:
    ws = [windows] if isinstance(windows, TelemetryWindow) else list(windows)
    rows = [{**_base(w), "t_start": w.t_start, "t_end": w.t_end, "n_samples": w.n_samples} for w in ws]
    return upsert(session, TelemetryRow, rows, _KEY)


def get_telemetry(
    session: Session,
    cluster_id: str,
    tick: int | None = None,
    *,
    start: int | None = None,
    end: int | None = None,
    rank_id: str | None = None,
    job_id: str | None = None,
) -> list[TelemetryWindow]:
    """Windows of one tick, or of the inclusive tick range [start, end]."""
    return _read(session, TelemetryRow, TelemetryWindow, cluster_id, tick, start, end, rank_id, job_id)


# ---- predictions (stored at plan time, read in S2) ----------------------------------------------
def save_prediction(session: Session, predictions: Prediction | Iterable[Prediction]) -> int:
    ps = [predictions] if isinstance(predictions, Prediction) else list(predictions)
    return upsert(session, PredictionRow, [_base(p) for p in ps], _KEY)


def get_predictions(
    session: Session,
    cluster_id: str,
    tick: int | None = None,
    *,
    start: int | None = None,
    end: int | None = None,
    rank_id: str | None = None,
    job_id: str | None = None,
) -> list[Prediction]:
    return _read(session, PredictionRow, Prediction, cluster_id, tick, start, end, rank_id, job_id)


# ---- evidence (S2, read by S3) ------------------------------------------------------------------------
def save_evidence(session: Session, rows: EvidenceRow | Iterable[EvidenceRow]) -> int:
    es = [rows] if isinstance(rows, EvidenceRow) else list(rows)
    return upsert(session, EvidenceRowRecord, [{**_base(e), "n_samples": e.n_samples} for e in es], _KEY)


def get_evidence(
    session: Session,
    cluster_id: str,
    tick: int | None = None,
    *,
    start: int | None = None,
    end: int | None = None,
    rank_id: str | None = None,
    job_id: str | None = None,
) -> list[EvidenceRow]:
    """EvidenceRows of one tick, or of the inclusive tick range [start, end]."""
    return _read(session, EvidenceRowRecord, EvidenceRow, cluster_id, tick, start, end, rank_id, job_id)
