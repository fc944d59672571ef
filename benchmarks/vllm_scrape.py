"""Can one worker scrape a 400-GPU fleet's engines every 15 s? ``python benchmarks/vllm_scrape.py [--engines N]
[--scrapes K] [--json]``.

Serves N distinct vLLM ``/metrics`` pages (v1 names, the histograms vLLM exports, ~90 lines each) from one loopback
HTTP server, points a :class:`infra.vllm_metrics.VllmMetricsObserver` at them (one rank per engine), scrapes K times
with the counters and buckets moving between scrapes, then cuts the windows S1 would read. Reports the wall time of
one scrape (HTTP, parse, pairing) and of ``telemetry()``, against the 15-s scrape period. Loopback has no network
latency: on a real VPC the scrape is bounded by the slowest engine (``timeout_s``, parallel fetches).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from infra.vllm_metrics import ScrapeTarget, VllmMetricsObserver

TTFT_LE = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
TPOT_LE = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)


def _hist(name: str, le: tuple[float, ...], n: int, lb: str) -> list[str]:
    cum = [round(n * (i + 1) / (len(le) + 1)) for i in range(len(le))] + [n]
    out = [f"# TYPE {name} histogram"]
    out += [f'{name}_bucket{{le="{b}",{lb}}} {c}' for b, c in zip((*map(str, le), "+Inf"), cum, strict=True)]
    return out + [f"{name}_sum{{{lb}}} {n * 0.2}", f"{name}_count{{{lb}}} {n}"]


def page(engine: int, step: int) -> str:
    lb = f'engine="0",model_name="m{engine}"'
    n = 100 * step + engine
    lines = [
        "# TYPE vllm:num_requests_running gauge", f"vllm:num_requests_running{{{lb}}} {8 + engine % 5}",
        "# TYPE vllm:num_requests_waiting gauge", f"vllm:num_requests_waiting{{{lb}}} {engine % 3}",
        "# TYPE vllm:kv_cache_usage_perc gauge", f"vllm:kv_cache_usage_perc{{{lb}}} 0.{40 + engine % 50}",
        "# TYPE vllm:num_preemptions_total counter", f"vllm:num_preemptions_total{{{lb}}} {step}",
        "# TYPE vllm:generation_tokens_total counter", f"vllm:generation_tokens_total{{{lb}}} {n * 300}",
        "# TYPE vllm:prompt_tokens_total counter", f"vllm:prompt_tokens_total{{{lb}}} {n * 1000}",
        f"vllm:prefix_cache_hits_total{{{lb}}} {n * 200}", f"vllm:prefix_cache_queries_total{{{lb}}} {n * 1000}",
        *_hist("vllm:time_to_first_token_seconds", TTFT_LE, n, lb),
        *_hist("vllm:request_time_per_output_token_seconds", TPOT_LE, n, lb),
        *_hist("vllm:inter_token_latency_seconds", TPOT_LE, n * 300, lb),
        *_hist("vllm:e2e_request_latency_seconds", TTFT_LE, n, lb),
        *_hist("vllm:request_prompt_tokens", (128.0, 512.0, 1024.0, 4096.0), n, lb),
        *_hist("vllm:request_generation_tokens", (128.0, 512.0, 1024.0, 4096.0), n, lb),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engines", type=int, default=400, help="engines to scrape (one rank each)")
    ap.add_argument("--scrapes", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # as infra.cloud's provider does in a worker
    state = {"step": 0}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            body = page(int(self.path.rsplit("/", 1)[-1]), state["step"]).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    port = httpd.server_address[1]
    targets = [ScrapeTarget(job_id=f"j{i}", rank_id=f"j{i}/r", env_id="aws:us-east-1:us-east-1a:on_demand:H100",
                            urls=(f"http://127.0.0.1:{port}/metrics/{i}",)) for i in range(a.engines)]
    clock = {"t": 0.0}
    obs = VllmMetricsObserver(targets, clock=lambda: clock["t"], timeout_s=5.0)
    times = []
    for k in range(a.scrapes):
        state["step"], clock["t"] = k + 1, 15.0 * (k + 1)
        t0 = time.perf_counter()
        obs.scrape()
        times.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    windows = obs.telemetry(0.0, clock["t"], cluster_id="bench", tick=1)
    t_tel = time.perf_counter() - t0
    httpd.shutdown()
    out = {"engines": a.engines, "scrapes": a.scrapes, "scrape_s_median": round(statistics.median(times), 3),
           "scrape_s_max": round(max(times), 3), "telemetry_s": round(t_tel, 3), "windows": len(windows),
           "problems": dict(obs.problem_counts), "budget_s": 15.0}
    print(json.dumps(out) if a.json else "\n".join(f"{k:16s} {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
