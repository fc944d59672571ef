"""infra.health: engine readiness from vLLM's /health, probed over real HTTP on loopback (one engine per loopback
address, as a fleet's engines share one port)."""

from __future__ import annotations

from typing import Any

import pytest

from infra.health import FORGET_S, EngineHealth
from tests.fakes.http import TextHandler, serve, stop
from tests.test_infra_gateway import free_port


class Engines:
    """Engines on 127.0.2.x:port answering /health with ``status[host]`` (absent: not listening)."""

    def __init__(self) -> None:
        self.port, self.status, self.hits, self.servers = free_port(), {}, {}, {}

    def start(self, host: str, status: int = 200) -> str:
        self.status[host] = status
        eng = self

        class Handler(TextHandler):
            def do_GET(self) -> None:  # noqa: N802
                eng.hits[(host, self.path)] = eng.hits.get((host, self.path), 0) + 1
                self.send_text("", eng.status[host])

        self.servers[host] = serve(Handler, host, self.port)
        return host

    def close(self) -> None:
        for s in self.servers.values():
            stop(s)


@pytest.fixture
def engines() -> Any:
    e = Engines()
    yield e
    e.close()


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_ready_means_the_engine_answers_200(engines):
    up, loading, down = engines.start("127.0.2.1"), engines.start("127.0.2.2", 503), "127.0.2.3"
    h = EngineHealth(engines.port, timeout_s=1.0)
    try:
        assert h.ready([up, loading, down]) == {up}
        assert engines.hits[(up, "/health")] == 1
    finally:
        h.close()


def test_one_failure_does_not_unready_a_serving_engine_three_do_and_answers_stand_for_the_ttl(engines):
    host, clock = engines.start("127.0.2.4"), Clock()
    h = EngineHealth(engines.port, ttl_s=5.0, timeout_s=1.0, clock=clock)
    try:
        assert h.ready([host]) == {host} and h.probes == 1
        clock.t = 4.9
        assert h.ready([host]) == {host} and h.probes == 1  # within the TTL: no probe
        engines.status[host] = 500
        seen = []
        for k in range(1, 5):
            clock.t = 5.0 * k
            seen.append(bool(h.ready([host])))
        assert seen == [True, True, False, False] and h.probes == 5
        engines.status[host] = 200
        clock.t = 30.0
        assert h.ready([host]) == {host}  # one success: ready again
    finally:
        h.close()


def test_a_host_nobody_asks_about_is_forgotten_and_a_new_engine_there_starts_unproven(engines):
    host, clock = engines.start("127.0.2.5"), Clock()
    other = engines.start("127.0.2.6")
    h = EngineHealth(engines.port, timeout_s=1.0, clock=clock)
    try:
        assert h.ready([host]) == {host}
        clock.t = FORGET_S + 1.0
        h.ready([other])  # host released: not asked about any more
        engines.status[host] = 503  # a new instance on the same address, still loading
        clock.t += 0.1  # within the TTL of the old answer, which is gone
        assert h.ready([host]) == set()
    finally:
        h.close()


def test_many_hosts_are_probed_at_once(engines):
    """Each engine answers only once all eight have been asked (a barrier): probed one by one, none would be ready."""
    import threading

    hosts = [f"127.0.2.{i}" for i in range(10, 18)]
    barrier = threading.Barrier(len(hosts), timeout=10)
    for x in hosts:
        engines.start(x)

    class Gate(dict):
        def __getitem__(self, host: str) -> int:
            try:
                barrier.wait()
            except threading.BrokenBarrierError:
                return 500
            return 200

    engines.status = Gate(engines.status)
    h = EngineHealth(engines.port, timeout_s=15.0, workers=16)
    try:
        assert h.ready(hosts) == set(hosts)
    finally:
        h.close()


def test_an_engine_that_never_answers_is_lost_after_the_ready_timeout(engines):
    """A replica that fails to materialize (choice 5): loading until ``ready_timeout_s`` after it was first seen
    running, then lost; one that answers in time is ready, and lost only once it has stopped."""
    loading, clock = "127.0.2.30", Clock()
    fine = engines.start("127.0.2.31")
    h = EngineHealth(engines.port, ttl_s=5.0, timeout_s=1.0, ready_timeout_s=600.0, clock=clock)
    try:
        assert h.ready([loading, fine]) == {fine} and h.lost([loading, fine]) == set()
        clock.t = 599.0
        assert h.ready([loading, fine]) == {fine} and h.lost([loading, fine]) == set()
        clock.t = 603.0  # past the timeout, but its last answer (at 599) is not: not lost yet
        assert h.ready([loading, fine]) == {fine} and h.lost([loading, fine]) == set()
        clock.t = 604.0  # asked again: still no answer
        h.ready([loading, fine])
        assert h.lost([loading, fine]) == {loading}
        engines.start(loading)  # it comes up after all: ready, not lost
        clock.t = 610.0
        assert h.ready([loading]) == {loading} and h.lost([loading]) == set()
    finally:
        h.close()


def test_readiness_from_prometheus_asks_no_engine():
    """health_via: prometheus (choice 6): the engines Prometheus scraped last time are ready, in one query; when
    Prometheus cannot answer, what was known stands."""
    from infra.prometheus import PrometheusTelemetry
    from tests.test_infra_prometheus import FakePrometheus

    fake, clock = FakePrometheus(), Clock()
    prom = PrometheusTelemetry(fake.url, timeout_s=2.0)
    rows = [("10.0.0.1:8000", "1"), ("10.0.0.2:8000", "0")]
    fake.reply = (200, {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"__name__": "up", "koi_cluster": "c1", "instance": i}, "value": [1.0, v]}
        for i, v in rows if v == "1"]}})
    h = EngineHealth(8000, ttl_s=5.0, clock=clock, answering=lambda: prom.engines_answering("c1"))
    try:
        assert h.ready(["10.0.0.1", "10.0.0.2", "10.0.0.3"]) == {"10.0.0.1"} and h.probes == 0
        assert fake.requests[-1]["query"] == 'up{koi_cluster="c1"} == 1' and len(fake.requests) == 1
        fake.reply = (503, {"status": "error", "error": "overloaded"})
        for k in range(1, 5):  # Prometheus down for four rounds: no failures counted
            clock.t = 5.0 * k
            assert h.ready(["10.0.0.1", "10.0.0.2"]) == {"10.0.0.1"}
        assert h.lost(["10.0.0.1", "10.0.0.2"]) == set()
        h.ready_timeout_s = 10.0  # nor does an outage run out a loading engine's time
        assert h.lost(["10.0.0.2"]) == set()
    finally:
        h.close()
        prom.close()
        fake.close()
