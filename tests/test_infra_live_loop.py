"""The real-fleet loop end to end, every piece a real server on loopback: ticks launch on EC2 (moto), Koi writes the
routes for nginx and the scrape targets for Prometheus, a client's requests go through nginx to the engines in the
planned split, Prometheus scrapes the engines, and the next tick's S1 reads back evidence of exactly that traffic;
then a swap hands the traffic to the new rank and the old one drains and is released.

moto's instances have private addresses that route nowhere, so each is mapped to an engine of its own on a loopback
address (127.0.1.x, one port for all, as a fleet's engines share one) — the only thing not as in production."""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from collections import Counter
from typing import Any

import httpx
import pytest

from infra.aws import Ec2Fleet
from infra.cloud import CloudWorldProvider, load_fleet
from infra.gateway import GatewaySpec
from koi.domain import Action, ActionType, ChainConfig, Ladder, Plan, Rank
from koi.pipeline import ProposeContext, run_tick, run_ticks
from koi.pipeline.messages import TickOutcome
from koi.store import get_telemetry, session_scope
from tests.fakes.http import TextHandler, serve, stop
from tests.fakes.jobs import chat_job
from tests.test_infra_cloud import ENV, FLEET_YAML, koi_instances, runtime
from tests.test_infra_gateway import free_port, nginx  # noqa: F401 - the nginx fixture
from tests.test_infra_prometheus import start_prometheus
from tests.test_infra_vllm_metrics import page

TOKENS = 50  # generated per request


class Engine:
    """A stand-in for one vLLM server: answers a completion with TOKENS tokens and serves /metrics counting what it
    answered (generated tokens, requests and their TTFT, 20 ms each)."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.requests, self.lock = host, 0, threading.Lock()
        eng = self

        class Handler(TextHandler):
            def do_POST(self) -> None:  # noqa: N802 - the stdlib's name
                self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with eng.lock:
                    eng.requests += 1
                self.send_text(json.dumps({"engine": eng.host, "usage": {"completion_tokens": TOKENS}}))

            def do_GET(self) -> None:  # noqa: N802
                with eng.lock:
                    n = eng.requests
                self.send_text(page(running=1, waiting=0, kv=0.3, gen=TOKENS * n, ttft=(n, n, n, n, n, n),
                                    tpot=(n, n, n, n, n), prompt=(100 * n, n), out=(TOKENS * n, n)))

        self.httpd = serve(Handler, host, port)

    def close(self) -> None:
        stop(self.httpd)


@pytest.fixture
def engines(monkeypatch) -> Any:
    """Each EC2 head node's private address → an engine on a loopback address of its own."""
    port, addrs, made = free_port(), (f"127.0.1.{i}" for i in itertools.count(2)), {}
    real = Ec2Fleet._head_addr

    def head_addr(r: Any, k: int) -> str | None:
        ip = real(r, k)
        if ip is not None and ip not in made:
            made[ip] = Engine(next(addrs), port)
        return None if ip is None else made[ip].host

    monkeypatch.setattr(Ec2Fleet, "_head_addr", staticmethod(head_addr))
    yield port, made
    for e in made.values():
        e.close()


