"""infra.vllm_metrics: the Prometheus parser, p99 from bucket deltas, and the observer against
real HTTP servers on loopback serving vLLM-format pages that change between scrapes."""

from __future__ import annotations

import math
import socket
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from infra.vllm_metrics import (
    WINDOW_S,
    ScrapeTarget,
    VllmMetricsObserver,
    histogram_quantile,
    parse_exposition,
)
from koi import variables
from koi.domain import TelemetryWindow

TTFT_LE = (0.05, 0.1, 0.5, 1.0, 2.5)
TPOT_LE = (0.01, 0.025, 0.05, 0.1)


def _hist(name: str, le: tuple[float, ...], cum: tuple[float, ...], total_sum: float, labels: str) -> list[str]:
    """A vLLM histogram block; ``cum`` has one cumulative count per bound plus +Inf."""
    lines = [f"# HELP {name} Histogram.", f"# TYPE {name} histogram"]
    for b, c in zip((*[str(x) for x in le], "+Inf"), cum, strict=True):
        lines.append(f'{name}_bucket{{le="{b}",{labels}}} {c}')
    lines += [f"{name}_sum{{{labels}}} {total_sum}", f"{name}_count{{{labels}}} {cum[-1]}"]
    return lines


def page(*, running: float = 4, waiting: float = 1, kv: float | str = 0.5, preempt: float = 0, gen: float = 0,
         hits: float = 0, queries: float = 0, ttft: tuple[float, ...] = (0,) * 6, tpot: tuple[float, ...] = (0,) * 5,
         prompt: tuple[float, float] = (0, 0), out: tuple[float, float] = (0, 0), v0: bool = False) -> str:  # fmt: skip
    """A vLLM ``/metrics`` page (v1 names, or v0's where they differ)."""
    lb = 'engine="0",model_name="meta-llama/Llama-3.1-8B"'
    kv_name = "vllm:gpu_cache_usage_perc" if v0 else "vllm:kv_cache_usage_perc"
    pre = "vllm:gpu_prefix_cache" if v0 else "vllm:prefix_cache"
    tpot_name = "vllm:time_per_output_token_seconds" if v0 else "vllm:request_time_per_output_token_seconds"
    lines = [
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        f"vllm:num_requests_running{{{lb}}} {running}",
        "# TYPE vllm:num_requests_waiting gauge",
        f"vllm:num_requests_waiting{{{lb}}} {waiting}",
        f"# TYPE {kv_name} gauge",
        f"{kv_name}{{{lb}}} {kv}",
        "# TYPE vllm:num_preemptions_total counter",
        f"vllm:num_preemptions_total{{{lb}}} {preempt}",
        f"vllm:num_preemptions_created{{{lb}}} 1.7e9",
        "# TYPE vllm:generation_tokens_total counter",
        f"vllm:generation_tokens_total{{{lb}}} {gen}",
        f"vllm:prompt_tokens_total{{{lb}}} {gen * 10}",
        f"{pre}_hits_total{{{lb}}} {hits}",
        f"{pre}_queries_total{{{lb}}} {queries}",
        *_hist("vllm:time_to_first_token_seconds", TTFT_LE, ttft, 1.0, lb),
        *_hist(tpot_name, TPOT_LE, tpot, 1.0, lb),
        *_hist("vllm:request_prompt_tokens", (128.0, 1024.0), (0, prompt[1], prompt[1]), prompt[0], lb),
        *_hist("vllm:request_generation_tokens", (128.0, 1024.0), (0, out[1], out[1]), out[0], lb),
    ]
    return "\n".join(lines) + "\n"


class MetricsServer:
    """A loopback HTTP server: ``pages[path]`` is the body to serve, a callable making it at each request, or an
    int status to fail with."""

    def __init__(self) -> None:
        self.pages: dict[str, str | int | Callable[[], str]] = {}
        pages = self.pages

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                body = pages.get(self.path, 404)
                body = body() if callable(body) else body
                if isinstance(body, int):
                    self.send_error(body)
                    return
                data = body.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}{path}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Clock:
    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def server() -> Iterator[MetricsServer]:
    s = MetricsServer()
    yield s
    s.close()


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client() as c:
        yield c


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}/metrics"  # nothing listens: connection refused


