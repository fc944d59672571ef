"""Observations and evidence: telemetry windows, stored predictions, EvidenceRow.

S1 reads one :class:`TelemetryWindow` per rank for [t-1, t] (sub-tick samples of
every V and Y in :mod:`koi.variables`). S2 compares it with the rank's stored
:class:`Prediction` and writes one :class:`EvidenceRow` per (tick, rank). S3 reads
the rows and fans them out into Beta updates (whitepaper, "Tick Algorithm").
"""

from __future__ import annotations

import math
from enum import StrEnum

from pydantic import Field, field_validator, model_validator

from koi import variables
from koi.domain.common import KoiModel


def _check_names(names: list[str] | set[str], allowed: tuple[str, ...], what: str) -> None:
    bad = sorted(set(names) - set(allowed))
    if bad:
        raise ValueError(f"{what}: unknown or non-observable variable(s) {bad}")


class TelemetryWindow(KoiModel):
    cluster_id: str
    tick: int = Field(ge=0)
    job_id: str
    rank_id: str
    env_id: str
    t_start: float
    t_end: float
    times: list[float] = Field(description="sample times, seconds on the cluster clock, increasing")
    series: dict[str, list[float]] = Field(description="variable name -> samples aligned with times")

    @field_validator("series")
    @classmethod
    def _names(cls, v: dict[str, list[float]]) -> dict[str, list[float]]:
        _check_names(set(v), variables.TELEMETRY_SERIES, "telemetry series")
        for name, xs in v.items():
            for i, x in enumerate(xs):
                if not math.isfinite(x):
                    raise ValueError(f"telemetry series {name!r}: sample {i} is not finite ({x})")
        return v

    @model_validator(mode="after")
    def _aligned(self) -> TelemetryWindow:
        if self.t_end < self.t_start:
            raise ValueError(f"t_end ({self.t_end}) precedes t_start ({self.t_start})")
        if any(b <= a for a, b in zip(self.times, self.times[1:], strict=False)):
            raise ValueError("telemetry times must be strictly increasing")
        for name, xs in self.series.items():
            if len(xs) != len(self.times):
                raise ValueError(f"telemetry series {name!r} has {len(xs)} samples for {len(self.times)} times")
        return self

    @property
    def n_samples(self) -> int:
        return len(self.times)


class Prediction(KoiModel):
    """The surrogate's Ŷ and V̂ for one rank, stored at plan time and read back in S2."""

    cluster_id: str
    tick: int = Field(ge=0, description="the tick whose plan made this prediction")
    job_id: str
    rank_id: str
    env_id: str
    values: dict[str, float] = Field(description="variable name -> predicted value")
    flags: list[str] = Field(default_factory=list, description="e.g. 'rescaled_gpu', 'nearest_arch'")

    @field_validator("values")
    @classmethod
    def _names(cls, v: dict[str, float]) -> dict[str, float]:
        _check_names(set(v), variables.TELEMETRY_SERIES, "prediction")
        return v


class Verdict(StrEnum):
    MATCHED = "matched"
    DIVERGED = "diverged"


class Quadrant(StrEnum):
    """Whitepaper, "Quadrant Classification": (V bundle, Y bundle)."""

    Q1 = "Q1"  # V matched, Y matched: replicable success
    Q2 = "Q2"  # V matched, Y diverged: sound mechanism, unlucky outcome
    Q3 = "Q3"  # V diverged, Y matched: lucky arm
    Q4 = "Q4"  # V diverged, Y diverged: falsified

    @classmethod
    def of(cls, v: Verdict, y: Verdict) -> Quadrant:
        if v is Verdict.MATCHED:
            return cls.Q1 if y is Verdict.MATCHED else cls.Q2
        return cls.Q3 if y is Verdict.MATCHED else cls.Q4


class IcpVerdict(StrEnum):
    ACCEPT = "accept"
    REJECT = "reject"
    UNDECIDED = "undecided"


class CusumResult(KoiModel):
    variable: str
    verdict: Verdict
    s_plus: float
    s_minus: float
    delta: float = Field(ge=0)
    h: float = Field(ge=0)
    residual_mean: float
    residual_std: float = Field(ge=0)
    n: int = Field(ge=0)


class MechanismEvidence(KoiModel):
    mechanism_id: str
    v_verdict: Verdict
    y_verdict: Verdict
    quadrant: Quadrant
    edges: list[str] = Field(default_factory=list, description="edge ids of the mechanism this row tests")


class EvidenceRow(KoiModel):
    """One per (tick, rank): what S2 concluded; S3 applies it."""

    cluster_id: str
    tick: int = Field(ge=0)
    job_id: str
    rank_id: str
    env_id: str
    n_samples: int = Field(ge=0)
    cusum: list[CusumResult] = Field(default_factory=list)
    mechanisms: list[MechanismEvidence] = Field(default_factory=list)
    icp: dict[str, IcpVerdict] = Field(default_factory=dict, description="edge id -> ICP verdict")
    residuals: dict[str, list[float]] = Field(
        default_factory=dict, description="variable -> residual samples (observed - predicted)"
    )
