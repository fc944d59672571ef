"""infra.prometheus: S1's telemetry read back from a real Prometheus server (Debian's, fetched by
scripts/ensure-debian-tools.sh) that scraped loopback vLLM pages found through the file-SD file Koi wrote;
and the failure paths against a loopback fake of Prometheus' HTTP API."""

from __future__ import annotations

import json
import math
import os
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from infra.prometheus import (
    PrometheusTelemetry,
    PrometheusUnavailable,
    file_sd_entries,
    selector,
    write_file_sd,
)
from infra.vllm_metrics import ScrapeTarget, series_names
from tests.fakes.http import JsonHandler
from tests.test_infra_vllm_metrics import MetricsServer, closed_port_url, page

ROOT = Path(__file__).resolve().parents[1]
STEP = 2.0  # the query's step; the engines stamp their samples on this grid (see stamped)


def prometheus_bin() -> str:
    found = os.environ.get("KOI_PROMETHEUS_BIN") or shutil.which("prometheus")
    local = ROOT / ".venv/opt/prometheus/usr/bin/prometheus"
    if found:
        return found
    if local.exists():
        return str(local)
    pytest.fail("no prometheus binary: run scripts/ensure-debian-tools.sh (make test does) or set KOI_PROMETHEUS_BIN")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stamped(text: str, ts: float) -> str:
    """The page with every sample stamped ``ts`` (ms). Prometheus honours exposed timestamps, so the samples sit on
    the query's grid whatever the scrape's phase — the test's values are exact, not within a scrape's jitter."""
    ms = int(round(ts * 1000))
    return "".join(f"{line}\n" if line.startswith("#") or not line.strip() else f"{line} {ms}\n"
                   for line in text.splitlines())


def engine_page(t0: float, *, gen_rate: float, req_rate: float, running: float, kv: float) -> Any:
    """A vLLM page whose counters grow linearly from ``t0``, stamped at the last grid point: generated tokens at
    ``gen_rate``, requests at ``req_rate`` with 50% TTFT ≤ 50 ms, 30% in (50, 100] ms, 20% in (100, 500] ms."""

    def make() -> str:
        ts = t0 + STEP * math.floor((time.time() - t0) / STEP)
        n = req_rate * (ts - t0)
        body = page(running=running, waiting=1, kv=kv, gen=gen_rate * (ts - t0),
                    ttft=(0.5 * n, 0.8 * n, n, n, n, n), tpot=(0.9 * n, n, n, n, n), prompt=(500 * n, n), out=(200 * n, n))
        return stamped(body, ts)

    return make