def observe(server: MetricsServer, client: httpx.Client, targets: list[ScrapeTarget], steps: list[dict[str, str | int]],
            *, dt: float = 15.0, **kw: object) -> tuple[VllmMetricsObserver, Clock]:  # fmt: skip
    """Scrape once per step (pages set before each scrape), the clock advancing ``dt`` between them."""
    clock = Clock()
    obs = VllmMetricsObserver(targets, client=client, clock=clock, timeout_s=1.0, **kw)  # type: ignore[arg-type]
    for i, pages in enumerate(steps):
        clock.t = 100.0 + i * dt
        server.pages.update(pages)
        obs.scrape()
    return obs, clock


def one(ws: list[TelemetryWindow], rank_id: str) -> TelemetryWindow:
    [w] = [w for w in ws if w.rank_id == rank_id]
    return w


# ---- parser and quantile -------------------------------------------------------------------------
def test_parser_labels_escapes_inf_comments_and_garbage() -> None:
    text = "\n".join([
        "# HELP vllm:x A help line with {braces} and \"quotes\".",
        "# TYPE vllm:x counter",
        "# a free comment",
        "",
        'vllm:x{a="say \\"hi\\"",b="back\\\\slash",c="line\\nbreak",} 1.5 1700000000000',
        'h_bucket{le="+Inf"} 3',
        "neg -Inf",
        "nan NaN",
        "plain 2e3",
        "this is not a metric",  # line 10
        'u{a="unterminated} 1',  # 11
        "y 1_000",  # 12
        'z{a="1"} 1 2 3',  # 13
        "w{=} 1",  # 14
        'd{a="1",a="2"} 1',  # 15
        "t 1 notatimestamp",  # 16
        "bad-name 1",  # 17
        'e{a="\\q"} 1',  # 18: an escape the format does not define
    ])  # fmt: skip
    exp = parse_exposition(text)
    by = {s.name: s for s in exp.samples}
    assert exp.types == {"vllm:x": "counter"}
    x = by["vllm:x"]
    assert dict(x.labels) == {"a": 'say "hi"', "b": "back\\slash", "c": "line\nbreak"}
    assert x.value == 1.5 and x.timestamp_ms == 1700000000000
    assert by["h_bucket"].labels == (("le", "+Inf"),) and by["h_bucket"].value == 3
    assert by["neg"].value == -math.inf and math.isnan(by["nan"].value) and by["plain"].value == 2000.0
    assert [n for n, _ in exp.skipped] == [10, 11, 12, 13, 14, 15, 16, 17, 18]
    reasons = dict(exp.skipped)
    assert "label" in reasons[11] and "bad number" in reasons[12] and "duplicate" in reasons[15]
    assert "timestamp" in reasons[16] and "escape" in reasons[18]


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    # rank 99 of 100 lies in (0.5, 1.0] holding observations 91..100: 0.5 + 0.5 * (99 - 90) / 10
    assert histogram_quantile(0.99, [(0.1, 50), (0.5, 90), (1.0, 100), (math.inf, 100)]) == pytest.approx(0.95)
    # in the first bucket the lower bound is 0
    assert histogram_quantile(0.5, [(0.2, 10), (math.inf, 10)]) == pytest.approx(0.1)
    # a rank in the +Inf bucket: the highest finite bound
    assert histogram_quantile(0.99, [(0.1, 1), (1.0, 2), (math.inf, 10)]) == 1.0
    assert histogram_quantile(0.99, [(0.1, 0), (math.inf, 0)]) is None
    assert histogram_quantile(0.99, [(0.1, 5)]) is None  # no +Inf bucket


# ---- the observer over HTTP ------------------------------------------------------------------------


def target(server: MetricsServer, rank_id: str, *paths: str) -> ScrapeTarget:
    return ScrapeTarget("job-a", rank_id, "env-1", tuple(server.url(p) for p in paths))


