"""Capacity (the resource map R_t), live deployments and the frozen snapshot of S0."""

from __future__ import annotations

from collections import defaultdict
from enum import StrEnum

from pydantic import Field, model_validator

from koi.domain.chain import Ladder, Rank
from koi.domain.common import KoiModel
from koi.domain.hardware import Environment
from koi.domain.job import JobState, JobStatus


class Pool(KoiModel):
    """Whole instances of one shape in one environment."""

    env: Environment
    instance_type: str = Field(min_length=1)
    gpus_per_instance: int = Field(ge=1)
    total_instances: int = Field(ge=0)
    free_instances: int = Field(ge=0)
    hourly_price: float = Field(gt=0, description="$/hour per instance in this market")

    @model_validator(mode="after")
    def _free(self) -> Pool:
        if self.free_instances > self.total_instances:
            raise ValueError(
                f"pool {self.pool_id}: free_instances ({self.free_instances}) exceeds total ({self.total_instances})"
            )
        return self

    @property
    def pool_id(self) -> str:
        return f"{self.env.env_id}/{self.instance_type}"

    @property
    def free_gpus(self) -> int:
        return self.free_instances * self.gpus_per_instance

    @property
    def total_gpus(self) -> int:
        return self.total_instances * self.gpus_per_instance

    @property
    def gpu_hourly_price(self) -> float:
        return self.hourly_price / self.gpus_per_instance


class ResourceMap(KoiModel):
    pools: list[Pool] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique(self) -> ResourceMap:
        ids = [p.pool_id for p in self.pools]
        dup = {i for i in ids if ids.count(i) > 1}
        if dup:
            raise ValueError(f"duplicate pools in resource map: {sorted(dup)}")
        return self

    def pool(self, pool_id: str) -> Pool:
        for p in self.pools:
            if p.pool_id == pool_id:
                return p
        raise KeyError(f"no pool {pool_id!r} in the resource map")

    def find(self, env_id: str, instance_type: str) -> Pool | None:
        for p in self.pools:
            if p.env.env_id == env_id and p.instance_type == instance_type:
                return p
        return None

    def pool_for(self, rank: Rank) -> Pool | None:
        """The pool a rank launches into: its environment, and its instance type when the rank names one
        (else the first pool of that environment) — what every executor uses."""
        for p in self.pools:
            if p.env.env_id == rank.env.env_id and (not rank.config.instance_type
                                                    or p.instance_type == rank.config.instance_type):
                return p
        return None

    def free_gpus_by_env(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for p in self.pools:
            out[p.env.env_id] += p.free_gpus
        return dict(out)

    @property
    def total_gpus(self) -> int:
        return sum(p.total_gpus for p in self.pools)

    @property
    def free_gpus(self) -> int:
        return sum(p.free_gpus for p in self.pools)

    @property
    def environments(self) -> list[Environment]:
        seen: dict[str, Environment] = {}
        for p in self.pools:
            seen.setdefault(p.env.env_id, p.env)
        return [seen[k] for k in sorted(seen)]


class DeploymentState(StrEnum):
    LAUNCHING = "launching"  # instances requested, weights loading
    SERVING = "serving"
    DEGRADED = "degraded"  # fewer replicas materialised than asked, or a replica unhealthy
    DRAINING = "draining"  # torn down after an A/B overlap or termination
    FAILED = "failed"  # launch failed (capacity, OOM, an engine error)
    TERMINATED = "terminated"


def deployment_state(alive: int, ready: int, target: int) -> DeploymentState:
    """A rank's state from its replicas as a cloud lists them: DEGRADED below target (a replica lost or
    broken), else SERVING once every live replica runs, else LAUNCHING."""
    if alive < target:
        return DeploymentState.DEGRADED
    return DeploymentState.SERVING if ready >= alive else DeploymentState.LAUNCHING


class Deployment(KoiModel):
    """One rank of one job as it runs."""

    job_id: str
    rank: Rank
    state: DeploymentState = DeploymentState.LAUNCHING
    since_tick: int = Field(default=0, ge=0)
    replicas_ready: int = Field(default=0, ge=0)
    idempotency_key: str = ""

    @property
    def rank_id(self) -> str:
        return self.rank.rank_id(self.job_id)

    @property
    def is_live(self) -> bool:
        return self.state in (DeploymentState.LAUNCHING, DeploymentState.SERVING, DeploymentState.DEGRADED)


def carry_since(reported: list[Deployment], known: list[Deployment]) -> list[Deployment]:
    """The world's deployments with each rank's ``since_tick`` taken from our own record of it.

    Why: the world knows best what runs (state, replicas up) but not when we launched a rank; a
    simulator or cloud that reports none gave every rank ``since_tick`` 0 once its report replaced our
    record. Then the agent's view of a rank's age read a launch of this tick as one of tick 0, keep-all
    compensation (``deploy.py``), which marks the ranks launched this tick terminated, found none, and
    the settle window (:func:`koi.planning.split.sheds_settling`) could not tell a new rank from an old
    one. A rank we have no record of keeps what the world says.
    """
    since = {d.rank_id: d.since_tick for d in known}
    return [d.model_copy(update={"since_tick": since[d.rank_id]}) if d.rank_id in since else d for d in reported]


class ClusterSnapshot(KoiModel):
    """S0: jobs, deployments and capacity frozen for one tick."""

    cluster_id: str = Field(min_length=1)
    tick: int = Field(ge=0)
    now: float = Field(ge=0, description="seconds on the cluster clock")
    jobs: list[JobState] = Field(default_factory=list)
    deployments: list[Deployment] = Field(default_factory=list)
    resources: ResourceMap = Field(default_factory=ResourceMap)
    last_committed_tick: int | None = None

    def job(self, job_id: str) -> JobState:
        for j in self.jobs:
            if j.job.job_id == job_id:
                return j
        raise KeyError(f"no job {job_id!r} in the snapshot")

    @property
    def active_jobs(self) -> list[JobState]:
        return [j for j in self.jobs if j.status is JobStatus.ACTIVE]

    @property
    def pending_jobs(self) -> list[JobState]:
        return [j for j in self.jobs if j.status is JobStatus.PENDING]

    def ladder_of(self, job_id: str) -> Ladder | None:
        ranks = [d.rank for d in self.deployments if d.job_id == job_id and d.is_live]
        return Ladder(ranks=ranks) if ranks else None
