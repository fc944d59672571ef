"""Scenario files: the world a benchmark runs in, as a validated pydantic schema.

A scenario declares the fleet (pools of whole instances in environments), the jobs
that arrive and leave, timed capacity events (spot reclaims, capacity returning,
node failures), lifecycle figures (boot, weight load, warm-up, drain) and the
*hidden* effects the planner never reads (per-environment efficiency, an engine
change at a given time, noisy neighbours, degraded interconnect). The schema is
documented field by field in ``koi/sim/SCENARIO.md``.

Everything is validated on load, and errors name the place: an unknown GPU, model
or instance type, a pool in a region the catalog does not sell it in, a fixed
deployment that does not fit memory or whose TP does not divide the heads. Those
deployment checks need the memory model, so they run in :func:`load_scenario`
(``check_deployments=True``) after the pure schema validation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, field_validator, model_validator

from koi import catalog
from koi.domain import ChainConfig, Environment, InstanceType, Job, JobClass, Market
from koi.domain.common import KoiModel, normalise_market


class ScenarioError(ValueError):
    """A scenario file is malformed or names something impossible; the message says where."""


# ---- fleet ---------------------------------------------------------------------------------------
class Lifecycle(KoiModel):
    """Deployment lifecycle figures (per pool, with scenario-wide defaults).

    Cold start = ``provision_s`` (instance boot and container pull) + weight load
    (weight bytes per GPU / ``load_gbps``, each GPU reads its shard in parallel) +
    ``warmup_s`` (engine profiling run and CUDA-graph capture). The defaults are
    typical of cloud GPU VMs pulling weights from object storage: 2 GB/s per GPU is
    what a local NVMe cache or a well-provisioned bucket sustains per reader.
    """

    provision_s: float = Field(default=90.0, ge=0, description="instance boot + image pull, seconds")
    load_gbps: float = Field(default=2.0, gt=0, description="weight load bandwidth per GPU, GB/s")
    warmup_s: float = Field(default=30.0, ge=0, description="engine warm-up (profiling, CUDA graphs), seconds")
    materialize_fail_prob: float = Field(
        default=0.0, ge=0, le=1, description="probability that a launched replica never comes up"
    )
    degraded_prob: float = Field(default=0.0, ge=0, le=1, description="probability a replica comes up degraded")
    degraded_factor: float = Field(
        default=0.6, gt=0, le=1, description="throughput of a degraded replica relative to a healthy one"
    )


class LifecycleOverride(KoiModel):
    provision_s: float | None = Field(default=None, ge=0)
    load_gbps: float | None = Field(default=None, gt=0)
    warmup_s: float | None = Field(default=None, ge=0)
    materialize_fail_prob: float | None = Field(default=None, ge=0, le=1)
    degraded_prob: float | None = Field(default=None, ge=0, le=1)
    degraded_factor: float | None = Field(default=None, gt=0, le=1)


class PoolSpec(KoiModel):
    """Whole instances of one shape in one environment (cloud, region, zone, market)."""

    name: str | None = Field(default=None, description="short handle used by events and deployments")
    cloud: str = Field(min_length=1)
    region: str = Field(min_length=1)
    zone: str | None = Field(default=None, description="default: <region>-a")
    market: Market
    instance_type: str = Field(min_length=1)
    instances: int = Field(ge=0, description="instances the cloud will give at t=0")
    price_hourly: float | None = Field(default=None, gt=0, description="$/h per instance; default from the catalog")
    reclaim_rate_per_hour: float = Field(
        default=0.0, ge=0, description="spot: reclaim hazard per allocated instance-hour"
    )
    return_after_s: float = Field(default=1800.0, gt=0, description="mean delay before reclaimed capacity returns")
    failure_rate_per_hour: float = Field(default=0.0, ge=0, description="node-failure hazard per allocated instance-hour")
    repair_s: float = Field(default=3600.0, gt=0, description="mean delay before a failed node's capacity returns")
    lifecycle: LifecycleOverride = Field(default_factory=LifecycleOverride)

    @field_validator("market", mode="before")
    @classmethod
    def _market(cls, v: Any) -> Any:
        return normalise_market(v)

    @field_validator("cloud", "region", mode="after")
    @classmethod
    def _lower(cls, v: str) -> str:
        return v.lower()

    @model_validator(mode="after")
    def _spot_only(self) -> PoolSpec:
        if self.reclaim_rate_per_hour and self.market is not Market.SPOT:
            raise ValueError("reclaim_rate_per_hour applies to spot pools only")
        return self

    @property
    def zone_name(self) -> str:
        return self.zone or f"{self.region}-a"

    @property
    def handle(self) -> str:
        return self.name or f"{self.cloud}/{self.zone_name}/{self.market.value}/{self.instance_type}"


# ---- events --------------------------------------------------------------------------------------
EventKind = Literal["spot_reclaim", "capacity_return", "node_failure", "set_capacity"]


class CapacityEvent(KoiModel):
    """A timed change of a pool's capacity.

    - ``spot_reclaim``: the cloud takes back ``instances`` (allocated ones first, since
      that is what a reclaim notice hits; replicas on them die); the capacity returns
      after ``return_after_s`` (default: the pool's mean ``return_after_s``);
    - ``node_failure``: ``instances`` allocated nodes fail (free ones when none are
      allocated); capacity returns after the pool's ``repair_s``;
    - ``capacity_return``: ``instances`` come back;
    - ``set_capacity``: the pool's capacity becomes ``instances``.
    """

    at_s: float = Field(ge=0)
    kind: EventKind
    pool: str = Field(min_length=1, description="pool name (or handle)")
    instances: int = Field(default=1, ge=0)
    return_after_s: float | None = Field(default=None, gt=0)


# ---- hidden effects ------------------------------------------------------------------------------
class Match(KoiModel):
    """Which replicas an effect touches: every given field must equal the replica's."""

    cloud: str | None = None
    region: str | None = None
    zone: str | None = None
    market: Market | None = None
    gpu_type: str | None = None
    instance_type: str | None = None
    model: str | None = None
    engine_name: str | None = None
    job_id: str | None = None

    @field_validator("market", mode="before")
    @classmethod
    def _market(cls, v: Any) -> Any:
        return normalise_market(v)

    @field_validator("gpu_type", mode="after")
    @classmethod
    def _gpu(cls, v: str | None) -> str | None:
        return None if v is None else catalog.canonical_gpu(v)

    @field_validator("model", mode="after")
    @classmethod
    def _model(cls, v: str | None) -> str | None:
        return None if v is None else catalog.canonical_model(v)


HiddenKind = Literal["efficiency", "engine_change", "noisy_neighbours", "interconnect"]


class HiddenEffect(KoiModel):
    """An effect on serving the planner never sees except through telemetry.

    - ``efficiency``: ``step_time_factor`` multiplies every engine iteration's time
      (virtualization overhead, topology, thermal limits); > 1 is slower;
    - ``engine_change``: from ``start_s`` the matched replicas' throughput is multiplied
      by ``throughput_factor`` (an engine, driver or NCCL update: 0.7–1.3 in the paper);
      ``applies_to: new`` touches only replicas launched after ``start_s`` (a rollout
      through redeployment), ``all`` touches running ones too (a live driver update);
    - ``noisy_neighbours``: a per-replica, per-sample multiplicative slowdown, lognormal
      with mean ``step_time_factor`` and coefficient of variation ``jitter_cv``;
    - ``interconnect``: ``comm_factor`` multiplies the collective part of each iteration
      (a degraded fabric, a PCIe switch shared with another tenant).
    """

    kind: HiddenKind
    match: Match = Field(default_factory=Match)
    start_s: float = Field(default=0.0, ge=0)
    end_s: float | None = Field(default=None, gt=0)
    step_time_factor: float = Field(default=1.0, gt=0)
    throughput_factor: float = Field(default=1.0, gt=0)
    comm_factor: float = Field(default=1.0, gt=0)
    jitter_cv: float = Field(default=0.0, ge=0, le=2)
    applies_to: Literal["all", "new"] = "all"
    note: str = ""

    @model_validator(mode="after")
    def _fields(self) -> HiddenEffect:
        if self.end_s is not None and self.end_s <= self.start_s:
            raise ValueError(f"end_s ({self.end_s}) must be after start_s ({self.start_s})")
        if self.kind == "engine_change" and self.throughput_factor == 1.0:
            raise ValueError("an engine_change needs a throughput_factor other than 1")
        if self.kind != "engine_change" and self.throughput_factor != 1.0:
            raise ValueError("throughput_factor belongs to engine_change effects")
        if self.kind == "interconnect" and self.comm_factor == 1.0:
            raise ValueError("an interconnect effect needs a comm_factor other than 1")
        if self.kind != "noisy_neighbours" and self.jitter_cv:
            raise ValueError("jitter_cv belongs to noisy_neighbours effects")
        if self.kind != "engine_change" and self.applies_to != "all":
            raise ValueError("applies_to belongs to engine_change effects")
        return self


# ---- fixed deployments ---------------------------------------------------------------------------
class DeploySpec(KoiModel):
    """One rank of a fixed deployment (used by ``koi sim run`` and the benchmark)."""

    pool: str = Field(min_length=1, description="pool name (or handle)")
    config: ChainConfig = Field(default_factory=ChainConfig)
    n_replicas: int = Field(default=1, ge=1, le=4096)


class JobSpec(KoiModel):
    """A job as the scenario submits it, with an optional fixed deployment."""

    job: Job
    deploy: list[DeploySpec] | None = Field(
        default=None, description="fixed ranks for `koi sim run`; derived (first feasible pool) when absent"
    )


# ---- the scenario ----------------------------------------------------------------------------------
class Scenario(KoiModel):
    name: str = Field(min_length=1)
    description: str = ""
    seed: int = Field(default=0, ge=0)
    duration_s: float = Field(gt=0, description="simulated seconds `koi sim run` runs by default")
    step_s: float = Field(default=1.0, ge=0.05, le=10.0, description="macro-step of the replica engine")
    sample_s: float = Field(default=15.0, ge=1.0, le=300.0, description="telemetry sub-tick sample period")
    drain_s: float = Field(default=30.0, ge=0, description="default drain on teardown")
    gateway_timeout_s: float = Field(
        default=60.0, gt=0, description="an online request waiting this long at the gateway with no replica is dropped"
    )
    client_timeout_s: float = Field(
        default=600.0, gt=0, description="an online request queued on an engine this long without a first token is abandoned"
    )
    lifecycle: Lifecycle = Field(default_factory=Lifecycle)
    instance_types: list[InstanceType] = Field(
        default_factory=list, description="extra instance shapes (private clouds, test fixtures)"
    )
    pools: list[PoolSpec] = Field(min_length=1)
    events: list[CapacityEvent] = Field(default_factory=list)
    hidden: list[HiddenEffect] = Field(default_factory=list)
    jobs: list[JobSpec] = Field(default_factory=list)

    @model_validator(mode="before")
    @classmethod
    def _jobs_shorthand(cls, v: Any) -> Any:
        # Accept a job written flat (its fields beside `deploy`) as well as {job: ..., deploy: ...}.
        if isinstance(v, dict) and isinstance(v.get("jobs"), list):
            jobs = []
            for j in v["jobs"]:
                if isinstance(j, dict) and "job" not in j:
                    j = dict(j)
                    deploy = j.pop("deploy", None)
                    j = {"job": j, "deploy": deploy}
                jobs.append(j)
            v = {**v, "jobs": jobs}
        return v

    @model_validator(mode="after")
    def _references(self) -> Scenario:
        extra = {(i.cloud, i.name): i for i in self.instance_types}
        handles: dict[str, int] = {}
        for idx, p in enumerate(self.pools):
            it = extra.get((p.cloud, p.instance_type))
            if it is None:
                try:
                    it = catalog.instance(p.cloud, p.instance_type)
                except catalog.CatalogError as exc:
                    raise ValueError(f"pools[{idx}] ({p.handle}): {exc}") from None
            if p.price_hourly is None:
                try:
                    it.hourly_price(p.region, p.market)
                except ValueError as exc:
                    raise ValueError(f"pools[{idx}] ({p.handle}): {exc}; give price_hourly") from None
            for h in {p.handle, p.name} - {None}:
                if h in handles and handles[h] != idx:
                    raise ValueError(f"pools[{idx}]: duplicate pool name {h!r} (also pools[{handles[h]}])")
                handles[h] = idx
        envs = [(p.cloud, p.region, p.zone_name, p.market, p.instance_type) for p in self.pools]
        dup = {e for e in envs if envs.count(e) > 1}
        if dup:
            raise ValueError(f"two pools share an environment and instance type: {sorted(map(str, dup))}")
        for i, ev in enumerate(self.events):
            if ev.pool not in handles:
                raise ValueError(f"events[{i}]: unknown pool {ev.pool!r}; pools are {sorted(handles)}")
        ids = [j.job.job_id for j in self.jobs]
        dup_ids = {i for i in ids if ids.count(i) > 1}
        if dup_ids:
            raise ValueError(f"duplicate job ids: {sorted(dup_ids)}")
        for j in self.jobs:
            for k, d in enumerate(j.deploy or []):
                if d.pool not in handles:
                    raise ValueError(f"job {j.job.job_id!r} deploy[{k}]: unknown pool {d.pool!r}")
        return self

    # ---- helpers ---------------------------------------------------------------------------------
    def pool_index(self, handle: str) -> int:
        for i, p in enumerate(self.pools):
            if handle in (p.name, p.handle):
                return i
        raise KeyError(f"unknown pool {handle!r}")

    def instance_type(self, pool: PoolSpec) -> InstanceType:
        for it in self.instance_types:
            if it.cloud == pool.cloud and it.name == pool.instance_type:
                return it
        return catalog.instance(pool.cloud, pool.instance_type)

    def environment(self, pool: PoolSpec) -> Environment:
        it = self.instance_type(pool)
        return Environment(
            cloud=pool.cloud, region=pool.region, zone=pool.zone_name, market=pool.market, gpu_type=it.gpu_type
        )

    def price(self, pool: PoolSpec) -> float:
        if pool.price_hourly is not None:
            return pool.price_hourly
        return self.instance_type(pool).hourly_price(pool.region, pool.market)

    def lifecycle_of(self, pool: PoolSpec) -> Lifecycle:
        over = pool.lifecycle.model_dump(exclude_none=True)
        return self.lifecycle.model_copy(update=over)

    @property
    def total_gpus(self) -> int:
        return sum(p.instances * self.instance_type(p).gpu_count for p in self.pools)

    @property
    def online_jobs(self) -> list[Job]:
        return [j.job for j in self.jobs if j.job.job_class is JobClass.ONLINE]

    @property
    def batch_jobs(self) -> list[Job]:
        return [j.job for j in self.jobs if j.job.job_class is JobClass.BATCH]


def _format_validation(exc: ValidationError, source: str) -> str:
    lines = [f"scenario {source} is invalid:"]
    for err in exc.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "(root)"
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        lines.append(f"  {loc}: {msg}")
    return "\n".join(lines)


def parse_scenario(data: dict[str, Any] | Scenario, *, source: str = "<dict>", check_deployments: bool = True) -> Scenario:
    """Validate a scenario mapping; raise :class:`ScenarioError` listing every problem with its location."""
    if isinstance(data, Scenario):
        sc = data
    else:
        if not isinstance(data, dict):
            raise ScenarioError(f"scenario {source}: expected a mapping at the top level, got {type(data).__name__}")
        try:
            sc = Scenario.model_validate(data)
        except ValidationError as exc:
            raise ScenarioError(_format_validation(exc, source)) from None
        except catalog.CatalogError as exc:  # pragma: no cover - catalog errors surface as ValidationError
            raise ScenarioError(f"scenario {source}: {exc}") from None
    if check_deployments:
        from koi.sim.physics import check_chain

        problems = []
        for j in sc.jobs:
            for k, d in enumerate(j.deploy or []):
                pool = sc.pools[sc.pool_index(d.pool)]
                reason = check_chain(j.job.model, sc.instance_type(pool), d.config)
                if reason:
                    problems.append(f"  jobs.{j.job.job_id}.deploy[{k}] on pool {pool.handle}: {reason}")
        if problems:
            raise ScenarioError("\n".join([f"scenario {source} declares impossible deployments:", *problems]))
    return sc


def load_scenario(path: str | Path, *, check_deployments: bool = True) -> Scenario:
    """Read and validate a YAML scenario file."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise ScenarioError(f"cannot read scenario {p}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ScenarioError(f"scenario {p} is not valid YAML: {exc}") from None
    return parse_scenario(data, source=str(p), check_deployments=check_deployments)


def demo_path() -> Path:
    """The shipped demo scenario (what `make run` shows new users)."""
    return Path(__file__).resolve().parent / "scenarios" / "demo.yaml"


def load_demo() -> Scenario:
    return load_scenario(demo_path())