def test_full_loop_three_scrapes_two_samples(server: MetricsServer, client: httpx.Client) -> None:
    steps = [
        {"/m": page(running=3, waiting=0, kv=0.25, preempt=2, gen=1000, hits=0, queries=0,
                    ttft=(10, 20, 20, 20, 20, 20), tpot=(5, 5, 5, 5, 5), prompt=(0, 0), out=(0, 0))},
        {"/m": page(running=5, waiting=2, kv=0.5, preempt=5, gen=2500, hits=300, queries=1000,
                    ttft=(10, 20, 120, 120, 120, 120), tpot=(5, 105, 105, 105, 105), prompt=(5120, 10),
                    out=(2000, 10))},
        {"/m": page(running=7, waiting=4, kv=0.75, preempt=5, gen=5500, hits=1300, queries=2000,
                    ttft=(10, 20, 120, 220, 220, 220), tpot=(5, 105, 205, 205, 205), prompt=(7168, 14),
                    out=(2600, 13))},
    ]  # fmt: skip
    obs, _ = observe(server, client, [target(server, "rank-0", "/m")], steps)
    assert sum(obs.problem_counts.values()) == 0, list(obs.problems)
    [w] = obs.telemetry(100.0, 130.0, cluster_id="c1", tick=7)
    assert (w.cluster_id, w.tick, w.job_id, w.rank_id, w.env_id) == ("c1", 7, "job-a", "rank-0", "env-1")
    assert w.times == [115.0, 130.0] and (w.t_start, w.t_end) == (100.0, 130.0)
    s = w.series
    assert s["live_batch_size"] == [5, 7] and s["queue_depth"] == [2, 4] and s["kv_cache_util"] == [0.5, 0.75]
    assert s["throughput_tokens_per_sec"] == pytest.approx([1500 / 15, 3000 / 15])  # generated tokens only
    assert s["preemption_rate"] == pytest.approx([3 / 15, 0.0])
    assert s["kvcache_hit_rate"] == pytest.approx([0.3, 1.0])
    assert s["input_length_observed"] == pytest.approx([512.0, 512.0])  # 5120/10, then 2048/4
    assert s["output_length_observed"] == pytest.approx([200.0, 200.0])  # 2000/10, then 600/3
    # p99s over the 120-s window, which here holds every pair: at 115 pair 1's 100 new TTFTs, all in
    # (0.1, 0.5] -> 0.1 + 0.4 * 99/100; at 130 those and pair 2's 100 in (0.5, 1.0]: rank 198 of 200
    # -> 0.5 + 0.5 * (198 - 100)/100 (pair 2 alone would be 0.5 + 0.5 * 0.99)
    assert s["p99_ttft_ms"] == pytest.approx([1e3 * (0.1 + 0.4 * 0.99), 1e3 * (0.5 + 0.5 * 0.98)])
    assert s["p99_tpot_ms"] == pytest.approx([1e3 * (0.01 + 0.015 * 0.99), 1e3 * (0.025 + 0.025 * 0.98)])
    assert set(s) <= set(variables.TELEMETRY_SERIES)
    TelemetryWindow.model_validate(w.model_dump())  # validates again from plain data
    # the window cuts by the later scrape's time: (115, 130] holds only the second sample
    [w2] = obs.telemetry(115.0, 130.0, cluster_id="c1", tick=8)
    assert w2.times == [130.0] and w2.series["live_batch_size"] == [7]
    assert obs.telemetry(130.0, 200.0, cluster_id="c1", tick=9) == []


def test_p99_uses_bucket_deltas_not_cumulative_counts(server: MetricsServer, client: httpx.Client) -> None:
    # 1000 old fast requests, then 10 slow ones: the cumulative p99 would sit in the fast bucket
    steps = [{"/m": page(ttft=(1000, 1000, 1000, 1000, 1000, 1000))},
             {"/m": page(ttft=(1000, 1000, 1000, 1000, 1010, 1010))}]  # fmt: skip
    obs, _ = observe(server, client, [target(server, "r", "/m")], steps)
    [w] = obs.telemetry(0, 1e9, cluster_id="c", tick=1)
    assert w.series["p99_ttft_ms"] == pytest.approx([1e3 * (1.0 + 1.5 * 9.9 / 10)])


