"""The tick pipeline against EC2 (moto's server on loopback): the fleet file, the provider, a worker restart,
the scrape targets and the scraper thread."""

from __future__ import annotations

import threading
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import closing, contextmanager

import pytest
from typer.testing import CliRunner

from infra.cloud import CloudWorldProvider, FleetError, FleetSpec, Scraper, load_fleet, scrape_targets
from koi.domain import Action, ActionType, ChainConfig, Environment, Ladder, Plan, Pool, Rank
from koi.pipeline import ProposeContext, Runtime, Verdict, run_tick, run_ticks
from koi.pipeline.messages import TickOutcome
from koi.store import init_db, list_deploys, make_engine, session_scope
from tests.fakes.jobs import chat_job

ENV = Environment(cloud="aws", region="us-east-1", zone="us-east-1a", market="on_demand", gpu_type="L4")
FLEET_YAML = """
pools:
  - env: {cloud: aws, region: us-east-1, zone: us-east-1a, market: on_demand, gpu_type: L4}
    instance_type: g6.xlarge
    gpus_per_instance: 1
    total_instances: 4
    free_instances: 4
    hourly_price: 0.8
image_id: ami-0123456789abcdef0
metrics_port: 8001
health_path: null  # moto's addresses route nowhere: ready = running here (the probe: tests/test_infra_health.py)
"""


class Clock:
    """The cluster clock of a test: the provider moves it where the wall clock would have moved."""

    def __init__(self) -> None:
        self.t = 1_000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, t: float) -> None:
        self.t = max(self.t, t)


job = chat_job  # tests/fakes/jobs.py


def place_pending(ctx: ProposeContext) -> Plan:
    rank = Rank(env=ENV, config=ChainConfig(instance_type="g6.xlarge"), n_replicas=2)
    return Plan(actions=[
        Action(job_id=js.job.job_id, type=ActionType.PLACE, ladder=Ladder(ranks=[rank]))
        if js.status.value == "pending" else Action(job_id=js.job.job_id, type=ActionType.KEEP)
        for js in ctx.snapshot.jobs
    ], proposer="place_pending")


@pytest.fixture
def spec(tmp_path) -> FleetSpec:
    f = tmp_path / "fleet.yaml"
    f.write_text(FLEET_YAML)
    return load_fleet(f)


def runtime(tmp_path, provider) -> Runtime:
    eng = make_engine(f"sqlite:///{tmp_path / 'koi.db'}")
    init_db(eng)
    return Runtime(engine=eng, world=provider, proposers={"p": place_pending}, default_proposer="p",
                   validator=lambda s, c, t, snap, plan: Verdict(valid=True, plan=plan),
                   s2=lambda s, c, t: {}, s3=lambda s, c, t: {}, interval_s=60.0)


@contextmanager
def launched(tmp_path, spec: FleetSpec, ec2_factory) -> Iterator[tuple[str, Clock, CloudWorldProvider, Runtime]]:
    """A fresh cluster on EC2 whose tick 0 launched job-0's rank (two replicas); the provider is closed after."""
    cluster, clock = f"c-{uuid.uuid4().hex[:8]}", Clock()
    provider = CloudWorldProvider(spec, client_factory=ec2_factory, clock=clock)
    try:
        rt = runtime(tmp_path, provider)
        run_ticks(rt, cluster, 0, jobs=[job(0)])
        assert run_tick(rt, cluster, 0).deploy.launched == 1
        yield cluster, clock, provider, rt
    finally:
        provider.close()


def koi_instances(factory, cluster: str) -> list[dict]:
    pages = factory("us-east-1").get_paginator("describe_instances").paginate(
        Filters=[{"Name": "tag:koi:cluster", "Values": [cluster]},
                 {"Name": "instance-state-name", "Values": ["pending", "running"]}])
    return [i for p in pages for r in p["Reservations"] for i in r["Instances"]]


