"""How long does S1 take to read a 400-engine fleet's tick from Prometheus? ``python benchmarks/prometheus_read.py
[--engines N] [--tick-s 300] [--reads K] [--json]``.

Backfills a real Prometheus (Debian's, ``scripts/ensure-debian-tools.sh``) with ``promtool tsdb create-blocks-from
openmetrics``: N engines (one rank each, the pages of ``benchmarks/vllm_scrape.py``: v1 names, ~90 series) sampled
every 15 s over one tick plus the 120-s latency window, labelled as Koi's file discovery labels them. Then starts
Prometheus on those blocks and times :meth:`infra.prometheus.PrometheusTelemetry.telemetry` for the tick K times
(the query, the JSON, the cut into windows), against the tick interval. Loopback: no network latency.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from vllm_scrape import page  # noqa: E402

from infra.prometheus import PrometheusTelemetry, selector  # noqa: E402
from infra.vllm_metrics import WINDOW_S, parse_exposition  # noqa: E402

STEP = 15.0


def binary(name: str) -> str:
    local = ROOT / ".venv/opt/prometheus/usr/bin" / name
    found = shutil.which(name) or (str(local) if local.exists() else None)
    if not found:
        sys.exit(f"no {name}: run scripts/ensure-debian-tools.sh")
    return found


def openmetrics(engines: int, times: list[float]) -> str:
    """One ``unknown`` family per series name (OpenMetrics wants a family's samples together), samples in time order."""
    fam: dict[str, list[str]] = {}
    for i in range(engines):
        extra = (f'instance="10.0.{i // 250}.{i % 250}:8000",job="koi-vllm",koi_cluster="bench",koi_job="j{i}",'
                 f'koi_rank="j{i}/r",koi_env="aws/us-east-1/us-east-1a/on_demand/H100"')
        for k, t in enumerate(times):
            for s in parse_exposition(page(i, k + 1)).samples:
                labels = ",".join(f'{n}="{v}"' for n, v in s.labels)
                fam.setdefault(s.name, []).append(f"{s.name}{{{labels},{extra}}} {s.value:g} {t:.3f}")
    out = []
    for name, lines in fam.items():
        out.append(f"# TYPE {name} unknown")
        out.extend(lines)
    out.append("# EOF")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", type=int, default=400)
    ap.add_argument("--tick-s", type=float, default=300.0)
    ap.add_argument("--reads", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)
    t_end = STEP * (time.time() // STEP) - 3600.0  # an hour ago: inside retention, outside the head block
    t_start = t_end - a.tick_s
    n = int((a.tick_s + WINDOW_S) / STEP) + 2
    times = [t_end - STEP * j for j in range(n, -1, -1)]
    with tempfile.TemporaryDirectory() as d:
        dd = Path(d)
        t0 = time.perf_counter()
        (dd / "in.om").write_text(openmetrics(a.engines, times))
        subprocess.run([binary("promtool"), "tsdb", "create-blocks-from", "openmetrics", str(dd / "in.om"),
                        str(dd / "data")], check=True, capture_output=True)
        t_backfill = time.perf_counter() - t0
        (dd / "prometheus.yml").write_text("global: {scrape_interval: 15s}\n")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([binary("prometheus"), f"--config.file={dd / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={dd / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                                 "--log.level=warn"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(300):
                try:
                    if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                        break
                except httpx.HTTPError:
                    time.sleep(0.1)
            tel = PrometheusTelemetry(url, step_s=STEP, timeout_s=120.0)
            reads, windows = [], []
            for _ in range(a.reads):
                t0 = time.perf_counter()
                windows = tel.telemetry(t_start, t_end, cluster_id="bench", tick=1)
                reads.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            result = tel.query_range(selector("bench"), tel.grid(t_start, t_end)[0], t_end)
            t_query = time.perf_counter() - t0
        finally:
            proc.terminate()
            proc.wait(timeout=10)
    out = {"engines": a.engines, "tick_s": a.tick_s, "series": len(result),
           "points": sum(len(r["values"]) for r in result), "backfill_s": round(t_backfill, 1),
           "read_s_median": round(statistics.median(reads), 2), "read_s_max": round(max(reads), 2),
           "query_and_json_s": round(t_query, 2), "windows": len(windows),
           "samples_per_window": len(windows[0].times) if windows else 0,
           "problems": sorted({p.reason for p in tel.problems}), "budget_s": a.tick_s}
    print(json.dumps(out) if a.json else "\n".join(f"{k:18s} {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