def test_two_engines_of_a_rank_are_aggregated(server: MetricsServer, client: httpx.Client) -> None:
    steps = [
        {"/a": page(running=2, kv=0.2, gen=0, preempt=0), "/b": page(running=6, kv=0.6, gen=0, preempt=0)},
        {"/a": page(running=2, kv=0.2, gen=300, preempt=3, ttft=(98, 98, 98, 98, 98, 98), hits=10, queries=100),
         "/b": page(running=6, kv=0.6, gen=600, preempt=0, ttft=(0, 0, 0, 0, 2, 2), hits=90, queries=100)},
    ]  # fmt: skip
    obs, _ = observe(server, client, [target(server, "r", "/a", "/b")], steps)
    [w] = obs.telemetry(0, 1e9, cluster_id="c", tick=1)
    s = w.series
    assert s["throughput_tokens_per_sec"] == pytest.approx([900 / 15])  # summed
    assert s["preemption_rate"] == pytest.approx([3 / 15])
    assert s["live_batch_size"] == [4.0] and s["kv_cache_util"] == pytest.approx([0.4])  # per-engine means
    assert s["kvcache_hit_rate"] == pytest.approx([0.5])  # 100 hits / 200 queried tokens
    # merged buckets: 98 fast (<= 0.05) + 2 slow in (1.0, 2.5]; rank 99 -> 1.0 + 1.5 * (99 - 98) / 2
    assert s["p99_ttft_ms"] == pytest.approx([1e3 * 1.75])


def test_v0_metric_names_are_read(server: MetricsServer, client: httpx.Client) -> None:
    steps = [{"/m": page(v0=True, kv=0.1)},
             {"/m": page(v0=True, kv=0.3, hits=5, queries=10, tpot=(10, 10, 10, 10, 10))}]  # fmt: skip
    obs, _ = observe(server, client, [target(server, "r", "/m")], steps)
    [w] = obs.telemetry(0, 1e9, cluster_id="c", tick=1)
    assert w.series["kv_cache_util"] == [0.3] and w.series["kvcache_hit_rate"] == [0.5]
    assert w.series["p99_tpot_ms"] == pytest.approx([1e3 * 0.01 * 0.99])


def test_counter_reset_is_not_a_negative_rate(server: MetricsServer, client: httpx.Client) -> None:
    steps = [{"/m": page(gen=10_000, preempt=50, prompt=(9000, 90), ttft=(90, 90, 90, 90, 90, 90))},
             {"/m": page(gen=300, preempt=0, prompt=(1000, 2), ttft=(0, 0, 2, 2, 2, 2))}]  # engine restarted
    obs, _ = observe(server, client, [target(server, "r", "/m")], steps)
    [w] = obs.telemetry(0, 1e9, cluster_id="c", tick=1)
    assert w.series["throughput_tokens_per_sec"] == pytest.approx([300 / 15])  # counted from 0
    assert w.series["preemption_rate"] == [0.0]
    assert w.series["input_length_observed"] == [500.0]
    assert w.series["p99_ttft_ms"] == pytest.approx([1e3 * (0.1 + 0.4 * 0.99)])
    assert obs.problem_counts["counter_reset"] >= 3
    assert all(x >= 0 for xs in w.series.values() for x in xs)


def test_nan_gauge_is_dropped_and_held_or_left_out(server: MetricsServer, client: httpx.Client) -> None:
    steps = [{"/m": page(kv=0.1)}, {"/m": page(kv=0.2)}, {"/m": page(kv="NaN")}]
    tg = [target(server, "r", "/m")]
    held, _ = observe(server, client, tg, steps)
    [w] = held.telemetry(0, 1e9, cluster_id="c", tick=1)
    assert w.times == [115.0, 130.0] and w.series["kv_cache_util"] == [0.2, 0.2]  # held, as the simulator does
    assert held.problem_counts["non_finite"] == 1
    assert any(p.reason == "non_finite" and "kv_cache_usage_perc" in p.detail for p in held.problems)
    strict, _ = observe(server, client, tg, steps, hold_missing=False)
    [w] = strict.telemetry(0, 1e9, cluster_id="c", tick=1)
    assert "kv_cache_util" not in w.series and w.series["live_batch_size"] == [4, 4]
    # a series never observed in the window (no request finished) is absent, not zero
    assert "p99_ttft_ms" not in w.series and "input_length_observed" not in w.series


def test_out_of_range_fraction_dropped(server: MetricsServer, client: httpx.Client) -> None:
    obs, _ = observe(server, client, [target(server, "r", "/m")], [{"/m": page()}, {"/m": page(kv=75)}])
    [w] = obs.telemetry(0, 1e9, cluster_id="c", tick=1)
    assert "kv_cache_util" not in w.series and obs.problem_counts["out_of_range"] == 1