def test_requests_through_the_gateway_come_back_as_the_next_ticks_evidence(tmp_path, ec2_factory, engines, nginx):  # noqa: F811
    port, made = engines
    d = tmp_path / "prom"
    d.mkdir()
    proc, prom_url = start_prometheus(
        d, "global: {scrape_interval: 1s, scrape_timeout: 800ms}\nscrape_configs:\n  - job_name: vllm\n"
           f"    file_sd_configs: [{{files: ['{d}/sd/koi-*.json'], refresh_interval: 1s}}]\n")
    f = tmp_path / "fleet.yaml"
    f.write_text(FLEET_YAML)
    spec = load_fleet(f).model_copy(update={
        "metrics_port": port, "health_path": "/health", "health_every_s": 0.5, "scrape_every_s": 1.0, "targets_ttl_s": 0.0, "sweep_every_s": 0.5,
        "prometheus_url": prom_url, "prometheus_file_sd": str(d / "sd"),
        "gateway": GatewaySpec(kind="nginx", directory=str(nginx["conf"]), reload_command=nginx["reload"])})
    cluster = f"c-{uuid.uuid4().hex[:8]}"
    provider = CloudWorldProvider(spec, client_factory=ec2_factory)  # the wall clock: Prometheus keeps real time
    try:
        rt = runtime(tmp_path, provider)
        run_ticks(rt, cluster, 0, jobs=[chat_job(0)])
        assert run_tick(rt, cluster, 0).deploy.launched == 1  # one rank, two replicas (tests/test_infra_cloud.py)

        # the gateway has the job's two replicas; Prometheus scrapes both engines
        job_url = f"{nginx['url']}/job-0/v1/completions"
        end = time.time() + 30
        while time.time() < end and httpx.post(job_url, json={}, timeout=5).status_code != 200:
            time.sleep(0.1)

        def up() -> int:
            ts = httpx.get(f"{prom_url}/api/v1/targets", timeout=2).json()["data"]["activeTargets"]
            return sum(t["labels"].get("koi_cluster") == cluster and t["health"] == "up" for t in ts)
        while time.time() < end and up() < 2:
            time.sleep(0.2)
        assert up() == 2 and len(made) == 2

        # a client sends 20 requests a second for 6 s through nginx
        before = {e.host: e.requests for e in made.values()}
        t_load, sent = time.time(), Counter()
        while time.time() < t_load + 6.0:
            r = httpx.post(job_url, json={"prompt": "hi"}, timeout=5)
            assert r.status_code == 200, r.text
            sent[r.json()["engine"]] += 1
            time.sleep(0.05)
        time.sleep(2.5)  # the last scrape of the load
        assert sent == Counter({h: e.requests - before[h] for h, e in ((e.host, e) for e in made.values())})
        a, b = sent.values()
        assert abs(a - b) <= 1, sent  # the rank's two replicas weigh the same: nginx alternates

        r1 = run_tick(rt, cluster, 1)
        assert r1.outcome is TickOutcome.COMMITTED and r1.observe.n_windows == 1, r1.reason
        with session_scope(rt.engine) as s:
            (w,) = get_telemetry(s, cluster, 1)
        assert w.job_id == "job-0" and len(w.times) >= 6
        thr = dict(zip(w.times, w.series["throughput_tokens_per_sec"], strict=True))
        during = [v for t, v in thr.items() if t_load + 1.5 < t < t_load + 5.5]
        rate = TOKENS * sum(sent.values()) / 6.0
        # per step one scrape of each engine, give or take one at a step's edge (then 0 and 2x in adjacent steps):
        # the mean over the load is the rate sent
        assert len(during) >= 3 and 0.75 * rate < sum(during) / len(during) < 1.25 * rate, (rate, thr)
        assert max(during) < 2.5 * rate, (rate, thr)
        # a rank's p99 TTFT from the engines' histograms: every request in the first bucket (≤ 50 ms)
        assert max(w.series["p99_ttft_ms"]) <= 50.0

        # tick 2 swaps the job to another chain (one replica): make before break, then a 4-s drain, then release
        old_hosts = set(sent)
        rt.drain_s = 4.0
        swap = Rank(env=ENV, config=ChainConfig(instance_type="g6.xlarge", max_num_seqs=128), n_replicas=1)

        def swap_job(ctx: ProposeContext) -> Plan:
            return Plan(actions=[Action(job_id="job-0", type=ActionType.SWAP, ladder=Ladder(ranks=[swap]))],
                        proposer="swap_job")

        r2 = run_tick(rt, cluster, 2, proposer=swap_job)
        assert r2.outcome is TickOutcome.COMMITTED and r2.deploy.launched == 1, r2.reason
        (new_ip,) = [i["PrivateIpAddress"] for i in koi_instances(ec2_factory, cluster)
                     if {"Key": "koi:rank", "Value": swap.rank_id("job-0")} in i["Tags"]]
        assert len(koi_instances(ec2_factory, cluster)) == 3  # the old rank still runs: it drains
        new_host = made[new_ip].host
        assert new_host not in old_hosts
        # the new rank serves at once on moto, so the old one drains at once: out of nginx's routes ...
        end, last = time.time() + 20, []
        while time.time() < end and last[-10:] != [new_host] * 10:
            last.append(httpx.post(job_url, json={}, timeout=5).json()["engine"])
        assert last[-10:] == [new_host] * 10, Counter(last)
        # ... and its instances terminated once the 4-s drain is over (the worker's sweep)
        while time.time() < end and len(koi_instances(ec2_factory, cluster)) > 1:
            time.sleep(0.1)
        assert [i["PrivateIpAddress"] for i in koi_instances(ec2_factory, cluster)] == [new_ip]
        assert [d.rank_id for d in provider.world(cluster).deployments()] == [swap.rank_id("job-0")]
    finally:
        provider.close()
        proc.terminate()
        proc.wait(timeout=10)
