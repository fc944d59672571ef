"""What readiness costs a fleet read: ``python benchmarks/health_probe.py [--engines N] [--down K] [--slow S]
[--reads R] [--json]``.

Starts N loopback engines answering ``/health`` (one port, one address each, 127.0.3.x, as a fleet's engines share
one port), K addresses where nothing listens (an engine still loading) and S engines that answer after 1.5 s (an
overloaded one), then times :meth:`infra.health.EngineHealth.ready` over all of them: cold (every host probed, as
the first read of a worker), and warm (the answers standing, as every read within ``health_every_s``). The worker
asks once per fleet read (the sweep every 10 s, the gateway sync every 15 s, a few times per tick). Loopback: no
network latency.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    from infra.health import EngineHealth
    from tests.fakes.http import TextHandler, serve, stop
    from tests.test_infra_gateway import free_port

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", type=int, default=100)
    ap.add_argument("--down", type=int, default=20)
    ap.add_argument("--slow", type=int, default=4)
    ap.add_argument("--reads", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    class Ok(TextHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_text("")

    class Slow(TextHandler):
        def do_GET(self) -> None:  # noqa: N802
            time.sleep(1.5)
            self.send_text("")

    port = free_port()
    addr = (f"127.0.3.{i % 250 + 2}" if i < 250 else f"127.0.4.{i % 250 + 2}" for i in range(10_000))
    up = [next(addr) for _ in range(a.engines)]
    slow = [next(addr) for _ in range(a.slow)]
    down = [next(addr) for _ in range(a.down)]
    servers = [serve(Ok, h, port) for h in up] + [serve(Slow, h, port) for h in slow]
    hosts = up + slow + down
    cold, warm = [], []
    try:
        for _ in range(a.reads):
            h = EngineHealth(port, ttl_s=3600.0, timeout_s=2.0)
            t = time.perf_counter()
            ready = h.ready(hosts)
            cold.append(time.perf_counter() - t)
            assert ready == set(up + slow), len(ready)
            t = time.perf_counter()
            h.ready(hosts)
            warm.append(time.perf_counter() - t)
            h.close()
    finally:
        for s in servers:
            stop(s)
    out = {"engines": a.engines, "down": a.down, "slow": a.slow, "reads": a.reads,
           "cold_s_median": round(statistics.median(cold), 3), "cold_s_max": round(max(cold), 3),
           "warm_ms_median": round(1000 * statistics.median(warm), 3)}
    if a.json:
        print(json.dumps(out))
    else:
        print(f"{a.engines} engines up, {a.slow} slow (1.5 s), {a.down} not listening: a cold read "
              f"{out['cold_s_median']} s (max {out['cold_s_max']}), a warm one {out['warm_ms_median']} ms")


if __name__ == "__main__":
    main()