def test_non_monotone_histogram_dropped(server: MetricsServer, client: httpx.Client) -> None:
    steps = [{"/m": page()}, {"/m": page(ttft=(5, 3, 9, 9, 9, 9), tpot=(1, 1, 1, 1, 1))}]
    obs, _ = observe(server, client, [target(server, "r", "/m")], steps)
    [w] = obs.telemetry(0, 1e9, cluster_id="c", tick=1)
    assert "p99_ttft_ms" not in w.series and "p99_tpot_ms" in w.series
    assert obs.problem_counts["non_monotone_histogram"] == 1


def test_garbage_lines_skipped_with_reasons(server: MetricsServer, client: httpx.Client) -> None:
    bad = "garbage here\nvllm:num_requests_running{oops 3\n"
    obs, _ = observe(server, client, [target(server, "r", "/m")],
                     [{"/m": bad + page(running=1)}, {"/m": page(running=2) + bad}])  # fmt: skip
    [w] = obs.telemetry(0, 1e9, cluster_id="c", tick=1)
    assert w.series["live_batch_size"] == [2]
    assert obs.problem_counts["malformed_line"] == 4
    assert all(p.where == server.url("/m") for p in obs.problems)


def test_failing_endpoints_do_not_stop_other_ranks(server: MetricsServer, client: httpx.Client) -> None:
    refused = closed_port_url()
    targets = [
        target(server, "r-500", "/err"),
        ScrapeTarget("job-a", "r-refused", "env-1", (refused,)),
        target(server, "r-ok", "/ok"),
        ScrapeTarget("job-a", "r-half", "env-1", (server.url("/ok2"), refused)),  # one replica down
    ]
    steps = [{"/err": 500, "/ok": page(gen=0), "/ok2": page(gen=0)},
             {"/ok": page(gen=150), "/ok2": page(gen=300)}]  # fmt: skip
    obs, _ = observe(server, client, targets, steps)
    ws = obs.telemetry(0, 1e9, cluster_id="c", tick=1)
    assert sorted(w.rank_id for w in ws) == ["r-half", "r-ok"]
    assert one(ws, "r-ok").series["throughput_tokens_per_sec"] == [10.0]
    assert one(ws, "r-half").series["throughput_tokens_per_sec"] == [20.0]
    assert obs.problem_counts["http_error"] == 2 and obs.problem_counts["unreachable"] == 2  # one fetch per url per scrape
    assert obs.problem_counts["no_endpoint"] == 4  # r-500 and r-refused, twice each
    assert any(p.where == refused and p.reason == "unreachable" for p in obs.problems)


def test_recovered_endpoint_and_clock_that_did_not_move(server: MetricsServer, client: httpx.Client) -> None:
    clock = Clock(100.0)
    obs = VllmMetricsObserver(lambda: [target(server, "r", "/m")], client=client, clock=clock)
    server.pages["/m"] = 503
    obs.scrape()
    server.pages["/m"] = page(gen=0)
    clock.t = 115.0
    obs.scrape()
    obs.scrape()  # same clock reading: no sample, no division by zero
    server.pages["/m"] = page(gen=450)
    clock.t = 130.0
    obs.scrape()
    [w] = obs.telemetry(0, 1e9, cluster_id="c", tick=1)
    assert w.times == [130.0] and w.series["throughput_tokens_per_sec"] == [30.0]
    assert obs.problem_counts["http_error"] == 1 and obs.problem_counts["non_increasing_time"] == 1


def test_failing_targets_callable_and_buffer_bound(server: MetricsServer, client: httpx.Client) -> None:
    def boom() -> list[ScrapeTarget]:
        raise RuntimeError("inventory down")

    obs = VllmMetricsObserver(boom, client=client, clock=Clock())
    assert obs.scrape() == 0 and obs.problem_counts["targets_failed"] == 1
    obs, _ = observe(server, client, [target(server, "r", "/m")], [{"/m": page()}] * 6, max_samples=3)
    [w] = obs.telemetry(0, 1e9, cluster_id="c", tick=1)
    assert w.times == [145.0, 160.0, 175.0]


def test_invalid_window_is_dropped_with_a_reason(server: MetricsServer, client: httpx.Client) -> None:
    obs, _ = observe(server, client, [target(server, "r", "/m")], [{"/m": page()}, {"/m": page()}])
    assert obs.telemetry(0, 1e9, cluster_id="c", tick=-1) == []  # TelemetryWindow refuses tick < 0
    assert obs.problem_counts["invalid_window"] == 1
    assert len(obs.telemetry(0, 1e9, cluster_id="c", tick=0)) == 1


