"""A real fleet behind Koi's ports: a cloud launches and counts the instances, vLLM's ``/metrics`` says how they serve.

``koi worker --world aws|gcp --fleet fleet.yaml`` runs the tick pipeline against Amazon EC2 or Google Compute
Engine; everything else — the store, Temporal, the planner, S5's checks, the deploy log and its fence — is what
the simulated world uses.

- :class:`FleetSpec` (YAML): the pools the cluster may use (a pool is a cloud × region × zone × market ×
  instance type with an instance budget and a price; Koi's planner never launches outside them), the machine
  image that starts vLLM, extra launch arguments (subnet, security groups, service account, start-up script),
  the GCP project, a private API endpoint (LocalStack, moto) and where the engines' metrics are served.
- :class:`CloudWorld`: the Executor and the capacity/deployments half of the Observer are the cloud's fleet
  (:func:`make_fleet`: :class:`infra.aws.Ec2Fleet`, :class:`infra.gcp.GceFleet`); telemetry is
  :class:`infra.vllm_metrics.VllmMetricsObserver`, whose scrape targets are each ready replica's head node
  (the fleet's ``engine_hosts``). ``advance`` does nothing: a real fleet's clock is the wall clock (the cluster
  workflow's ``live`` mode waits the tick interval in a Temporal timer).
- :class:`CloudWorldProvider`: the provider the pipeline opens the world through. The state is the cloud's (the
  instances' tags, labels and metadata), so a checkpoint holds only the wall-clock time a tick was recorded at —
  it keeps the provider's tick bookkeeping (``current_tick``, the fence's "already advanced") the same as for the
  simulator.

Choices:

1. **Scraping runs in the worker process**, one background thread per cluster (:class:`Scraper`, every
   ``scrape_every_s``, 15 s like the simulator's samples), shared by every world the provider restores in that
   process: S1 of tick t reads the scrapes of (t − 1, t] from memory. A worker that restarts loses the samples
   of the interval it was down for, and S1 then gets fewer (or no) windows for that tick — S2 handles a rank
   without a window as "no evidence", never as an error. Several workers each scrape; each has what it needs.
2. **Scrape targets are re-read from the cloud** at most once per ``targets_ttl_s`` (60 s), not on every
   scrape: a rank launched this tick is scraped from the next refresh, and the cloud's API is not called every 15 s.
3. **Telemetry from a world opened read-only works too**: the provider's worlds share the cluster's scraper.
4. **Or Prometheus keeps the samples** (``prometheus_url``): S1 reads (t − 1, t] back from the operator's Prometheus
   (:class:`infra.prometheus.PrometheusTelemetry`) and no scraper runs, so nothing is lost while no worker runs; an
   unreachable Prometheus fails S1 and Temporal retries it. With ``prometheus_file_sd`` Koi also writes the scrape
   targets, labelled with cluster, job, rank and environment, for Prometheus' file service discovery (refreshed
   every ``targets_ttl_s``); a setup with cloud discovery relabels the instances' ``koi:*`` tags instead.
5. **The gateway** (``gateway:``, :mod:`infra.gateway`): a thread per cluster writes the traffic split — each job's
   ready replicas weighted by the planner's ``route_weight`` — for nginx (and as JSON) every ``every_s`` and at
   once after the executor launched, scaled, reweighted or tore down anything.
6. **Draining runs in the worker too**: a thread per cluster sweeps torn-down ranks every ``sweep_every_s``
   (:mod:`infra.drain`: a handover's drain starts once its replacement serves, a drain's instances are released
   when it is over), and each world sweeps once before its first executor call. While no worker runs, a drained
   rank keeps its instances (and its cost) until one does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import Field, ValidationError, model_validator

from infra.aws import Ec2Fleet, ec2_client_factory  # noqa: F401 - ec2_client_factory: the import callers use
from infra.engine import EngineSpec
from infra.gateway import GatewaySpec, GatewaySync
from infra.health import EngineHealth
from infra.metrics import METRICS
from infra.prometheus import PrometheusTelemetry, write_file_sd
from infra.vllm_metrics import ScrapeTarget, VllmMetricsObserver
from koi.domain import Deployment, Job, Pool, Rank, ResourceMap, TelemetryWindow
from koi.domain.common import KoiModel
from koi.logging import get_logger
from koi.ports import LaunchResult

log = get_logger(__name__)


class FleetError(ValueError):
    """A fleet file that cannot be used, with what is wrong in it."""


class AzureSpec(KoiModel):
    """The fleet file's ``azure:`` section: where the engines' VMs live (:class:`infra.azure.AzureFleet`)."""

    subscription_id: str = Field(min_length=1)
    resource_group: str = Field(min_length=1)
    subnet_id: str = Field(min_length=1, description="the subnet the engines' NICs join (a resource id)")
    ssh_public_key: str = Field(min_length=1, description="the admin's key; password login is off")
    admin_username: str = Field(default="koi", min_length=1)
    identity: str | None = Field(default=None, pattern=r"(?i)^/subscriptions/.+/providers/"
                                 r"Microsoft\.ManagedIdentity/userAssignedIdentities/[^/]+$",
                                 description="a user-assigned managed identity's resource id, put on every VM: a VM "
                                             "Koi drained deletes itself with it when no worker does "
                                             "(infra/backstop.py); it needs virtualMachines/delete on the group")


class FleetSpec(KoiModel):
    pools: list[Pool] = Field(min_length=1, description="what the cluster may launch: Koi never leaves these")
    image_id: str | None = Field(default=None, min_length=1,
                                 description="the machine image that boots vLLM (an AMI; a GCE image URL); None: "
                                             "each cloud's deep-learning image")
    project: str | None = Field(default=None, min_length=1, description="gcp: the project the instances live in")
    azure: AzureSpec | None = Field(default=None, description="azure: subscription, resource group, subnet, SSH key")
    run_args: dict[str, Any] = Field(default_factory=dict,
                                     description="merged into every launch: aws run_instances arguments (SubnetId, "
                                                 "SecurityGroupIds, IamInstanceProfile, UserData that starts the "
                                                 "engine, ...); gcp compute_v1.Instance fields (metadata, "
                                                 "network_interfaces, service_accounts, ...)")
    endpoint_url: str | None = Field(default=None, description="the cloud API's endpoint (LocalStack, moto, a "
                                                               "private endpoint); None: the cloud's own")
    metrics_port: int = Field(default=8000, ge=1, le=65535, description="vLLM's OpenAI server port")
    metrics_path: str = "/metrics"
    scrape_every_s: float = Field(default=15.0, gt=0)
    targets_ttl_s: float = Field(default=60.0, ge=0)
    scrape_timeout_s: float = Field(default=2.0, gt=0)
    prometheus_url: str | None = Field(default=None, min_length=1,
                                       description="S1 reads the engines' vLLM series from this Prometheus "
                                                   "(infra/prometheus.py, choice 4); None: the worker scrapes them")
    prometheus_file_sd: str | None = Field(default=None, min_length=1,
                                           description="a directory: Koi writes koi-<cluster>.json there for "
                                                       "Prometheus' file_sd_configs (the engines and rank labels)")
    prometheus_timeout_s: float = Field(default=30.0, gt=0)
    engine: EngineSpec | None = Field(default=None, description="Koi starts vLLM on each instance as the rank asks "
                                                                "(infra/engine.py); None: the image / run_args do")
    sweep_every_s: float = Field(default=10.0, gt=0, description="how often the worker moves torn-down ranks "
                                                                   "on: handover, drain, release (infra/drain.py)")
    gateway: GatewaySpec | None = Field(default=None, description="where Koi writes the traffic split it plans "
                                                                  "(infra/gateway.py, choice 5); None: nowhere")
    health_path: str | None = Field(default="/health", pattern=r"^/", description=(
        "a replica is ready once its engine answers GET <metrics_port><health_path> with 200 (vLLM's /health; "
        "infra/health.py); null: once its instances run"))
    health_via: Literal["probe", "prometheus"] = Field(default="probe", description=(
        "probe: the workers ask each engine; prometheus: an engine Prometheus scraped (up == 1) answers, for "
        "workers that do not reach the engines (needs prometheus_url)"))
    health_every_s: float = Field(default=5.0, gt=0, description="how long an engine's answer stands")
    health_timeout_s: float = Field(default=2.0, gt=0)
    ready_timeout_s: float = Field(default=1800.0, gt=0, description="a replica whose engine has not answered this "
                                                                      "long after its instances run is broken: "
                                                                      "replaced at the next scale")

    @model_validator(mode="after")
    def _prometheus_for_health(self) -> FleetSpec:
        if self.health_via == "prometheus" and self.prometheus_url is None:
            raise ValueError("health_via: prometheus needs prometheus_url")
        return self

    @property
    def resources(self) -> ResourceMap:
        return ResourceMap(pools=[p.model_copy(update={"free_instances": p.total_instances}) for p in self.pools])


def load_fleet(path: str | Path) -> FleetSpec:
    """The fleet file (YAML or JSON); a :class:`FleetError` naming the file and the field that is wrong."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text())
    except OSError as exc:
        raise FleetError(f"cannot read fleet file {p}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise FleetError(f"fleet file {p} is not YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise FleetError(f"fleet file {p}: expected a mapping with 'pools', got {type(raw).__name__}")
    try:
        return FleetSpec.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(x) for x in first["loc"])
        raise FleetError(f"fleet file {p}: {where}: {first['msg']} ({exc.error_count()} error(s))") from exc


