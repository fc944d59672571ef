"""Engine readiness on a real fleet: a replica is ready when its engine answers, not when its instances run.

The cloud says an instance is *running* minutes before vLLM serves on it: the image boots, the start-up script
runs, the weights load (a 70B model takes minutes), CUDA graphs are captured — and vLLM's HTTP server binds only
after all of that. Counting running instances as ready replicas sent the gateway's traffic to engines still loading
(errors at the client), ended a swap's handover before its replacement could serve (make before break, broken), and
told the planner a rank served while it did not. The simulator's ready replica is a serving one (cold start =
provision + load + warm-up), so the real fleet now means the same: a replica is ready when all its instances run
*and* its head node's engine answers ``GET <health_path>`` (vLLM's ``/health``) with 200.

Choices (the spec's port says only "ready replicas"):

1. **Readiness like a Kubernetes readiness probe**: ready after one success; not ready again only after
   ``failures`` (3) probes in a row fail, so one slow answer does not pull a serving replica out of the routes or
   make the planner see a rank degrade; a replica never seen healthy is not ready (still loading: its rank is
   LAUNCHING), one that served and stopped is lost (its rank DEGRADED, as for a lost instance).
2. **Probed when asked, cached ``ttl_s``** (5 s): the reads that need readiness (deployments, routes, the drain
   sweep) ask for all their hosts at once, the stale ones are probed concurrently (``timeout_s`` each, 2 s), and
   nothing probes while nothing asks — the sweep and the gateway sync ask every few seconds anyway. A host nobody
   asked about for a minute is forgotten, so an instance that gets a released one's address starts unproven.
3. Only the head node (where vLLM's API server runs) is probed; the other nodes of a multi-node replica are
   "running" by the cloud's word, and the head serves only once Ray holds their GPUs (:mod:`infra.engine`).
4. ``health_path: null`` in the fleet file turns it off (an engine without a health endpoint): ready = running.
5. **A replica whose engine never answers** within ``ready_timeout_s`` (30 min: a 235B checkpoint from object
   storage loads in well under that) of Koi first seeing its instances run is broken, as the simulator's
   replica that fails to materialize: its rank is DEGRADED, and a scale replaces it (its instances are released,
   a new replica launched). The clock starts when this worker first saw it (a restarted worker waits again).
6. **Or from Prometheus** (``health_via: prometheus``, with ``prometheus_url``): an engine Prometheus scraped
   successfully last time (``up == 1``) answers — for workers that do not reach the engines. When Prometheus
   cannot say, what is known stands (its outage is not the engines' failure).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from koi.logging import get_logger

log = get_logger(__name__)
#: A host not asked about for this long is forgotten (s): the sweep asks for every running head every few seconds,
#: and a new instance on a released one's address takes longer than this to boot.
FORGET_S = 60.0


@dataclass(slots=True)
class _State:
    ready: bool = False
    was_ready: bool = False  # it served once: not ready now means lost, not still loading
    fails: int = 0
    checked: float = float("-inf")
    asked: float = float("-inf")
    first: float = float("inf")  # when it was first asked about: running since about then


class EngineHealth:
    """Readiness of the engines at ``host:port`` (module docstring). Thread-safe: the worker's tick activities,
    drain sweep and gateway sync share one per cluster."""

    def __init__(self, port: int, path: str = "/health", *, ttl_s: float = 5.0, timeout_s: float = 2.0,
                 failures: int = 3, ready_timeout_s: float = 1800.0, clock: Callable[[], float] = time.monotonic,
                 workers: int = 16, answering: Callable[[], set[str]] | None = None) -> None:
        self.port, self.path, self.ttl_s, self.failures, self._clock = port, path, ttl_s, failures, clock
        self.ready_timeout_s = ready_timeout_s
        self._answering = answering  # choice 6: the hosts Prometheus scraped, instead of probing them
        self._client = httpx.Client(timeout=timeout_s)
        # httpx logs every request at INFO: a probe per engine every few seconds would drown the worker's log
        logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger("httpx").level))
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="koi-health")
        self._state: dict[str, _State] = {}
        self._lock = threading.Lock()
        self.probes = 0  # how many probes were sent (tests, the metrics)

    def ready(self, hosts: Iterable[str]) -> set[str]:
        """The hosts whose engine is ready, probing (concurrently) those whose answer is older than ``ttl_s``. A host
        nobody asked about for :data:`FORGET_S` is forgotten (a released instance; a new one may get its address)."""
        hosts = set(hosts)
        now = self._clock()
        with self._lock:
            for h in [h for h, st in self._state.items() if now - st.asked > FORGET_S and h not in hosts]:
                del self._state[h]
            for h in hosts:
                st = self._state.setdefault(h, _State())
                st.asked, st.first = now, min(st.first, now)
            stale = sorted(h for h in hosts if now - self._state[h].checked >= self.ttl_s)
        for host, ok in self._ask(stale).items():
            self._record(host, ok, now)
        with self._lock:
            return {h for h in hosts if (st := self._state.get(h)) is not None and st.ready}

    def lost(self, hosts: Iterable[str]) -> set[str]:
        """Of ``hosts``, those whose replica is broken, not loading (as of the last probes; none is sent): the engine
        served and no longer does, or it still did not answer when asked ``ready_timeout_s`` after its instance was
        first seen running (choice 5: a replica that fails to materialize; a question nobody could answer — Prometheus
        down — does not count)."""
        with self._lock:
            return {h for h in hosts if (st := self._state.get(h)) is not None and self._lost(st)}

    def _lost(self, st: _State) -> bool:
        return not st.ready and (st.was_ready or st.checked - st.first >= self.ready_timeout_s)

    def counts(self) -> dict[str, int]:
        """The engines asked about lately by state — ``ready``, ``loading`` (never answered yet), ``lost`` (served
        and stopped, or never came up in time) — for ``koi_engines`` (:mod:`infra.metrics`)."""
        with self._lock:
            states = list(self._state.values())
        out = {"ready": 0, "loading": 0, "lost": 0}
        for st in states:
            out["ready" if st.ready else "lost" if self._lost(st) else "loading"] += 1
        return out

    def _ask(self, hosts: list[str]) -> dict[str, bool]:
        """Each host's answer: probed concurrently, or read from Prometheus in one query (choice 6); nothing when
        Prometheus cannot say (what is known stands)."""
        if not hosts:
            return {}
        if self._answering is None:
            return dict(zip(hosts, self._pool.map(self._probe, hosts), strict=True))
        try:
            up = self._answering()
        except Exception as exc:  # noqa: BLE001 - Prometheus down or answering nonsense: no news, not failures
            log.warning("health.prometheus_failed", error=f"{type(exc).__name__}: {exc}")
            return {}
        return {h: h in up for h in hosts}

    def _probe(self, host: str) -> bool:
        with self._lock:  # probes run on the pool's threads
            self.probes += 1
        try:
            return self._client.get(f"http://{host}:{self.port}{self.path}").status_code == 200
        except httpx.HTTPError:
            return False

    def _record(self, host: str, ok: bool, now: float) -> None:
        with self._lock:
            s = self._state.setdefault(host, _State(asked=now))
            was, was_lost = s.ready, s.was_ready and not s.ready
            s.checked = now
            s.fails = 0 if ok else s.fails + 1
            s.ready = ok or (s.ready and s.fails < self.failures)
            s.was_ready = s.was_ready or s.ready
        if s.ready != was:  # an engine's first answer is routine (debug); losing one, or its return, is news
            (log.info if not s.ready or s.fails or was_lost else log.debug)("health.changed", host=host,
                                                                            ready=s.ready, fails=s.fails)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()