def test_rank_that_left_the_targets_is_served_then_forgotten(server: MetricsServer, client: httpx.Client) -> None:
    fleet = [target(server, "old", "/a"), target(server, "new", "/b")]
    clock = Clock()
    obs = VllmMetricsObserver(lambda: list(fleet), client=client, clock=clock, retain_s=60.0)
    server.pages.update({"/a": page(gen=0), "/b": page(gen=0)})
    obs.scrape()
    clock.t, server.pages["/a"], server.pages["/b"] = 115.0, page(gen=150), page(gen=15)
    assert obs.scrape() == 2
    fleet.pop(0)  # "old" torn down
    clock.t = 130.0
    assert obs.scrape() == 1
    assert sorted(w.rank_id for w in obs.telemetry(100, 130, cluster_id="c", tick=1)) == ["new", "old"]
    clock.t = 200.0  # more than retain_s after old's last scrape
    obs.scrape()
    assert [w.rank_id for w in obs.telemetry(100, 200, cluster_id="c", tick=2)] == ["new"]


# ---- the trailing latency window ----------------------------------------------------------------
# TTFT buckets (0.05, 0.1, 0.5, 1.0, 2.5, +Inf), cumulative: pair 1 adds 100 fast TTFTs (<= 0.05 s),
# pair 2 adds 10 in (1.0, 2.5], pair 3 adds 90 in (0.1, 0.5]; scrapes at 100, 115, 130, 145
WINDOW_STEPS = [
    {"/m": page(gen=0, ttft=(0, 0, 0, 0, 0, 0))},
    {"/m": page(gen=1500, ttft=(100, 100, 100, 100, 100, 100))},
    {"/m": page(gen=1500, ttft=(100, 100, 100, 100, 110, 110))},
    {"/m": page(gen=3000, ttft=(100, 100, 190, 190, 200, 200))},
]
PAIR_P99 = [1e3 * 0.05 * 0.99, 1e3 * (1.0 + 1.5 * 9.9 / 10), 1e3 * (0.1 + 0.4 * 89.1 / 90)]  # each pair alone


def test_trailing_window_p99_merges_the_pairs_in_the_window(server: MetricsServer, client: httpx.Client) -> None:
    obs, _ = observe(server, client, [target(server, "r", "/m")], WINDOW_STEPS, window_s=30.0)
    [w] = obs.telemetry(0, 1e9, cluster_id="c", tick=1)
    assert w.times == [115.0, 130.0, 145.0]
    assert w.series["p99_ttft_ms"] == pytest.approx([
        PAIR_P99[0],  # at 115 the history (from 100) is shorter than 30 s: pair 1 alone
        1e3 * (1.0 + 1.5 * (108.9 - 100) / 10),  # at 130, from 100: pairs 1+2, rank 108.9 of 110
        1e3 * (1.0 + 1.5 * (99 - 90) / 10),  # at 145, from 115: pairs 2+3, rank 99 of 100 (pair 3 alone: 496 ms)
    ])  # fmt: skip
    assert w.series["throughput_tokens_per_sec"] == pytest.approx([100.0, 0.0, 100.0])  # per pair, as the simulator
    assert obs.problem_counts.total() == 0, list(obs.problems)
    # the default window (the simulator's 120 s) holds all three pairs at 145: rank 198 of 200
    obs, _ = observe(server, client, [target(server, "r", "/m")], WINDOW_STEPS)
    [w] = obs.telemetry(140, 1e9, cluster_id="c", tick=1)
    assert obs.window_s == WINDOW_S == 120.0 and w.series["p99_ttft_ms"] == pytest.approx([1e3 * 2.2])


def test_window_zero_is_the_per_pair_p99(server: MetricsServer, client: httpx.Client) -> None:
    obs, _ = observe(server, client, [target(server, "r", "/m")], WINDOW_STEPS, window_s=0)
    [w] = obs.telemetry(0, 1e9, cluster_id="c", tick=1)
    assert w.series["p99_ttft_ms"] == pytest.approx(PAIR_P99)
    assert w.series["throughput_tokens_per_sec"] == pytest.approx([100.0, 0.0, 100.0])
    # a window shorter than the scrape period is the per-pair p99 too (the last pair is always in it)
    obs, _ = observe(server, client, [target(server, "r", "/m")], WINDOW_STEPS, window_s=10.0)
    assert obs.telemetry(0, 1e9, cluster_id="c", tick=1)[0].series["p99_ttft_ms"] == pytest.approx(PAIR_P99)
    with pytest.raises(ValueError, match="window_s"):
        VllmMetricsObserver([], client=client, window_s=-1.0)