def test_ticks_launch_on_ec2_and_a_restarted_worker_sees_the_same_fleet(tmp_path, spec, ec2_factory):
    cluster, clock = f"c-{uuid.uuid4().hex[:8]}", Clock()
    rt = runtime(tmp_path, CloudWorldProvider(spec, client_factory=ec2_factory, clock=clock, scrape=False))
    out = run_ticks(rt, cluster, 2, jobs=[job(0), job(1)])
    assert [r.outcome for r in out] == [TickOutcome.COMMITTED] * 2
    insts = koi_instances(ec2_factory, cluster)
    tags = [{t["Key"]: t["Value"] for t in i["Tags"]} for i in insts]
    assert Counter(t["koi:job"] for t in tags) == {"job-0": 2, "job-1": 2}  # 2 replicas × 1 instance each
    assert {i["InstanceType"] for i in insts} == {"g6.xlarge"}
    assert sorted(d.job_id for d in out[-1].deployments) == ["job-0", "job-1"]  # S0 read them back from EC2
    assert clock.t == 1_000.0 + 120.0  # the provider moved the test clock; a wall clock moves by itself

    # a worker restart: a new provider on the same store and the same account launches nothing again
    rt2 = runtime(tmp_path, CloudWorldProvider(spec, client_factory=ec2_factory, clock=clock, scrape=False))
    r = run_tick(rt2, cluster, 2)
    assert r.outcome is TickOutcome.COMMITTED and r.deploy.launched == 0
    assert len(koi_instances(ec2_factory, cluster)) == 4
    with session_scope(rt2.engine) as s:
        assert rt2.world.current_tick(s, cluster) == 2
        ops = [d.detail.get("op") for d in list_deploys(s, cluster)]
    assert ops.count("launch") == 2


def test_a_launch_ec2_refuses_rolls_the_whole_tick_back_on_ec2(tmp_path, spec, ec2_factory):
    """S5 is stubbed to pass a plan that over-commits the pool: the cloud refuses the second launch, the tick
    falls back to keep-all and S6's compensation terminates what the first launch started."""
    cluster = f"c-{uuid.uuid4().hex[:8]}"
    small = spec.model_copy(update={"pools": [spec.pools[0].model_copy(update={"total_instances": 3,
                                                                                "free_instances": 3})]})
    rt = runtime(tmp_path, CloudWorldProvider(small, client_factory=ec2_factory, clock=Clock(), scrape=False))
    (r,) = run_ticks(rt, cluster, 1, jobs=[job(0), job(1)])  # each job wants 2 of the pool's 3 instances
    assert r.outcome is TickOutcome.FALLBACK and r.failed_stage == "s6_deploy"
    assert "1 of 3 free" in r.reason and "g6.xlarge" in r.reason
    assert koi_instances(ec2_factory, cluster) == []  # nothing left running, nothing paid for


def test_scrape_targets_are_the_ready_replicas_head_nodes(tmp_path, spec, ec2_factory):
    cluster = f"c-{uuid.uuid4().hex[:8]}"
    provider = CloudWorldProvider(spec, client_factory=ec2_factory, clock=Clock(), scrape=False)
    world = provider.world(cluster)
    rank = Rank(env=ENV, config=ChainConfig(instance_type="g6.xlarge"), n_replicas=2)
    assert world.launch(job(0), rank, "k-0").status.value == "launched"
    (target,) = scrape_targets(world.fleet, spec)()
    assert target.job_id == "job-0" and target.rank_id == rank.rank_id("job-0") and target.env_id == ENV.env_id
    assert len(target.urls) == 2 and all(u.startswith("http://") and u.endswith(":8001/metrics") for u in target.urls)
    assert world.telemetry(0.0, 60.0, cluster_id=cluster, tick=1) == []  # no metrics observer: no windows


def test_the_scraper_keeps_scraping_when_a_scrape_raises():
    calls, done = [], threading.Event()

    class Flaky:
        def scrape(self) -> int:
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("engine endpoint table broken")
            if len(calls) >= 3:
                done.set()
            return 0

    s = Scraper(Flaky(), every_s=0.01)  # type: ignore[arg-type]
    s.start()
    assert done.wait(5), "the scraper stopped after a failing scrape"
    s.stop()
    n = len(calls)
    assert not s._thread.is_alive() and len(calls) == n


