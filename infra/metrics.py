"""Koi's own metrics for the operator's Prometheus: how the ticks go, what they deploy, what the cluster holds.

``koi worker --metrics-port 9464`` (``KOI_METRICS_PORT``) serves them at ``/metrics``; the tick activities record
into :data:`METRICS` as they finish (:mod:`activities.tick`), so every worker reports the ticks it ran. Alert on
``time() - koi_tick_last_finished_timestamp_seconds`` (a cluster that stopped ticking) and on
``increase(koi_ticks_total{outcome="fallback"}[30m])`` (ticks that kept every deployment because a stage failed),
and on ``koi_engines{state="lost"} > 0`` (an engine that served and stopped, or never came up).

Metric                                            labels               from
================================================  ===================  ==========================================
``koi_ticks_total``                               cluster, outcome     finish_tick
``koi_tick_seconds``                              cluster              finish_tick: the tick's wall time
``koi_tick_stage_seconds``                        cluster, stage       finish_tick: each stage's (S0–S6) wall time
``koi_tick_last``                                 cluster              finish_tick: the tick number
``koi_tick_last_finished_timestamp_seconds``      cluster              finish_tick: the worker's wall clock
``koi_jobs``                                      cluster, status      finish_tick: jobs by status
``koi_ranks``                                     cluster              finish_tick: live ranks
``koi_gpus_in_use``                               cluster              finish_tick: the live ranks' GPUs
``koi_deploy_ops_total``                          cluster, op          s6_deploy: launched, scaled, torn_down,
                                                                       reweighted, duplicates, failed
``koi_telemetry_windows``                         cluster              s1_observe: windows stored in the last tick
``koi_engines``                                   cluster, state       at the scrape: the readiness probe's engines
                                                                       (``ready``, ``loading``, ``lost``;
                                                                       :mod:`infra.health`) of a real fleet
================================================  ===================  ==========================================

Each worker process has its own registry (:class:`KoiMetrics`); several workers are several scrape targets, and a
tick is counted by the worker that ran its ``finish_tick`` (a retried activity counts once per success).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily

from koi.logging import get_logger
from koi.pipeline.messages import DeploySummary, FinishInput, FinishSummary, ObserveSummary

log = get_logger(__name__)

_STAGE_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_DEPLOY_OPS = ("launched", "scaled", "torn_down", "reweighted", "duplicates", "failed")


class KoiMetrics:
    """The metrics of one process, on their own registry (tests make their own)."""

    def __init__(self, registry: CollectorRegistry | None = None, clock: Callable[[], float] = time.time) -> None:
        self.registry = registry or CollectorRegistry()
        self._clock = clock
        self._lock = threading.Lock()
        self._job_statuses: dict[str, set[str]] = {}
        r = self.registry
        self.ticks = Counter("koi_ticks", "Ticks finished, by outcome", ["cluster", "outcome"], registry=r)
        self.tick_seconds = Histogram("koi_tick_seconds", "A tick's wall time", ["cluster"], registry=r,
                                      buckets=_STAGE_BUCKETS)
        self.stage_seconds = Histogram("koi_tick_stage_seconds", "A tick stage's wall time", ["cluster", "stage"],
                                       registry=r, buckets=_STAGE_BUCKETS)
        self.last_tick = Gauge("koi_tick_last", "The last tick finished", ["cluster"], registry=r)
        self.last_finished = Gauge("koi_tick_last_finished_timestamp_seconds", "When the last tick finished (unix s)",
                                   ["cluster"], registry=r)
        self.jobs = Gauge("koi_jobs", "Jobs by status after the last tick", ["cluster", "status"], registry=r)
        self.ranks = Gauge("koi_ranks", "Live ranks after the last tick", ["cluster"], registry=r)
        self.gpus = Gauge("koi_gpus_in_use", "GPUs the live ranks hold after the last tick", ["cluster"], registry=r)
        self.deploy_ops = Counter("koi_deploy_ops", "S6's executor calls, by what they did", ["cluster", "op"],
                                  registry=r)
        self.windows = Gauge("koi_telemetry_windows", "Telemetry windows S1 stored in the last tick", ["cluster"],
                             registry=r)
        self._engines: dict[str, Callable[[], dict[str, int]]] = {}
        r.register(_EnginesCollector(self._engines, self._lock))

    def watch_engines(self, cluster_id: str, counts: Callable[[], dict[str, int]]) -> None:
        """Report ``counts()`` (engines by readiness state, :meth:`infra.health.EngineHealth.counts`) as
        ``koi_engines`` at every scrape."""
        with self._lock:
            self._engines[cluster_id] = counts

    def unwatch_engines(self, cluster_id: str, counts: Callable[[], dict[str, int]]) -> None:
        """Stop reporting ``counts`` (a provider closing); another provider's for the cluster stays."""
        with self._lock:
            if self._engines.get(cluster_id) == counts:
                del self._engines[cluster_id]

    def finished(self, inp: FinishInput, out: FinishSummary) -> None:
        c = inp.cluster_id
        self.ticks.labels(c, out.outcome.value).inc()
        for stage, seconds in inp.timings.items():
            if stage == "total":
                self.tick_seconds.labels(c).observe(seconds)
            elif "." not in stage:  # a repair attempt's retiming ("s4_plan.1") stays in the stage's own series
                self.stage_seconds.labels(c, stage).observe(seconds)
        self.last_tick.labels(c).set(out.tick)
        self.last_finished.labels(c).set(self._clock())
        counts: dict[str, int] = {}
        for status in out.job_status.values():
            counts[status] = counts.get(status, 0) + 1
        with self._lock:  # a status no job has any more reads 0, not its last count
            for status in self._job_statuses.get(c, set()) | set(counts):
                self.jobs.labels(c, status).set(counts.get(status, 0))
            self._job_statuses[c] = self._job_statuses.get(c, set()) | set(counts)
        self.ranks.labels(c).set(len(out.deployments))
        self.gpus.labels(c).set(sum(d.gpus for d in out.deployments))  # a rank's GPUs, all replicas

    def deployed(self, cluster_id: str, out: DeploySummary) -> None:
        for op in _DEPLOY_OPS:
            if n := getattr(out, op):
                self.deploy_ops.labels(cluster_id, op).inc(n)

    def observed(self, cluster_id: str, out: ObserveSummary) -> None:
        self.windows.labels(cluster_id).set(out.n_windows)

    def record(self, what: str, fn: Callable[[], None]) -> None:
        """Record without ever failing the activity that finished."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - a metric must not fail a tick
            log.warning("metrics.record_failed", what=what, error=f"{type(exc).__name__}: {exc}")

    def serve(self, port: int, addr: str = "0.0.0.0") -> None:  # noqa: S104 - scraped from the VPC
        start_http_server(port, addr=addr, registry=self.registry)
        log.info("metrics.serving", port=port, addr=addr)


class _EnginesCollector:
    """``koi_engines{cluster, state}`` read at the scrape from each cluster's readiness state."""

    def __init__(self, sources: dict[str, Callable[[], dict[str, int]]], lock: threading.Lock) -> None:
        self._sources, self._lock = sources, lock

    def describe(self) -> list[GaugeMetricFamily]:
        return [GaugeMetricFamily("koi_engines", "Engines by readiness (infra/health.py)", labels=["cluster", "state"])]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        g = GaugeMetricFamily("koi_engines", "Engines by readiness (infra/health.py)", labels=["cluster", "state"])
        with self._lock:
            sources = dict(self._sources)
        for cluster, counts in sorted(sources.items()):
            try:
                got = counts()
            except Exception as exc:  # noqa: BLE001 - a scrape must not fail on one cluster
                log.warning("metrics.engines_failed", cluster=cluster, error=f"{type(exc).__name__}: {exc}")
                continue
            for state in ("ready", "loading", "lost"):
                g.add_metric([cluster, state], got.get(state, 0))
        yield g


#: The worker process's metrics.
METRICS = KoiMetrics()