def test_simulator_window_is_the_default() -> None:
    from koi.sim.telemetry import WINDOW_S as SIM_WINDOW_S

    assert WINDOW_S == SIM_WINDOW_S


def test_counter_reset_inside_the_window(server: MetricsServer, client: httpx.Client) -> None:
    # 50 old fast TTFTs before the first scrape; the engine restarts between 115 and 130, so its counts
    # start again from 0: the end-to-end delta 145 - 100 would be negative in the fast buckets
    steps = [
        {"/m": page(gen=1000, ttft=(50, 50, 50, 50, 50, 50))},
        {"/m": page(gen=2500, ttft=(150, 150, 150, 150, 150, 150))},  # +100 fast
        {"/m": page(gen=300, ttft=(0, 0, 0, 0, 10, 10))},  # restarted: 10 in (1.0, 2.5] since
        {"/m": page(gen=900, ttft=(0, 0, 90, 90, 100, 100))},  # +90 in (0.1, 0.5]
    ]
    obs, _ = observe(server, client, [target(server, "r", "/m")], steps)
    [w] = obs.telemetry(0, 1e9, cluster_id="c", tick=1)
    # the window (from 100) sums the reset-aware pair deltas: the same 100 + 10 + 90 as WINDOW_STEPS
    assert w.series["p99_ttft_ms"] == pytest.approx([PAIR_P99[0], 1e3 * (1.0 + 1.5 * 8.9 / 10), 1e3 * 2.2])
    assert w.series["throughput_tokens_per_sec"] == pytest.approx([100.0, 20.0, 40.0])
    # one note per reset (the TTFT histogram and the token counter), not one per window holding it
    assert obs.problem_counts["counter_reset"] == 2 and obs.problem_counts.total() == 2


def test_window_restarts_after_a_gap(server: MetricsServer, client: httpx.Client) -> None:
    clock = Clock()
    obs = VllmMetricsObserver([target(server, "r", "/m")], client=client, clock=clock, max_gap_s=20.0)
    for t, pages in zip((100.0, 115.0, 140.0, 155.0, 170.0), WINDOW_STEPS + [{"/m": page(
            gen=3000, ttft=(100, 100, 190, 190, 210, 210))}], strict=True):  # fmt: skip
        clock.t = t
        server.pages.update(pages)
        obs.scrape()
    [w] = obs.telemetry(0, 1e9, cluster_id="c", tick=1)
    # 115 -> 140 is a gap: no sample, and the window starts again at 140, the oldest scrape after it
    assert w.times == [115.0, 155.0, 170.0] and obs.problem_counts["gap"] == 1
    # 155: pair 3 alone, not pair 1's fast requests; 170: pair 3 + 10 more in (1.0, 2.5]: rank 99 of 100
    assert w.series["p99_ttft_ms"] == pytest.approx([PAIR_P99[0], PAIR_P99[2], 1e3 * (1.0 + 1.5 * 9 / 10)])


def test_window_buffer_is_bounded(server: MetricsServer, client: httpx.Client) -> None:
    # pairs that ended at or before t - window_s are dropped: window_s=30 at a 15-s period keeps 2
    obs, _ = observe(server, client, [target(server, "r", "/m")], WINDOW_STEPS * 3, window_s=30.0)
    [st] = obs._ranks.values()
    assert [t for t, _ in st.pairs] == [250.0, 265.0] and "window_truncated" not in obs.problem_counts
    # max_samples pairs cannot cover the window: the window is the last max_samples pairs, noted once
    obs, _ = observe(server, client, [target(server, "r", "/m")], WINDOW_STEPS, max_samples=2)
    [w] = obs.telemetry(0, 1e9, cluster_id="c", tick=1)
    assert w.series["p99_ttft_ms"][-1] == pytest.approx(1e3 * 2.35)  # pairs 2+3, not all three (2.2)
    assert obs.problem_counts["window_truncated"] == 1
    assert len(obs._ranks[("job-a", "r")].pairs) == 2