Cloud = Literal["aws", "gcp", "azure"]


_SHARED: dict[tuple[Any, ...], Any] = {}
_SHARED_LOCK = threading.Lock()


def _shared(key: tuple[Any, ...], make: Callable[[], Any]) -> Any:
    """One client per key in the process: a world is made per tick activity and per background thread, and a
    new credential each time would ask the identity service for a new token each time (Azure's managed-identity
    endpoint throttles; GCE's metadata server is asked once per credential too). The clients are thread-safe."""
    with _SHARED_LOCK:
        if key not in _SHARED:
            _SHARED[key] = make()
        return _SHARED[key]


def azure_clients(spec: FleetSpec) -> tuple[Any, Any]:
    """(ComputeManagementClient, NetworkManagementClient) with ``DefaultAzureCredential`` (environment, managed
    identity, the Azure CLI, ...); ``endpoint_url``: another Resource Manager endpoint (a sovereign cloud). Shared
    in the process per subscription and endpoint (:func:`_shared`)."""
    assert spec.azure is not None
    sub, url = spec.azure.subscription_id, spec.endpoint_url

    def make() -> tuple[Any, Any]:
        from azure.identity import DefaultAzureCredential
        from azure.mgmt.compute import ComputeManagementClient
        from azure.mgmt.network import NetworkManagementClient

        cred, kw = DefaultAzureCredential(), ({"base_url": url} if url else {})
        return ComputeManagementClient(cred, sub, **kw), NetworkManagementClient(cred, sub, **kw)

    return _shared(("azure", sub, url), make)


