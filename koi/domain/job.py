"""Jobs: a model, a workload, a class, an SLO and a preference over objectives."""

from __future__ import annotations

import re
from enum import StrEnum

from pydantic import Field, field_validator, model_validator

from koi.domain.common import JobClass, KoiModel
from koi.domain.workload import WorkloadProfile
from koi.variables import OBJECTIVES

_JOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


class Slo(KoiModel):
    """Online: p99 TTFT and TPOT targets. Batch: a deadline and a request count."""

    p99_ttft_ms: float | None = Field(default=None, gt=0)
    p99_tpot_ms: float | None = Field(default=None, gt=0)
    deadline_s: float | None = Field(default=None, gt=0, description="seconds after submission")
    num_requests: int | None = Field(default=None, ge=1, description="requests a batch job must complete")


class ObjectiveWeights(KoiModel):
    """A weight vector on the simplex over the objectives, in the spec's order."""

    cost_per_token: float = Field(ge=0)
    p99_ttft_ms: float = Field(ge=0)
    p99_tpot_ms: float = Field(ge=0)
    throughput_tokens_per_sec: float = Field(ge=0)
    slo_margin: float = Field(ge=0)

    @model_validator(mode="after")
    def _simplex(self) -> ObjectiveWeights:
        s = sum(self.as_tuple())
        if abs(s - 1.0) > 1e-6:
            raise ValueError(f"objective weights must sum to 1 (the simplex), got {s:.6g}")
        return self

    def as_tuple(self) -> tuple[float, ...]:
        return tuple(getattr(self, k) for k in OBJECTIVES)

    @classmethod
    def from_sequence(cls, w: tuple[float, ...] | list[float]) -> ObjectiveWeights:
        if len(w) != len(OBJECTIVES):
            raise ValueError(f"need {len(OBJECTIVES)} weights in the order {OBJECTIVES}, got {len(w)}")
        return cls(**dict(zip(OBJECTIVES, w, strict=True)))


#: Class weights from whitepaper §"Exploitation: Augmented Tchebycheff".
ONLINE_WEIGHTS = ObjectiveWeights.from_sequence((0.10, 0.35, 0.35, 0.10, 0.10))
BATCH_WEIGHTS = ObjectiveWeights.from_sequence((0.35, 0.05, 0.05, 0.35, 0.20))


def _known_model(name: str) -> str:
    from koi.catalog import canonical_model

    return canonical_model(name)


class Job(KoiModel):
    job_id: str
    tenant: str = Field(default="default", min_length=1)
    model: str = Field(min_length=1, description="catalog model name")
    workload: WorkloadProfile
    job_class: JobClass
    slo: Slo
    priority: int = Field(default=1, ge=0, le=100, description="larger is more important")
    weights: ObjectiveWeights | None = Field(default=None, description="overrides the class weights")
    submitted_at: float = Field(default=0.0, ge=0, description="seconds on the cluster clock")
    lifetime_s: float | None = Field(default=None, gt=0, description="online jobs: seconds until the job leaves")

    @field_validator("job_id")
    @classmethod
    def _id(cls, v: str) -> str:
        if not _JOB_ID.match(v):
            raise ValueError("job_id must be 1-128 chars of letters, digits, '_', '.', '-', starting alphanumeric")
        return v

    @field_validator("model", mode="after")
    @classmethod
    def _model(cls, v: str) -> str:
        return _known_model(v)

    @model_validator(mode="after")
    def _class_slo(self) -> Job:
        if self.job_class is JobClass.ONLINE:
            missing = [k for k in ("p99_ttft_ms", "p99_tpot_ms") if getattr(self.slo, k) is None]
            if missing:
                raise ValueError(f"an online job needs latency targets: slo.{' and slo.'.join(missing)} missing")
            if self.workload.arrival.rate_rps <= 0:
                raise ValueError("an online job needs workload.arrival.rate_rps > 0")
        else:
            missing = [k for k in ("deadline_s", "num_requests") if getattr(self.slo, k) is None]
            if missing:
                raise ValueError(f"a batch job needs {' and '.join('slo.' + m for m in missing)}")
        return self

    @property
    def effective_weights(self) -> ObjectiveWeights:
        if self.weights is not None:
            return self.weights
        return ONLINE_WEIGHTS if self.job_class is JobClass.ONLINE else BATCH_WEIGHTS

    @property
    def deadline_at(self) -> float | None:
        return None if self.slo.deadline_s is None else self.submitted_at + self.slo.deadline_s

    @property
    def total_token_budget(self) -> float | None:
        """Output tokens a batch job must produce (mean output length x requests)."""
        if self.slo.num_requests is None:
            return None
        return self.slo.num_requests * self.workload.osl


class JobStatus(StrEnum):
    PENDING = "pending"
    ACTIVE = "active"
    FINISHED = "finished"
    CANCELLED = "cancelled"


class JobState(KoiModel):
    """A job as the cluster sees it at a tick."""

    job: Job
    status: JobStatus = JobStatus.PENDING
    completed_requests: int = Field(default=0, ge=0)
    admitted_tick: int | None = None
    finished_at: float | None = None