def start_prometheus(d: Path, config: str, *flags: str) -> tuple[subprocess.Popen, str]:
    """A Prometheus on a free loopback port with ``config``, its data and log in ``d``; waits until ready."""
    port = free_port()
    (d / "prometheus.yml").write_text(config)
    with open(d / "prom.log", "w") as err:
        proc = subprocess.Popen([prometheus_bin(), f"--config.file={d / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={d / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
                                 "--log.level=warn", *flags], stdout=subprocess.DEVNULL, stderr=err)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            if httpx.get(f"{url}/-/ready", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            pytest.fail(f"prometheus exited: {(d / 'prom.log').read_text()[-2000:]}")
        time.sleep(0.1)
    proc.terminate()
    pytest.fail("prometheus did not become ready in 20 s")


@pytest.fixture(scope="module")
def prom(tmp_path_factory) -> Iterator[dict[str, Any]]:
    """Prometheus scraping every second the targets of the file-SD files in ``sd``, on loopback. The lookback is
    3 s: the engines stamp their samples (see stamped), and Prometheus writes no staleness markers for stamped
    series, so an engine that stopped answering would otherwise hold its last values for the default 5 min."""
    d = tmp_path_factory.mktemp("prom")
    sd = d / "sd"
    sd.mkdir()
    proc, url = start_prometheus(d, "global: {scrape_interval: 1s, scrape_timeout: 800ms}\n"
                                    "scrape_configs:\n"
                                    "  - job_name: vllm\n"
                                    f"    file_sd_configs: [{{files: ['{sd}/koi-*.json'], refresh_interval: 1s}}]\n",
                                 "--query.lookback-delta=3s")
    try:
        yield {"url": url, "sd": sd}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def wait_for(cond: Any, timeout: float, what: str) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if cond():
            return
        time.sleep(0.2)
    pytest.fail(f"timed out waiting for {what}")


def wait_up(prom: dict[str, Any], cluster: str, n: int) -> float:
    """Wait until Prometheus scraped all ``n`` engines of ``cluster`` (file SD is throttled to 5 s); the first grid
    point from which every engine has a sample before it."""
    def up() -> bool:
        ts = httpx.get(f"{prom['url']}/api/v1/targets", timeout=2).json()["data"]["activeTargets"]
        return sum(t["labels"].get("koi_cluster") == cluster and t["health"] == "up" for t in ts) == n

    wait_for(up, 30, f"{n} engines of {cluster} up")
    return STEP * math.ceil(time.time() / STEP) + STEP


def test_windows_from_prometheus_match_what_the_engines_served(prom):
    """Koi writes the file-SD file; Prometheus scrapes three loopback engines (rank r1: two, rank r2: one) with no
    Koi process scraping anything; S1's windows, read back afterwards, carry the engines' exact rates and p99s."""
    t0 = STEP * math.floor(time.time() / STEP)
    servers = [MetricsServer() for _ in range(3)]
    try:
        for srv, kw in zip(servers, [dict(gen_rate=40, req_rate=10, running=6, kv=0.4),
                                     dict(gen_rate=60, req_rate=10, running=4, kv=0.6),
                                     dict(gen_rate=30, req_rate=5, running=2, kv=0.2)], strict=True):
            srv.pages["/metrics"] = engine_page(t0, **kw)
        targets = [ScrapeTarget("job-a", "r1", "aws/us-east-1/L4", (servers[0].url("/metrics"), servers[1].url("/metrics"))),
                   ScrapeTarget("job-b", "r2", "gcp/us-central1/L4", (servers[2].url("/metrics"),))]
        write_file_sd(prom["sd"], "c-prom", targets)
        tel = PrometheusTelemetry(prom["url"], step_s=STEP, window_s=4.0)
        t_start = wait_up(prom, "c-prom", 3)
        t_end = t_start + 6
        wait_for(lambda: time.time() > t_end + 2.5, 40, "the engines' samples up to t_end")

        ws = {w.rank_id: w for w in tel.telemetry(t_start, t_end, cluster_id="c-prom", tick=3)}
        assert sorted(ws) == ["r1", "r2"], tel.problems
        r1, r2 = ws["r1"], ws["r2"]
        assert (r1.job_id, r1.env_id, r1.tick, r1.cluster_id) == ("job-a", "aws/us-east-1/L4", 3, "c-prom")
        assert r1.times == [t_start + 2, t_start + 4, t_start + 6]
        # rates are rank totals over each step; gauges per-engine means (infra.vllm_metrics' rules)
        assert r1.series["throughput_tokens_per_sec"] == pytest.approx([100.0] * 3)
        assert r2.series["throughput_tokens_per_sec"] == pytest.approx([30.0] * 3)
        assert r1.series["live_batch_size"] == pytest.approx([5.0] * 3)
        assert r1.series["kv_cache_util"] == pytest.approx([0.5] * 3)
        # p99 TTFT: rank 0.99 of the window's requests falls in (0.1, 0.5] at 0.95 of the bin: 0.1 + 0.4·0.95 s
        assert r1.series["p99_ttft_ms"] == pytest.approx([480.0] * 3)
        assert r2.series["p99_ttft_ms"] == pytest.approx([480.0] * 3)
        assert r1.series["input_length_observed"] == pytest.approx([500.0] * 3)
        assert r1.series["output_length_observed"] == pytest.approx([200.0] * 3)
        # another cluster's labels select nothing
        assert tel.telemetry(t_start, t_end, cluster_id="c-other", tick=3) == []
    finally:
        for s in servers:
            s.close()


def test_an_engine_that_stops_answering_leaves_its_rank_to_the_others(prom):
    """One of r1's two engines fails from some point: Prometheus marks its series stale, and r1's windows after
    that are the survivor's alone (rates drop to its own, the gauges are its own)."""
    t0 = STEP * math.floor(time.time() / STEP)
    servers = [MetricsServer() for _ in range(2)]
    try:
        servers[0].pages["/metrics"] = engine_page(t0, gen_rate=40, req_rate=10, running=6, kv=0.4)
        servers[1].pages["/metrics"] = engine_page(t0, gen_rate=60, req_rate=10, running=4, kv=0.6)
        write_file_sd(prom["sd"], "c-fail", [ScrapeTarget("job-a", "r1", "e", tuple(s.url("/metrics") for s in servers))])
        tel = PrometheusTelemetry(prom["url"], step_s=STEP, window_s=4.0)
        t_start = wait_up(prom, "c-fail", 2)
        wait_for(lambda: time.time() > t_start + 4.5, 30, "samples of both engines")
        servers[1].pages["/metrics"] = 500
        t_fail = time.time()
        t_end = t0 + STEP * math.ceil((t_fail + 6 - t0) / STEP)
        wait_for(lambda: time.time() > t_end + 2.5, 40, "samples after the failure")
        (w,) = tel.telemetry(t_start, t_end, cluster_id="c-fail", tick=1)
        before = [i for i, t in enumerate(w.times) if t < t_fail - 1]
        after = [i for i, t in enumerate(w.times) if t > t_fail + 5]  # the 3-s lookback and a step past the failure
        assert before and after, w.times
        thr, batch = w.series["throughput_tokens_per_sec"], w.series["live_batch_size"]
        assert [thr[i] for i in before] == pytest.approx([100.0] * len(before)), (w.times, thr)
        assert [thr[i] for i in after] == pytest.approx([40.0] * len(after)), (w.times, thr)
        assert [batch[i] for i in before] == pytest.approx([5.0] * len(before))
        assert [batch[i] for i in after] == pytest.approx([6.0] * len(after))
    finally:
        for s in servers:
            s.close()


# ---- the file-SD file and the query -------------------------------------------------------------------------
def test_file_sd_entries_carry_the_rank_labels_and_paths(tmp_path):
    tg = ScrapeTarget("job-a", "r1", "aws/us-east-1/L4", ("http://10.0.0.5:8000/metrics", "http://10.0.0.6:8000/metrics"))
    empty = ScrapeTarget("job-b", "r9", "e", ())
    (entry,) = file_sd_entries([tg, empty], "c1")
    assert entry == {"targets": ["10.0.0.5:8000", "10.0.0.6:8000"],
                     "labels": {"koi_cluster": "c1", "koi_job": "job-a", "koi_rank": "r1",
                                "koi_env": "aws/us-east-1/L4", "__metrics_path__": "/metrics", "__scheme__": "http"}}
    path = write_file_sd(tmp_path / "sd", "c1", [tg])
    assert path.name == "koi-c1.json" and json.loads(path.read_text()) == [entry]
    assert [p.name for p in (tmp_path / "sd").iterdir()] == ["koi-c1.json"]  # no temporary file left behind


def test_the_selector_names_every_series_and_escapes_the_cluster():
    sel = selector('we"ird\\c')
    assert 'koi_cluster="we\\"ird\\\\c"' in sel
    assert all(n in sel for n in series_names())
    assert "vllm:time_to_first_token_seconds_bucket" in series_names()


def test_the_grid_ends_at_t_end_and_reaches_a_window_before_t_start():
    tel = PrometheusTelemetry("http://127.0.0.1:1", step_s=15.0, window_s=120.0)
    start, n = tel.grid(1_000.0, 1_300.0)
    assert start + n * 15.0 == 1_300.0 and start <= 1_000.0 - 120.0 - 15.0 < start + 15.0


# ---- failure paths, against a fake of the HTTP API --------------------------------------------------------
class FakePrometheus:
    """``/api/v1/query_range`` answers ``reply`` (status, JSON body); every request's parameters are kept."""

    def __init__(self) -> None:
        self.reply: tuple[int, Any] = (200, {"status": "success", "data": {"resultType": "matrix", "result": []}})
        self.requests: list[dict[str, str]] = []
        fake = self

        class Handler(JsonHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                from urllib.parse import parse_qsl, urlsplit

                u = urlsplit(self.path)
                fake.requests.append(dict(parse_qsl(u.query)))
                status, body = fake.reply
                if isinstance(body, str):
                    data = body.encode()
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                else:
                    self._send(status, body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake() -> Iterator[FakePrometheus]:
    f = FakePrometheus()
    yield f
    f.close()


def series(name: str, values: list[tuple[float, float]], **labels: str) -> dict[str, Any]:
    base = {"koi_cluster": "c1", "koi_job": "job-a", "koi_rank": "r1", "koi_env": "e", "instance": "h:1", "job": "vllm"}
    return {"metric": {"__name__": name, **base, **labels}, "values": [[t, repr(v)] for t, v in values]}


def test_unavailable_prometheus_raises_so_the_activity_retries(fake):
    tel = PrometheusTelemetry(closed_port_url().removesuffix("/metrics"), timeout_s=1.0)
    with pytest.raises(PrometheusUnavailable, match="ConnectError"):
        tel.telemetry(0.0, 300.0, cluster_id="c1", tick=1)
    fake.reply = (503, {"status": "error", "error": "overloaded"})
    with pytest.raises(PrometheusUnavailable, match="HTTP 503"):
        PrometheusTelemetry(fake.url).telemetry(0.0, 300.0, cluster_id="c1", tick=1)


@pytest.mark.parametrize("reply", [
    (400, {"status": "error", "errorType": "bad_data", "error": "parse error"}),
    (200, "<html>a proxy's page</html>"),
    (200, {"status": "success", "data": {"resultType": "vector", "result": []}}),
])
def test_a_bad_answer_is_noted_and_gives_no_windows(fake, reply):
    fake.reply = reply
    tel = PrometheusTelemetry(fake.url)
    assert tel.telemetry(0.0, 300.0, cluster_id="c1", tick=1) == []
    assert [p.reason for p in tel.problems] == ["bad_response"]


def test_series_without_rank_labels_or_with_bad_values_are_left_out(fake):
    """A series lacking ``koi_rank`` and one with a non-numeric value are noted; the rank beside them gets its
    windows; the request asks for the cluster's series on the grid."""
    good = [(100.0 + 15 * i, 300.0 * i) for i in range(4)]
    gauge = [(100.0 + 15 * i, 3.0) for i in range(4)]
    fake.reply = (200, {"status": "success", "data": {"resultType": "matrix", "result": [
        series("vllm:generation_tokens_total", good),
        series("vllm:num_requests_running", gauge),
        {"metric": {"__name__": "vllm:generation_tokens_total", "koi_cluster": "c1", "koi_job": "j"}, "values": []},
        {"metric": {**series("vllm:num_requests_running", [])["metric"], "koi_rank": "r2"}, "values": [[100, "x"]]},
    ]}})
    tel = PrometheusTelemetry(fake.url, step_s=15.0, window_s=0.0)
    (w,) = tel.telemetry(115.0, 145.0, cluster_id="c1", tick=2)
    assert (w.rank_id, w.times) == ("r1", [130.0, 145.0])
    assert w.series["throughput_tokens_per_sec"] == pytest.approx([20.0, 20.0])
    assert w.series["live_batch_size"] == [3.0, 3.0]
    assert sorted(p.reason for p in tel.problems) == ["bad_series", "bad_series"]
    (req,) = fake.requests
    assert req["query"] == selector("c1") and float(req["end"]) == 145.0 and req["step"] == "15"
    assert float(req["start"]) == 145.0 - 3 * 15.0


def test_the_shipped_prometheus_config_is_valid():
    """infra/prometheus.example.yml passes Prometheus' own checker, and its relabelling yields the rank labels."""
    promtool = str(Path(prometheus_bin()).with_name("promtool"))
    example = ROOT / "infra/prometheus.example.yml"
    done = subprocess.run([promtool, "check", "config", str(example)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    text = example.read_text()
    assert all(f"target_label: {label}" in text for label in ("koi_cluster", "koi_job", "koi_rank", "koi_env"))


def test_prometheus_ec2_discovery_labels_the_engines_from_koi_tags(tmp_path, ec2_factory, moto_endpoint):
    """The shipped config's EC2 job, pointed at moto: Prometheus discovers the instances Koi launched and its
    relabelling gives every replica's target the rank labels S1 selects on."""
    import yaml

    from infra.aws import Ec2Fleet
    from koi.domain import ChainConfig, Environment, Pool, Rank, ResourceMap
    from tests.fakes.jobs import chat_job

    env = Environment(cloud="aws", region="us-east-1", zone="us-east-1a", market="on_demand", gpu_type="L4")
    cluster = f"c-sd-{os.getpid()}-{int(time.time())}"
    fleet = Ec2Fleet(cluster, ResourceMap(pools=[Pool(env=env, instance_type="g6.xlarge", gpus_per_instance=1,
                                                      total_instances=4, free_instances=4, hourly_price=0.8)]),
                     client_factory=ec2_factory, image_id="ami-0123456789abcdef0")
    rank = Rank(env=env, config=ChainConfig(instance_type="g6.xlarge"), n_replicas=2)
    assert fleet.launch(chat_job(0), rank, "k-sd").replicas_launched == 2

    conf = yaml.safe_load((ROOT / "infra/prometheus.example.yml").read_text())
    (job,) = [j for j in conf["scrape_configs"] if j["job_name"] == "koi-vllm-ec2"]
    job["ec2_sd_configs"][0].update(endpoint=moto_endpoint, access_key="testing", secret_key="testing",
                                    refresh_interval="1s")
    job["ec2_sd_configs"][0]["filters"].append({"name": "tag:koi:cluster", "values": [cluster]})
    proc, url = start_prometheus(tmp_path, yaml.safe_dump({"global": {"scrape_interval": "1s"},
                                                           "scrape_configs": [job]}))
    try:
        def targets() -> list[dict[str, Any]]:
            return httpx.get(f"{url}/api/v1/targets", timeout=2).json()["data"]["activeTargets"]

        wait_for(lambda: len(targets()) == 2, 30, "two EC2 targets")
        labels = [{k: t["labels"][k] for k in ("koi_cluster", "koi_job", "koi_rank", "koi_env")} for t in targets()]
        assert labels == [{"koi_cluster": cluster, "koi_job": "job-0", "koi_rank": rank.rank_id("job-0"),
                           "koi_env": env.env_id}] * 2
        assert {t["labels"]["instance"] for t in targets()} == {f"{h}:8000" for _, _, _, hs in fleet.engine_hosts()
                                                               for h in hs}
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_prometheus_and_the_workers_own_scrapes_give_the_same_windows(tmp_path):
    """The same engine pages at the same instants, once scraped by the worker's observer and once stored in a real
    Prometheus (backfilled with ``promtool tsdb create-blocks-from openmetrics``: exact timestamps, no scrape
    jitter): S1's windows agree to the float, counter reset and all."""
    from infra.vllm_metrics import VllmMetricsObserver, parse_exposition

    dt, n = 15.0, 14
    t_first = dt * (time.time() // dt) - 3600.0  # an hour ago: inside retention, before Prometheus' head block
    times = [t_first + dt * k for k in range(n)]
    engines = {("job-a", "r1"): ["e0", "e1"], ("job-b", "r2"): ["e2"]}

    def engine_page(e: int, k: int) -> str:
        k_eff = k if not (e == 1 and k >= 8) else k - 8  # e1 restarts at step 8: its counters start over
        m = 10 * k_eff * (e + 1)
        return page(running=3 + (k * 7 + e) % 5, waiting=k % 3, kv=round(0.3 + 0.05 * ((k + e) % 7), 3),
                    preempt=k_eff // 3, gen=250.0 * k_eff * (e + 2) + 3 * k_eff ** 2,
                    hits=40 * k_eff, queries=100 * k_eff, ttft=(m, 2 * m, 3 * m + k_eff ** 2, 3 * m + k_eff ** 2,
                                                                 3 * m + 2 * k_eff ** 2, 3 * m + 2 * k_eff ** 2),
                    tpot=(m, m + k_eff, 2 * m, 2 * m, 2 * m), prompt=(700.0 * m, m), out=(150.0 * m + k_eff, m))

    # the worker's observer scrapes loopback servers whose pages change at each instant
    servers = {e: MetricsServer() for es in engines.values() for e in es}
    clock = {"t": 0.0}
    try:
        targets = [ScrapeTarget(j, r, f"env-{r}", tuple(servers[e].url("/metrics") for e in es))
                   for (j, r), es in engines.items()]
        obs = VllmMetricsObserver(targets, clock=lambda: clock["t"], timeout_s=2.0)
        for k, t in enumerate(times):
            for e, srv in servers.items():
                srv.pages["/metrics"] = engine_page(int(e[1:]), k)
            clock["t"] = t
            obs.scrape()
    finally:
        for srv in servers.values():
            srv.close()

    # the same pages, with Koi's target labels, as OpenMetrics for Prometheus
    fam: dict[str, list[str]] = {}
    for (j, r), es in engines.items():
        for e in es:
            extra = f'instance="{e}:8000",job="vllm",koi_cluster="c-eq",koi_job="{j}",koi_rank="{r}",koi_env="env-{r}"'
            for k, t in enumerate(times):
                for s in parse_exposition(engine_page(int(e[1:]), k)).samples:
                    labels = "".join(f'{a}="{b}",' for a, b in s.labels)
                    fam.setdefault(s.name, []).append(f"{s.name}{{{labels}{extra}}} {s.value!r} {t:.3f}")
    om = "".join(f"# TYPE {name} unknown\n" + "\n".join(lines) + "\n" for name, lines in fam.items()) + "# EOF\n"
    (tmp_path / "in.om").write_text(om)
    promtool = str(Path(prometheus_bin()).with_name("promtool"))
    done = subprocess.run([promtool, "tsdb", "create-blocks-from", "openmetrics", str(tmp_path / "in.om"),
                           str(tmp_path / "data")], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    proc, url = start_prometheus(tmp_path, "global: {scrape_interval: 15s}\n")
    try:
        t_start, t_end = times[4], times[-1]  # a tick of 9 samples, the latency window reaching before it
        direct = obs.telemetry(t_start, t_end, cluster_id="c-eq", tick=5)
        tel = PrometheusTelemetry(url, step_s=dt)
        via = tel.telemetry(t_start, t_end, cluster_id="c-eq", tick=5)
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    assert [(w.job_id, w.rank_id, w.env_id) for w in via] == [(w.job_id, w.rank_id, w.env_id) for w in direct]
    assert len(direct) == 2 and all(len(w.times) == 9 for w in direct)
    for a, b in zip(direct, via, strict=True):
        assert b.times == a.times
        assert sorted(b.series) == sorted(a.series)
        for name in a.series:
            assert b.series[name] == pytest.approx(a.series[name], rel=1e-12), name
    assert "counter_reset" in {p.reason for p in tel.problems} and "counter_reset" in obs.problem_counts