def gce_client(endpoint_url: str | None = None) -> Any:
    """A Compute Engine InstancesClient over REST (default credentials; ``endpoint_url``: a private endpoint), shared
    in the process per endpoint (:func:`_shared`)."""

    def make() -> Any:
        from google.api_core.client_options import ClientOptions
        from google.cloud import compute_v1

        return compute_v1.InstancesClient(transport="rest", client_options=ClientOptions(api_endpoint=endpoint_url)
                                          if endpoint_url else None)

    return _shared(("gcp", endpoint_url), make)


def make_fleet(spec: FleetSpec, cluster_id: str, cloud: Cloud, *, clock: Callable[[], float] = time.time,
               client: Any = None, health: Any = None) -> Any:
    """The executor of ``cloud`` for one cluster: :class:`infra.aws.Ec2Fleet`, :class:`infra.gcp.GceFleet` or
    :class:`infra.azure.AzureFleet`. ``client``: aws, ``region -> EC2 client``; gcp, an ``InstancesClient``; azure,
    ``(ComputeManagementClient, NetworkManagementClient)`` (default: from ``spec.endpoint_url`` and the cloud's
    default credentials). ``health``: an :class:`infra.health.EngineHealth` (ready = the engine answers); None:
    ready = the instances run."""
    fleet = _make_fleet(spec, cluster_id, cloud, clock=clock, client=client)
    fleet.health = health
    return fleet


