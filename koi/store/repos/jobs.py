"""Jobs of a cluster and their lifecycle status (the cluster workflow's queue, persisted)."""

from __future__ import annotations

from collections.abc import Iterable

from sqlmodel import Session

from koi.domain import Job, JobState, JobStatus
from koi.store.repos._query import fresh
from koi.store.tables import JobRow
from koi.store.upsert import upsert

_KEY = ("cluster_id", "job_id")


def save_job_state(session: Session, cluster_id: str, state: JobState) -> None:
    """Insert or replace a job with its status and progress."""
    job = state.job
    upsert(
        session,
        JobRow,
        {
            "cluster_id": cluster_id,
            "job_id": job.job_id,
            "tenant": job.tenant,
            "model": job.model,
            "job_class": job.job_class.value,
            "status": state.status.value,
            "priority": job.priority,
            "submitted_at": job.submitted_at,
            "completed_requests": state.completed_requests,
            "admitted_tick": state.admitted_tick,
            "finished_at": state.finished_at,
            "payload": job.model_dump(mode="json"),
        },
        _KEY,
    )


def save_job(
    session: Session, cluster_id: str, job: Job, status: JobStatus | str = JobStatus.PENDING
) -> None:
    """Insert or replace a job with ``status`` (progress fields reset to their defaults)."""
    save_job_state(session, cluster_id, JobState(job=job, status=JobStatus(status)))


def _state(row: JobRow) -> JobState:
    return JobState(
        job=Job.model_validate(row.payload),
        status=JobStatus(row.status),
        completed_requests=row.completed_requests,
        admitted_tick=row.admitted_tick,
        finished_at=row.finished_at,
    )


def get_job(session: Session, cluster_id: str, job_id: str) -> JobState | None:
    row = session.exec(fresh(JobRow).where(JobRow.cluster_id == cluster_id, JobRow.job_id == job_id)).first()
    return None if row is None else _state(row)


def get_jobs(
    session: Session, cluster_id: str, status: JobStatus | str | Iterable[JobStatus | str] | None = None
) -> list[JobState]:
    """Jobs of a cluster in submission order, optionally only those with the given status(es)."""
    stmt = fresh(JobRow).where(JobRow.cluster_id == cluster_id)
    if status is not None:
        wanted = [status] if isinstance(status, str) else list(status)
        stmt = stmt.where(JobRow.status.in_([JobStatus(s).value for s in wanted]))
    stmt = stmt.order_by(JobRow.submitted_at, JobRow.job_id)
    return [_state(r) for r in session.exec(stmt)]


def set_job_status(
    session: Session, cluster_id: str, job_id: str, status: JobStatus | str, **progress: object
) -> bool:
    """Change a stored job's status (and ``completed_requests``/``admitted_tick``/``finished_at``).

    Returns False when the job is unknown.
    """
    current = get_job(session, cluster_id, job_id)
    if current is None:
        return False
    current.status = JobStatus(status)  # validated assignment (KoiModel)
    for name, value in progress.items():
        setattr(current, name, value)
    save_job_state(session, cluster_id, current)
    return True