@pytest.mark.parametrize(("text", "needle"), [
    (None, "cannot read fleet file"),
    ("pools: [", "is not YAML"),
    ("- 1\n- 2\n", "expected a mapping"),
    ("pools: []\n", "pools"),
    (FLEET_YAML.replace("gpus_per_instance: 1", "gpus_per_instance: 0"), "pools.0.gpus_per_instance"),
    (FLEET_YAML + "metrics_port: 99999\n", "metrics_port"),
    (FLEET_YAML + "gateway: {kind: envoy, directory: /tmp/gw}\n", "gateway.kind"),
    (FLEET_YAML + "gateway: {kind: nginx}\n", "gateway.directory"),
    (FLEET_YAML + "health_via: prometheus\n", "health_via: prometheus needs prometheus_url"),
    (FLEET_YAML + "health_via: consul\n", "health_via"),
])
def test_a_bad_fleet_file_names_what_is_wrong(tmp_path, text, needle):
    f = tmp_path / "fleet.yaml"
    if text is not None:
        f.write_text(text)
    with pytest.raises(FleetError, match=needle.replace(".", r"\.").replace("[", r"\[")):
        load_fleet(f)


def test_koi_worker_refuses_the_aws_world_without_a_usable_fleet_file(tmp_path):
    from koi.cli import app

    runner = CliRunner()
    r = runner.invoke(app, ["worker", "--world", "aws"], env={"KOI_FLEET_FILE": ""})
    assert r.exit_code == 2 and "fleet file" in r.output
    bad = tmp_path / "fleet.yaml"
    bad.write_text("pools: []\n")
    r = runner.invoke(app, ["worker", "--world", "aws", "--fleet", str(bad)])
    assert r.exit_code == 2 and "pools" in r.output and "Traceback" not in r.output
    no_azure = tmp_path / "azure.yaml"
    no_azure.write_text(FLEET_YAML)
    r = runner.invoke(app, ["worker", "--world", "azure", "--fleet", str(no_azure)])
    assert r.exit_code == 2 and "'azure' section" in r.output and "Traceback" not in r.output


def test_the_pools_of_the_fleet_start_free():
    pool = Pool(env=ENV, instance_type="g6.xlarge", gpus_per_instance=1, total_instances=4, free_instances=0,
                hourly_price=0.8)
    assert FleetSpec(pools=[pool]).resources.pools[0].free_instances == 4  # EC2 says what is used, not the file


def test_the_shipped_example_fleet_file_loads():
    from pathlib import Path

    import infra

    spec = load_fleet(Path(infra.__file__).parent / "fleet.example.yaml")
    assert [p.env.market.value for p in spec.pools] == ["on_demand", "spot"] and spec.run_args["SubnetId"]


def test_s1_stores_the_windows_scraped_from_the_engines_of_ranks_launched_on_ec2(tmp_path, spec, ec2_factory,
                                                                               monkeypatch):
    """EC2 (moto) says which ranks are ready; their engines' /metrics (a loopback server: moto's private
    addresses route nowhere, so only the address is swapped for 127.0.0.1) are scraped; S1 stores the windows."""
    from infra.aws import Ec2Fleet
    from koi.pipeline import stages
    from koi.pipeline.messages import AdvanceInput
    from koi.store import get_telemetry
    from tests.test_infra_vllm_metrics import MetricsServer, page

    server = MetricsServer()
    try:
        real = Ec2Fleet.engine_hosts
        monkeypatch.setattr(Ec2Fleet, "engine_hosts",
                            lambda self: [(j, r, e, tuple("127.0.0.1" for _ in h)) for j, r, e, h in real(self)])
        port = server.httpd.server_address[1]
        live = spec.model_copy(update={"metrics_port": port, "targets_ttl_s": 0.0, "scrape_every_s": 3600.0})
        cluster, clock = f"c-{uuid.uuid4().hex[:8]}", Clock()
        provider = CloudWorldProvider(live, client_factory=ec2_factory, clock=clock)
        rt = runtime(tmp_path, provider)
        run_ticks(rt, cluster, 0, jobs=[job(0)])
        assert run_tick(rt, cluster, 0).deploy.launched == 1
        obs = provider.scrapers[cluster].observer
        for i, (gen, ttft) in enumerate([(0, (0,) * 6), (300, (10, 10, 10, 10, 10, 10)),
                                         (900, (10, 10, 30, 30, 30, 30))], start=1):
            clock.t = 1_000.0 + 20.0 * i  # scrapes at 1020, 1040, 1060
            server.pages["/metrics"] = page(running=6, kv=0.4, gen=gen, ttft=ttft)
            obs.scrape()
        stages.advance_world(rt, AdvanceInput(cluster_id=cluster, tick=1, t_target=1_060.0))
        r1 = run_tick(rt, cluster, 1)
        assert r1.outcome is TickOutcome.COMMITTED and r1.observe.n_windows == 1
        with session_scope(rt.engine) as s:
            (w,) = get_telemetry(s, cluster, 1)
        assert w.job_id == "job-0" and w.times == [1_040.0, 1_060.0]
        # both replicas point at the one loopback URL, which is one engine (a URL is scraped once per scrape)
        assert w.series["throughput_tokens_per_sec"] == pytest.approx([300 / 20, 600 / 20])
        assert w.series["live_batch_size"] == [6, 6] and w.series["kv_cache_util"] == [0.4, 0.4]
        # p99 TTFT over the simulator's trailing 120 s: at 1060 both pairs, 10 TTFTs ≤ 0.05 s and 20 in (0.1, 0.5]
        assert w.series["p99_ttft_ms"][1] == pytest.approx(1e3 * (0.1 + 0.4 * 19.7 / 20))
    finally:
        if "provider" in locals():
            provider.close()
        server.close()


CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_SESSION_TOKEN": "testing"}


def fleet_with_a_rank(tmp_path, text: str, ec2_factory, n: int) -> tuple:
    """A fleet file with ``text``, a fresh cluster, and one rank of ``n`` replicas launched on EC2 for job-0."""
    from infra.aws import Ec2Fleet

    f = tmp_path / "fleet.yaml"
    f.write_text(text)
    cluster = f"c-{uuid.uuid4().hex[:8]}"
    ec2 = Ec2Fleet(cluster, load_fleet(f).resources, client_factory=ec2_factory, image_id="ami-0123456789abcdef0")
    rank = Rank(env=ENV, config=ChainConfig(instance_type="g6.xlarge"), n_replicas=n)
    assert ec2.launch(job(0), rank, "k-show").status.value == "launched"
    return f, cluster, rank


def test_koi_fleet_show_reads_pools_and_ranks_from_ec2(tmp_path, moto_endpoint, ec2_factory):
    import json

    from infra.aws import Ec2Fleet
    from koi.cli import app

    f, cluster, rank = fleet_with_a_rank(tmp_path, FLEET_YAML + f"endpoint_url: {moto_endpoint}\n", ec2_factory, 3)
    r = CliRunner().invoke(app, ["fleet", "show", "--fleet", str(f), "--cluster", cluster, "--json"], env=CREDS)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["pools"] == [{"pool": ENV.env_id + "/g6.xlarge", "instance_type": "g6.xlarge", "market": "on_demand",
                             "budget": 4, "used": 3, "free": 1, "usd_per_hour": 2.4}]
    assert doc["usd_per_hour"] == 2.4  # three instances at $0.80
    [rk] = doc["ranks"]
    assert (rk["job"], rk["rank"], rk["replicas"], rk["state"]) == ("job-0", rank.rank_id("job-0"), 3, "serving")
    assert rk["routed"] == "100%" and [b["weight"] for b in doc["routes"]["job-0"]] == [4, 4, 4]
    assert doc["telemetry"] == {"source": "worker scrape", "every_s": 15.0}
    ec2 = Ec2Fleet(cluster, load_fleet(f).resources, client_factory=ec2_factory, image_id="ami-0123456789abcdef0")
    assert ec2.teardown("job-0", rank.rank_id("job-0"), "k-td", drain_s=30.0, handover=True)  # no replacement yet
    r = CliRunner().invoke(app, ["fleet", "show", "--fleet", str(f), "--cluster", cluster, "--json"], env=CREDS)
    [rk] = json.loads(r.stdout)["ranks"]
    assert (rk["state"], rk["routed"]) == ("draining", "100%")  # handing over: still routed
    r = CliRunner().invoke(app, ["fleet", "show", "--fleet", str(tmp_path / "nope.yaml")])
    assert r.exit_code == 2 and "cannot read fleet file" in r.output