def engine_health(spec: FleetSpec, cluster_id: str, prometheus: PrometheusTelemetry | None = None,
                  ) -> EngineHealth | None:
    """The engines' readiness the fleet file asks for (``health_path``, ``health_via``; None: none). With
    ``health_via: prometheus``, ``prometheus`` (else one is made) answers which engines it scraped."""
    if spec.health_path is None:
        return None
    answering = None
    if spec.health_via == "prometheus":
        assert spec.prometheus_url is not None
        prom = prometheus or PrometheusTelemetry(spec.prometheus_url, step_s=spec.scrape_every_s,
                                                 timeout_s=spec.prometheus_timeout_s)

        def answering() -> set[str]:
            return prom.engines_answering(cluster_id)
    return EngineHealth(spec.metrics_port, spec.health_path, ttl_s=spec.health_every_s,
                        timeout_s=spec.health_timeout_s, ready_timeout_s=spec.ready_timeout_s, answering=answering)


def _make_fleet(spec: FleetSpec, cluster_id: str, cloud: Cloud, *, clock: Callable[[], float],
                client: Any) -> Any:
    if cloud == "aws":
        kw = {"image_id": spec.image_id} if spec.image_id else {}
        return Ec2Fleet(cluster_id, spec.resources, client_factory=client or ec2_client_factory(spec.endpoint_url),
                        clock=clock, run_args=spec.run_args, engine=spec.engine, engine_port=spec.metrics_port, **kw)
    if cloud == "gcp":
        from infra.gcp import GceFleet

        if not spec.project:
            raise FleetError("the gcp world needs 'project' in the fleet file")
        kw = {"image": spec.image_id} if spec.image_id else {}
        return GceFleet(cluster_id, spec.resources, project=spec.project,
                        client=client or gce_client(spec.endpoint_url),
                        clock=clock, insert_args=spec.run_args, engine=spec.engine, engine_port=spec.metrics_port,
                        api_endpoint=spec.endpoint_url, **kw)
    if cloud == "azure":
        from infra.azure import AzureFleet

        if spec.azure is None:
            raise FleetError("the azure world needs an 'azure' section in the fleet file (subscription_id, "
                             "resource_group, subnet_id, ssh_public_key)")
        compute, network = client or azure_clients(spec)
        kw = {"image": spec.image_id} if spec.image_id else {}
        return AzureFleet(cluster_id, spec.resources, resource_group=spec.azure.resource_group,
                          subnet_id=spec.azure.subnet_id, compute=compute, network=network,
                          ssh_public_key=spec.azure.ssh_public_key, admin_username=spec.azure.admin_username,
                          identity=spec.azure.identity,
                          clock=clock, vm_args=spec.run_args, engine=spec.engine, engine_port=spec.metrics_port, **kw)
    raise FleetError(f"unknown cloud {cloud!r}: aws, gcp or azure")


class Periodic:
    """Calls ``fn`` every ``every_s`` in a daemon thread; a failing call is logged, never ends the loop."""

    def __init__(self, fn: Callable[[], Any], every_s: float, name: str) -> None:
        self.fn, self.every_s, self.name = fn, every_s, name
        self._stop, self._wake = threading.Event(), threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.fn()
            except Exception as exc:  # noqa: BLE001 - a background task never takes the worker down
                log.warning(f"{self.name}.failed", error=f"{type(exc).__name__}: {exc}")
            self._wake.wait(self.every_s)
            self._wake.clear()

    def kick(self) -> None:
        """Run ``fn`` now rather than at the end of the period."""
        self._wake.set()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


