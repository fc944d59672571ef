"""Workload profiles: request lengths, arrival process, shared prefixes."""

from __future__ import annotations

from enum import StrEnum

from pydantic import Field, model_validator

from koi.domain.common import KoiModel


class LengthKind(StrEnum):
    FIXED = "fixed"
    UNIFORM = "uniform"
    NORMAL = "normal"
    LOGNORMAL = "lognormal"


class LengthDist(KoiModel):
    """A token-length distribution, clipped to [min, max]."""

    kind: LengthKind = LengthKind.LOGNORMAL
    mean: float = Field(gt=0, description="mean tokens")
    std: float = Field(default=0.0, ge=0)
    min: int = Field(default=1, ge=1)
    max: int = Field(default=131072, ge=1)

    @model_validator(mode="after")
    def _bounds(self) -> LengthDist:
        if self.min > self.max:
            raise ValueError(f"min ({self.min}) must not exceed max ({self.max})")
        if not self.min <= self.mean <= self.max:
            raise ValueError(f"mean ({self.mean}) must lie in [min, max] = [{self.min}, {self.max}]")
        if self.kind is LengthKind.FIXED and self.std:
            raise ValueError("a fixed length has std 0")
        return self


class ArrivalProcess(StrEnum):
    POISSON = "poisson"
    CONSTANT = "constant"
    GAMMA = "gamma"


class Arrival(KoiModel):
    """Request arrival process. ``cv`` (coefficient of variation of inter-arrival
    times) applies to gamma: cv > 1 is burstier than Poisson (cv = 1), cv < 1 smoother."""

    process: ArrivalProcess = ArrivalProcess.POISSON
    rate_rps: float = Field(ge=0, description="mean requests per second")
    cv: float = Field(default=1.0, gt=0)

    @model_validator(mode="after")
    def _cv(self) -> Arrival:
        if self.process is ArrivalProcess.POISSON and self.cv != 1.0:
            raise ValueError("a Poisson process has cv = 1; use process 'gamma' for another cv")
        if self.process is ArrivalProcess.CONSTANT and self.cv != 1.0:
            raise ValueError("a constant process has no cv; leave it at its default")
        return self


class WorkloadProfile(KoiModel):
    kind: str = Field(default="chat", description="label: moderation, chat, code, rag, summarization, agentic ...")
    input_len: LengthDist
    output_len: LengthDist
    arrival: Arrival = Field(default_factory=lambda: Arrival(rate_rps=0.0))
    shared_prefix_fraction: float = Field(default=0.0, ge=0, le=1, description="share of requests with a shared prefix")
    shared_prefix_len: int = Field(default=0, ge=0, description="tokens of the shared prefix")
    session_affinity: bool = False

    @model_validator(mode="after")
    def _prefix(self) -> WorkloadProfile:
        if self.shared_prefix_fraction > 0 and self.shared_prefix_len <= 0:
            raise ValueError("shared_prefix_fraction > 0 needs shared_prefix_len > 0")
        if self.shared_prefix_len > self.input_len.max:
            raise ValueError(
                f"shared_prefix_len ({self.shared_prefix_len}) exceeds the longest input ({self.input_len.max})"
            )
        return self

    @property
    def isl(self) -> float:
        return self.input_len.mean

    @property
    def osl(self) -> float:
        return self.output_len.mean