def test_koi_fleet_show_probe_counts_a_replica_ready_once_its_engine_answers(tmp_path, moto_endpoint, ec2_factory,
                                                                            monkeypatch):
    """--probe asks each head's /health (infra/health.py): of two running replicas one engine answers."""
    import json

    from infra.aws import Ec2Fleet
    from koi.cli import app
    from tests.fakes.http import TextHandler, serve, stop
    from tests.test_infra_gateway import free_port

    class Up(TextHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_text("", 200 if self.path == "/health" else 404)

    port = free_port()
    engine = serve(Up, "127.0.5.1", port)
    monkeypatch.setattr(Ec2Fleet, "_hosts", staticmethod(lambda r: ("127.0.5.1", "127.0.5.2")[: len(r.ready())]))
    try:
        text = FLEET_YAML.replace("health_path: null", "health_path: /health").replace("metrics_port: 8001",
                                                                                      f"metrics_port: {port}")
        f, cluster, rank = fleet_with_a_rank(tmp_path, text + f"endpoint_url: {moto_endpoint}\n", ec2_factory, 2)
        args = ["fleet", "show", "--fleet", str(f), "--cluster", cluster, "--json"]
        [rk] = json.loads(CliRunner().invoke(app, args, env=CREDS).stdout)["ranks"]
        assert (rk["replicas_ready"], rk["state"]) == (2, "serving")  # instances running: ready by the cloud's word
        r = CliRunner().invoke(app, [*args, "--probe"], env=CREDS)
        assert r.exit_code == 0, r.output
        doc = json.loads(r.stdout)
        [rk] = doc["ranks"]
        assert (rk["replicas_ready"], rk["state"], rk["routed"]) == (1, "launching", "100%")
        assert [b["address"] for b in doc["routes"]["job-0"]] == [f"127.0.5.1:{port}"]
    finally:
        stop(engine)


def test_with_health_via_prometheus_the_worker_counts_what_prometheus_scraped(tmp_path, moto_endpoint, ec2_factory):
    """A worker that does not reach the engines (health_via: prometheus): of a rank's two running replicas, the one
    whose engine Prometheus scraped (up == 1 for its head's address) is ready, the other still launching."""
    from tests.test_infra_prometheus import FakePrometheus

    fake = FakePrometheus()
    try:
        text = FLEET_YAML.replace("health_path: null", "health_path: /health") + (
            f"endpoint_url: {moto_endpoint}\nprometheus_url: {fake.url}\nhealth_via: prometheus\n")
        f, cluster, rank = fleet_with_a_rank(tmp_path, text, ec2_factory, 2)
        heads = sorted(i["PrivateIpAddress"] for i in koi_instances(ec2_factory, cluster))
        fake.reply = (200, {"status": "success", "data": {"resultType": "vector", "result": [
            {"metric": {"__name__": "up", "koi_cluster": cluster, "instance": f"{heads[0]}:8001"}, "value": [1, "1"]}]}})
        provider = CloudWorldProvider(load_fleet(f), client_factory=ec2_factory, scrape=False)
        try:
            [dep] = provider.world(cluster).deployments()
            assert (dep.replicas_ready, dep.state.value) == (1, "launching")
            assert [hosts for _, _, hosts in provider.world(cluster).fleet.routes()] == [(heads[0],)]
            assert any(r.get("query") == f'up{{koi_cluster="{cluster}"}} == 1' for r in fake.requests)
        finally:
            provider.close()
    finally:
        fake.close()


def test_koi_fleet_show_says_how_many_engines_prometheus_scrapes(tmp_path, moto_endpoint, ec2_factory):
    """With prometheus_url: each rank's engines up in Prometheus, ranks Prometheus still scrapes that Koi no longer
    runs, and an unreachable Prometheus reported (exit 0: the cloud part stands)."""
    import json

    from koi.cli import app
    from tests.test_infra_prometheus import FakePrometheus
    from tests.test_infra_vllm_metrics import closed_port_url

    fake = FakePrometheus()
    try:
        f, cluster, rank = fleet_with_a_rank(
            tmp_path, FLEET_YAML + f"endpoint_url: {moto_endpoint}\nprometheus_url: {fake.url}\n", ec2_factory, 2)
        rid = rank.rank_id("job-0")
        up = [({"koi_job": "job-0", "koi_rank": rid, "instance": f"h{i}:8000"}, v) for i, v in enumerate(["1", "0"])]
        up.append(({"koi_job": "job-9", "koi_rank": "gone", "instance": "h9:8000"}, "0"))
        fake.reply = (200, {"status": "success", "data": {"resultType": "vector", "result": [
            {"metric": {"__name__": "up", "koi_cluster": cluster, **m}, "value": [1.0, v]} for m, v in up]}})
        args = ["fleet", "show", "--fleet", str(f), "--cluster", cluster, "--json"]
        r = CliRunner().invoke(app, args, env=CREDS)
        assert r.exit_code == 0, r.output
        doc = json.loads(r.stdout)
        assert [rk["engines_up"] for rk in doc["ranks"]] == ["1/2"]
        assert doc["telemetry"] == {"source": "prometheus", "url": fake.url, "ranks_scraped": 2,
                                    "stale_ranks": ["job-9/gone"]}
        assert fake.requests[-1]["query"] == f'up{{koi_cluster="{cluster}"}}'
        r = CliRunner().invoke(app, args[:-1], env=CREDS)
        assert r.exit_code == 0 and f"telemetry: prometheus at {fake.url}" in r.output and "1/2" in r.output, r.output
        f.write_text(FLEET_YAML + f"endpoint_url: {moto_endpoint}\nprometheus_url: "
                     f"{closed_port_url().removesuffix('/metrics')}\nprometheus_timeout_s: 1\n")
        r = CliRunner().invoke(app, args, env=CREDS)
        assert r.exit_code == 0, r.output
        tel = json.loads(r.stdout)["telemetry"]
        assert tel["source"] == "prometheus" and "PrometheusUnavailable" in tel["error"]
    finally:
        fake.close()


def test_koi_fleet_gateway_keeps_nginx_in_step_with_ec2_without_a_worker(tmp_path, moto_endpoint, ec2_factory):
    """The gateway agent on nginx's host: the routes from EC2's tags, nginx's files written and reloaded locally;
    an unchanged fleet reloads nothing; a reload nginx refuses exits 1 with --once; no gateway: section exits 2."""
    import json

    from koi.cli import app

    conf, reloads = tmp_path / "conf.d", tmp_path / "reloads"
    gw = (f"gateway: {{kind: nginx, directory: {conf}, reload_command: [sh, -c, 'echo r >> {reloads}']}}\n")
    f, cluster, rank = fleet_with_a_rank(tmp_path, FLEET_YAML + f"endpoint_url: {moto_endpoint}\n" + gw, ec2_factory, 2)
    args = ["fleet", "gateway", "--fleet", str(f), "--cluster", cluster, "--once"]
    r = CliRunner().invoke(app, args, env=CREDS)
    assert r.exit_code == 0, r.output
    table = json.loads((conf / f"routes-{cluster}.json").read_text())
    assert [b["rank_id"] for b in table["jobs"]["job-0"]] == [rank.rank_id("job-0")] * 2
    ups = (conf / f"koi-{cluster}-upstreams.conf").read_text()
    assert ups.count("server ") == 2 and reloads.read_text() == "r\n"
    r = CliRunner().invoke(app, args, env=CREDS)  # nothing changed: nothing written, no reload
    assert r.exit_code == 0 and reloads.read_text() == "r\n"
    f.write_text(f.read_text().replace(f"echo r >> {reloads}", "echo bad config >&2; exit 1"))
    ec2 = ec2_factory("us-east-1")
    ids = [i["InstanceId"] for x in ec2.describe_instances()["Reservations"] for i in x["Instances"]
           if {"Key": "koi:cluster", "Value": cluster} in i.get("Tags", [])]
    ec2.terminate_instances(InstanceIds=ids[:1])  # a replica lost: the files change, the reload fails
    r = CliRunner().invoke(app, args, env=CREDS)
    assert r.exit_code == 1
    assert (conf / f"koi-{cluster}-upstreams.conf").read_text().count("server ") == 1
    f.write_text(FLEET_YAML + f"endpoint_url: {moto_endpoint}\n")
    r = CliRunner().invoke(app, args, env=CREDS)
    assert r.exit_code == 2 and "no gateway: section" in r.output


def test_a_real_fleet_cluster_starts_live_and_refuses_simulated_mode():
    from koi.cli import app
    from koi.config import get_settings

    get_settings.cache_clear()
    try:
        r = CliRunner().invoke(app, ["cluster", "start", "--mode", "simulated"], env={"KOI_WORLD": "aws"})
        assert r.exit_code == 2 and "--mode live" in r.output  # refused before any Temporal call
    finally:
        get_settings.cache_clear()


def test_ticks_launch_on_compute_engine_through_the_same_provider(tmp_path):
    """The gcp world: the same pipeline and provider, Compute Engine's REST API (a loopback fake of it)."""
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import compute_v1

    from tests.fakes.gce_server import FakeGceServer

    gce_env = Environment(cloud="gcp", region="us-central1", zone="us-central1-a", market="spot", gpu_type="L4")
    spec = FleetSpec(pools=[Pool(env=gce_env, instance_type="g2-standard-4", gpus_per_instance=1, total_instances=4,
                                 free_instances=4, hourly_price=0.28)], project="koi-test")
    with FakeGceServer(zones=("us-central1-a",)) as server:
        client = compute_v1.InstancesClient(transport="rest", client_options=ClientOptions(api_endpoint=server.url),
                                            credentials=AnonymousCredentials())
        rank = Rank(env=gce_env, config=ChainConfig(instance_type="g2-standard-4"), n_replicas=2)

        def place(ctx: ProposeContext) -> Plan:
            return Plan(actions=[Action(job_id=js.job.job_id, type=ActionType.PLACE, ladder=Ladder(ranks=[rank]))
                                 if js.status.value == "pending" else Action(job_id=js.job.job_id, type=ActionType.KEEP)
                                 for js in ctx.snapshot.jobs], proposer="place")

        eng = make_engine(f"sqlite:///{tmp_path / 'koi.db'}")
        init_db(eng)
        rt = Runtime(engine=eng, world=CloudWorldProvider(spec, cloud="gcp", client=client, clock=Clock(), scrape=False),
                     proposers={"p": place}, default_proposer="p",
                     validator=lambda s, c, t, snap, plan: Verdict(valid=True, plan=plan),
                     s2=lambda s, c, t: {}, s3=lambda s, c, t: {}, interval_s=60.0)
        cluster = f"c-{uuid.uuid4().hex[:8]}"
        out = run_ticks(rt, cluster, 3, jobs=[job(0), job(1)])
        assert [r.outcome for r in out] == [TickOutcome.COMMITTED] * 3
        assert out[0].deploy.launched == 2 and out[1].deploy.launched == out[2].deploy.launched == 0
        assert sorted(d.job_id for d in out[-1].deployments) == ["job-0", "job-1"]
        running = [i for i in server.all_instances() if i["status"] == "RUNNING"]
        assert len(running) == 4 and all(i["scheduling"]["provisioningModel"] == "SPOT" for i in running)
    with pytest.raises(FleetError, match="project"):
        CloudWorldProvider(spec.model_copy(update={"project": None}), cloud="gcp")


def test_with_prometheus_s1_reads_it_and_koi_publishes_the_targets(tmp_path, spec, ec2_factory):
    """``prometheus_url``: no scraper thread runs; S1 stores the windows Prometheus serves for the rank launched on
    EC2; Prometheus down fails S1 with a reason naming it (the tick falls back, nothing launched twice).
    ``prometheus_file_sd``: the ranks' engines are written for Prometheus' file discovery."""
    import json
    import time

    from koi.pipeline import stages
    from koi.pipeline.messages import AdvanceInput
    from koi.store import get_telemetry
    from tests.test_infra_prometheus import FakePrometheus, series

    fake = FakePrometheus()
    sd = tmp_path / "sd"
    live = spec.model_copy(update={"prometheus_url": fake.url, "prometheus_file_sd": str(sd), "targets_ttl_s": 0.0})
    with closing(fake), launched(tmp_path, live, ec2_factory) as (cluster, _, provider, rt):
        assert provider.scrapers == {}
        path = sd / f"koi-{cluster}.json"
        end = time.time() + 10
        while time.time() < end and not (path.exists() and json.loads(path.read_text())):
            time.sleep(0.1)
        (entry,) = json.loads(path.read_text())
        (inst,) = {i["InstanceId"]: i for i in koi_instances(ec2_factory, cluster)
                   if {"Key": "koi:replica", "Value": "0"} in i["Tags"]}.values()
        assert inst["PrivateIpAddress"] + ":8001" in entry["targets"] and len(entry["targets"]) == 2
        labels = entry["labels"]
        assert (labels["koi_cluster"], labels["koi_job"], labels["koi_env"]) == (cluster, "job-0", ENV.env_id)

        grid = [(1_000.0 + 15 * i, 600.0 * i) for i in range(5)]  # 40 tok/s on each of the two engines
        fake.reply = (200, {"status": "success", "data": {"resultType": "matrix", "result": [
            series("vllm:generation_tokens_total", grid, koi_cluster=cluster, koi_job="job-0",
                   koi_rank=labels["koi_rank"], koi_env=ENV.env_id, instance=host)
            for host in entry["targets"]]}})
        stages.advance_world(rt, AdvanceInput(cluster_id=cluster, tick=1, t_target=1_060.0))
        r1 = run_tick(rt, cluster, 1)
        assert r1.outcome is TickOutcome.COMMITTED and r1.observe.n_windows == 1
        with session_scope(rt.engine) as s:
            (w,) = get_telemetry(s, cluster, 1)
        assert (w.job_id, w.rank_id, w.times) == ("job-0", labels["koi_rank"], [1_015.0, 1_030.0, 1_045.0, 1_060.0])
        assert w.series["throughput_tokens_per_sec"] == pytest.approx([80.0] * 4)

        fake.reply = (503, {"status": "error", "error": "overloaded"})
        stages.advance_world(rt, AdvanceInput(cluster_id=cluster, tick=2, t_target=1_120.0))
        r2 = run_tick(rt, cluster, 2)
        assert r2.outcome is TickOutcome.FALLBACK and r2.failed_stage == "s1_observe"
        assert "PrometheusUnavailable" in r2.reason and "HTTP 503" in r2.reason
        assert len(koi_instances(ec2_factory, cluster)) == 2


def test_the_gateway_sync_follows_what_the_executor_does_at_once(tmp_path, spec, ec2_factory):
    """``gateway:``: after a tick launches on EC2 the routes file lists the job's ready replicas, and a teardown
    empties it — each within moments, although the periodic sync is an hour apart (the executor kicks it)."""
    import json
    import time

    from infra.gateway import GatewaySpec

    routes = tmp_path / "gw"
    live = spec.model_copy(update={"gateway": GatewaySpec(directory=str(routes), every_s=3600.0)})

    def jobs_soon(cluster: str, want: set[str]) -> dict:
        end, table = time.time() + 10, {}
        while time.time() < end:
            f = routes / f"routes-{cluster}.json"
            table = json.loads(f.read_text())["jobs"] if f.exists() else {}
            if set(table) == want:
                return table
            time.sleep(0.05)
        pytest.fail(f"routes {table}, want jobs {want}")

    with launched(tmp_path, live, ec2_factory) as (cluster, _, provider, _rt):
        table = jobs_soon(cluster, {"job-0"})
        heads = {f"{i['PrivateIpAddress']}:8001" for i in koi_instances(ec2_factory, cluster)}
        assert {b["address"] for b in table["job-0"]} == heads and len(heads) == 2
        (dep,) = provider.world(cluster).deployments()
        assert provider.world(cluster).teardown("job-0", dep.rank_id, "k-down")
        jobs_soon(cluster, set())


def test_the_worker_releases_a_drained_rank_by_itself(tmp_path, spec, ec2_factory):
    """The provider's reaper thread sweeps: a rank torn down with a 30-s drain keeps its instances until the
    cluster clock passes the drain, then EC2 terminates them, with no tick running."""
    import time

    live = spec.model_copy(update={"sweep_every_s": 0.05})
    with launched(tmp_path, live, ec2_factory) as (cluster, clock, provider, _rt):
        world = provider.world(cluster)
        (dep,) = world.deployments()
        assert world.teardown("job-0", dep.rank_id, "k-down", drain_s=30.0)
        time.sleep(0.3)
        assert len(koi_instances(ec2_factory, cluster)) == 2  # draining: still running
        clock.t += 30.0
        end = time.time() + 10
        while time.time() < end and koi_instances(ec2_factory, cluster):
            time.sleep(0.05)
        assert koi_instances(ec2_factory, cluster) == [] and world.deployments() == []


def test_a_failing_sweep_does_not_fail_the_ticks_executor_calls():
    """The sweep before a tick's first executor call is housekeeping: a cloud error there is logged and the call
    goes on (the worker's periodic sweep tries again)."""
    from infra.cloud import CloudWorld

    class Fleet:
        calls: list[str] = []

        def sweep(self) -> int:
            raise RuntimeError("RequestLimitExceeded")

        def reweight(self, job_id: str, rank_id: str, w: float, key: str) -> bool:
            self.calls.append(key)
            return True

    kicked = []
    world = CloudWorld(Fleet(), on_change=lambda: kicked.append(1))
    assert world.reweight("job-0", "r", 2.0, "k-1") and world.reweight("job-0", "r", 3.0, "k-2")
    assert Fleet.calls == ["k-1", "k-2"] and kicked == [1, 1]  # swept once (failed), each call kicks the gateway