class Scraper(Periodic):
    """Scrapes one cluster's engines every ``every_s`` (choice 1)."""

    def __init__(self, observer: VllmMetricsObserver, every_s: float) -> None:
        super().__init__(observer.scrape, every_s, "koi-scraper")
        self.observer = observer


class CloudWorld:
    """A cloud's executor (EC2, Compute Engine) + vLLM metrics behind the ports (module docstring). ``on_change``:
    called after the executor changed the fleet (the gateway sync runs at once, choice 5)."""

    def __init__(self, fleet: Any, metrics: VllmMetricsObserver | PrometheusTelemetry | None = None,
                 clock: Callable[[], float] = time.time, on_change: Callable[[], None] | None = None) -> None:
        self.fleet, self.metrics, self._clock = fleet, metrics, clock
        self._on_change = on_change or (lambda: None)
        self._swept = False

    def _sweep_once(self) -> None:
        """Before this world's first executor call: release what finished draining, start due drains
        (:mod:`infra.drain`), so capacity and handovers are current even when no background sweep runs."""
        if not self._swept:
            self._swept = True
            try:
                changed = self.fleet.sweep()
            except Exception as exc:  # noqa: BLE001 - housekeeping: the worker's sweep tries again, the op goes on
                log.warning("cloud.sweep_failed", error=f"{type(exc).__name__}: {exc}")
                return
            if changed:
                self._on_change()

    # ---- Observer -------------------------------------------------------------------------------
    def now(self) -> float:
        return float(self._clock())

    def capacity(self) -> ResourceMap:
        return self.fleet.capacity()

    def deployments(self) -> list[Deployment]:
        return self.fleet.deployments()

    def telemetry(self, t_start: float, t_end: float, *, cluster_id: str, tick: int) -> list[TelemetryWindow]:
        if self.metrics is None:
            return []
        return self.metrics.telemetry(t_start, t_end, cluster_id=cluster_id, tick=tick)

    def advance(self, t: float) -> None:
        """Nothing to do: a real fleet runs on the wall clock."""

    def checkpoint(self) -> bytes:
        return b""  # the state is EC2's

    # ---- Executor -------------------------------------------------------------------------------
    def launch(self, job: Job, rank: Rank, idempotency_key: str) -> LaunchResult:
        self._sweep_once()
        try:
            return self.fleet.launch(job, rank, idempotency_key)
        finally:
            self._on_change()

    def teardown(self, job_id: str, rank_id: str, idempotency_key: str, *, drain_s: float = 0.0,
                 handover: bool = False) -> bool:
        self._sweep_once()
        try:
            return self.fleet.teardown(job_id, rank_id, idempotency_key, drain_s=drain_s, handover=handover)
        finally:
            self._on_change()

    def scale(self, job_id: str, rank_id: str, n_replicas: int, idempotency_key: str, *,
              drain_s: float | None = None) -> LaunchResult:
        self._sweep_once()
        try:
            return self.fleet.scale(job_id, rank_id, n_replicas, idempotency_key, drain_s=drain_s)
        finally:
            self._on_change()

    def reweight(self, job_id: str, rank_id: str, route_weight: float, idempotency_key: str) -> bool:
        self._sweep_once()
        try:
            return self.fleet.reweight(job_id, rank_id, route_weight, idempotency_key)
        finally:
            self._on_change()


def scrape_targets(fleet: Any, spec: FleetSpec) -> Callable[[], Sequence[ScrapeTarget]]:
    """The engines to scrape, re-read from EC2 at most every ``targets_ttl_s`` (choice 2)."""
    cache: dict[str, Any] = {"at": None, "targets": []}

    def targets() -> Sequence[ScrapeTarget]:
        now = time.monotonic()
        if cache["at"] is None or now - cache["at"] >= spec.targets_ttl_s:
            cache["targets"] = [
                ScrapeTarget(job_id=job, rank_id=rid, env_id=env,
                             urls=tuple(f"http://{h}:{spec.metrics_port}{spec.metrics_path}" for h in hosts))
                for job, rid, env, hosts in fleet.engine_hosts()
            ]
            cache["at"] = now
        return cache["targets"]

    return targets


