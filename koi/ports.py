"""The two ports between Koi and a fleet: an Executor that changes it, an Observer that reads it.

``infra/`` implements them: over the simulator (``infra/sim.py``, the embedded default and every
benchmark), over a cloud API (Amazon EC2 via boto3, ``infra/aws.py``; Google Compute Engine via
google-cloud-compute, ``infra/gcp.py``) and over engine metrics (vLLM's Prometheus endpoint,
``infra/vllm_metrics.py``), joined in ``infra/cloud.py``. Koi's stages only ever see these
protocols, so the same tick runs against the simulated world and a real one.

Deploy is idempotent: every launch carries an idempotency key (cluster, tick, job,
rank); an executor that has already applied a key returns the earlier result
instead of launching twice (DESIGN.md, "The tick").
"""

from __future__ import annotations

from enum import StrEnum
from typing import Protocol, runtime_checkable

from pydantic import Field

from koi.domain import Job, Rank, ResourceMap, TelemetryWindow
from koi.domain.common import KoiModel


class LaunchStatus(StrEnum):
    LAUNCHED = "launched"  # accepted; replicas cold-starting
    FAILED = "failed"  # the engine or the cloud refused it (no capacity, OOM, bad shape)
    DUPLICATE = "duplicate"  # this idempotency key was applied before; nothing new happened


class LaunchResult(KoiModel):
    job_id: str
    rank_id: str
    idempotency_key: str
    status: LaunchStatus
    replicas_requested: int = Field(ge=0)
    replicas_launched: int = Field(ge=0)
    reason: str = ""
    ready_at: float | None = Field(default=None, description="when the replicas are expected to serve")


@runtime_checkable
class Executor(Protocol):
    """The only side-effecting step of a tick (S6)."""

    def launch(self, job: Job, rank: Rank, idempotency_key: str) -> LaunchResult: ...

    def teardown(self, job_id: str, rank_id: str, idempotency_key: str, *, drain_s: float = 0.0,
                 handover: bool = False) -> bool:
        """Drain then release a rank; True when something was torn down (False: already gone).

        ``handover``: a swap's make-before-break — the rank keeps taking traffic until another
        rank of the job serves (bounded by the executor's own timeout), then drains."""
        ...

    def scale(
        self, job_id: str, rank_id: str, n_replicas: int, idempotency_key: str, *, drain_s: float | None = None
    ) -> LaunchResult:
        """Resize a rank. A scale-down drains the removed replicas for ``drain_s`` (the executor's
        default when None) before their instances are free; 0 releases them at once."""
        ...

    def reweight(self, job_id: str, rank_id: str, route_weight: float, idempotency_key: str) -> bool:
        """Set a running rank's gateway weight (``Rank.route_weight``); no replica starts or stops.
        True when the rank runs and took the weight (False: no such rank, or a repeated key)."""
        ...


@runtime_checkable
class Observer(Protocol):
    """What S0 and S1 read."""

    def now(self) -> float: ...

    def capacity(self) -> ResourceMap: ...

    def telemetry(self, t_start: float, t_end: float, *, cluster_id: str, tick: int) -> list[TelemetryWindow]: ...