class CloudWorldProvider:
    """The pipeline's world provider over a cloud (:class:`koi.pipeline.world.WorldProvider`).

    The cloud holds the state, so each unit of work gets a fresh :class:`CloudWorld` for its cluster; the store keeps
    one row per tick (``W_world``, an empty checkpoint with the wall-clock time) so that ``current_tick`` and a
    retried ``advance`` behave as they do for the simulator. A world opened "as of" an older tick (a reset, a
    replay) is today's fleet: the cloud keeps no history, the store's stage outputs do. ``scrape=False``: no
    metrics thread (tests, a dry run of the executor).
    """

    def __init__(self, spec: FleetSpec, *, cloud: Cloud = "aws", client: Any = None,
                 client_factory: Callable[[str], Any] | None = None, clock: Callable[[], float] = time.time,
                 scrape: bool = True) -> None:
        self.spec, self.cloud, self.clock, self.scrape = spec, cloud, clock, scrape
        self.client = client or client_factory  # aws: region -> EC2 client; gcp: an InstancesClient; azure: a pair
        if cloud == "gcp" and not spec.project:
            raise FleetError("the gcp world needs 'project' in the fleet file")
        if cloud == "azure" and spec.azure is None:
            raise FleetError("the azure world needs an 'azure' section in the fleet file")
        if cloud == "azure" and self.client is None:
            self.client = azure_clients(spec)  # one pair per process: credentials and connections are reused
        self.scrapers: dict[str, Scraper] = {}
        self.publishers: dict[str, Periodic] = {}
        self.gateways: dict[str, Periodic] = {}
        self.reapers: dict[str, Periodic] = {}
        self.prometheus: dict[str, PrometheusTelemetry] = {}
        self.health: dict[str, EngineHealth | None] = {}  # one readiness probe per cluster (infra/health.py)
        self._lock = threading.Lock()
        if scrape:  # httpx logs every request at INFO: 400 engines every 15 s would drown the worker's log
            logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger("httpx").level))

    def world(self, cluster_id: str) -> CloudWorld:
        spec = self.spec
        with self._lock:
            if spec.prometheus_url and cluster_id not in self.prometheus:
                self.prometheus[cluster_id] = PrometheusTelemetry(
                    spec.prometheus_url, step_s=spec.scrape_every_s, timeout_s=spec.prometheus_timeout_s)
            if cluster_id not in self.health:
                self.health[cluster_id] = h = engine_health(spec, cluster_id, self.prometheus.get(cluster_id))
                if h is not None and self.scrape:  # a worker: koi_engines at every scrape of its metrics
                    METRICS.watch_engines(cluster_id, h.counts)
        fleet = make_fleet(spec, cluster_id, self.cloud, clock=self.clock, client=self.client,
                           health=self.health[cluster_id])
        on_change = None
        if self.scrape:  # background threads: the file-SD publisher, the gateway sync, the scraper
            if spec.prometheus_file_sd:
                self._publish(cluster_id, fleet)
            if spec.gateway is not None:
                on_change = self._gateway(cluster_id, fleet).kick
            self._reaper(cluster_id, fleet, on_change)
        metrics: VllmMetricsObserver | PrometheusTelemetry | None = None
        with self._lock:
            if spec.prometheus_url:
                metrics = self.prometheus[cluster_id]
            elif self.scrape:
                if cluster_id not in self.scrapers:
                    obs = VllmMetricsObserver(scrape_targets(fleet, spec), clock=self.clock,
                                              timeout_s=spec.scrape_timeout_s)
                    self.scrapers[cluster_id] = Scraper(obs, spec.scrape_every_s)
                    self.scrapers[cluster_id].start()
                    log.info("cloud.scraping", cluster=cluster_id, every_s=spec.scrape_every_s)
                metrics = self.scrapers[cluster_id].observer
        return CloudWorld(fleet, metrics, self.clock, on_change)

    def _reaper(self, cluster_id: str, fleet: Any, on_change: Callable[[], None] | None) -> None:
        """The cluster's drain sweep every ``sweep_every_s`` (choice 6), started once per process."""
        def sweep() -> None:
            if fleet.sweep() and on_change is not None:
                on_change()

        with self._lock:
            if cluster_id not in self.reapers:
                self.reapers[cluster_id] = Periodic(sweep, self.spec.sweep_every_s, "koi-reaper")
                self.reapers[cluster_id].start()

    def _gateway(self, cluster_id: str, fleet: Any) -> Periodic:
        """The cluster's gateway sync (choice 5), started once per process."""
        assert self.spec.gateway is not None
        with self._lock:
            if cluster_id not in self.gateways:
                sync = GatewaySync(self.spec.gateway, cluster_id, fleet, self.spec.metrics_port)
                self.gateways[cluster_id] = Periodic(sync.sync, self.spec.gateway.every_s, "koi-gateway")
                self.gateways[cluster_id].start()
                log.info("cloud.gateway", cluster=cluster_id, kind=self.spec.gateway.kind,
                         directory=self.spec.gateway.directory)
            return self.gateways[cluster_id]

    def _publish(self, cluster_id: str, fleet: Any) -> None:
        """Keep ``koi-<cluster>.json`` in ``prometheus_file_sd`` up to date with the scrape targets (choice 4)."""
        with self._lock:
            if cluster_id in self.publishers:
                return
            targets, directory = scrape_targets(fleet, self.spec), self.spec.prometheus_file_sd
            self.publishers[cluster_id] = Periodic(lambda: write_file_sd(directory, cluster_id, targets()),
                                                   max(self.spec.targets_ttl_s, 1.0), "koi-file-sd")
            self.publishers[cluster_id].start()
            log.info("cloud.file_sd", cluster=cluster_id, directory=directory)

    def ensure(self, session: Any, cluster_id: str, scenario: str | None, seed: int | None) -> tuple[float, bool]:
        from koi.pipeline.world import encode_checkpoint, load_checkpoint, save_checkpoint

        now = float(self.clock())
        if load_checkpoint(session, cluster_id) is not None:
            return now, False
        save_checkpoint(session, cluster_id, 0, encode_checkpoint(b"", now))
        return now, True

    def current_tick(self, session: Any, cluster_id: str) -> int:
        from koi.pipeline.world import load_checkpoint

        found = load_checkpoint(session, cluster_id)
        return 0 if found is None else found[0]

    @contextmanager
    def open(self, session: Any, cluster_id: str, tick: int, *, write: bool) -> Iterator[Any]:
        from koi.pipeline.world import WorldHandle, WorldMissing, load_checkpoint

        found = load_checkpoint(session, cluster_id, None if write else tick)
        if found is None:
            raise WorldMissing(f"cluster {cluster_id!r} has no world record; run ensure_world first")
        yield WorldHandle(world=self.world(cluster_id), tick=found[0])

    def advance(self, session: Any, cluster_id: str, tick: int, t_target: float) -> float:
        from koi.pipeline.world import encode_checkpoint, load_checkpoint, prune_checkpoints, save_checkpoint

        found = load_checkpoint(session, cluster_id)
        if found is not None and found[0] >= tick:  # a retried activity: already recorded
            return float(self.clock())
        move = getattr(self.clock, "advance", None)
        if move is not None and float(self.clock()) < t_target:
            move(t_target)  # a test clock; the wall clock moves by itself
        save_checkpoint(session, cluster_id, tick, encode_checkpoint(b"", float(self.clock())))
        prune_checkpoints(session, cluster_id)
        return float(self.clock())

    def close(self) -> None:
        for p in [*self.publishers.values(), *self.gateways.values(), *self.reapers.values()]:
            p.stop()
        for s in self.scrapers.values():
            s.stop()
            s.observer.close()
        for t in self.prometheus.values():
            t.close()
        for cluster_id, h in self.health.items():
            if h is not None:
                METRICS.unwatch_engines(cluster_id, h.counts)
                h.close()
