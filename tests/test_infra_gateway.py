"""infra.gateway: the route table from a fleet, and a real nginx (Debian's, fetched by
scripts/ensure-debian-tools.sh) on loopback splitting a job's requests over its replicas by Koi's weights."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from infra.gateway import GatewaySpec, GatewaySync, nginx_conf, route_table, upstream_name
from koi.domain import ChainConfig, Deployment, DeploymentState, Environment, Rank
from koi.domain.routing import gateway_weights
from tests.fakes.http import TextHandler, serve, stop

ROOT = Path(__file__).resolve().parents[1]
ENV = Environment(cloud="aws", region="us-east-1", zone="us-east-1a", market="on_demand", gpu_type="L4")


def rank(weight: float | None, n: int = 1, tp: int = 1) -> Rank:
    return Rank(env=ENV, config=ChainConfig(instance_type="g6.xlarge", tp=tp), n_replicas=n, route_weight=weight)


@dataclass
class Fleet:
    """What GatewaySync reads of an executor: its ranks and each ready replica's head host."""

    ranks: dict[tuple[str, str], tuple[Rank, DeploymentState]] = field(default_factory=dict)
    hosts: dict[tuple[str, str], tuple[str, ...]] = field(default_factory=dict)

    def put(self, job: str, r: Rank, hosts: tuple[str, ...], state: DeploymentState = DeploymentState.SERVING) -> str:
        rid = r.rank_id(job)
        self.ranks[(job, rid)] = (r, state)
        self.hosts[(job, rid)] = hosts
        return rid

    def deployments(self) -> list[Deployment]:
        return [Deployment(job_id=j, rank=r, state=st, replicas_ready=len(self.hosts[(j, rid)]))
                for (j, rid), (r, st) in self.ranks.items()]

    def routes(self) -> list[tuple[str, Rank, tuple[str, ...]]]:
        """As the executors: ranks not draining (a handover is not modelled here), with a ready replica."""
        return [(j, r, self.hosts[(j, rid)]) for (j, rid), (r, st) in self.ranks.items()
                if st is not DeploymentState.DRAINING and self.hosts[(j, rid)]]


# ---- the table -------------------------------------------------------------------------------------------
def test_weights_follow_the_simulators_rule():
    assert gateway_weights([]) == []
    assert gateway_weights([3.0, 1.0, 1.0]) == [12, 4, 4]
    assert gateway_weights([1.0, 100.0]) == [4, 16]  # at most 4x the smallest's share
    with pytest.raises(ValueError, match="positive"):
        gateway_weights([0.0, 1.0])


def test_the_table_weights_ready_replicas_by_the_planners_weight_or_equally():
    f = Fleet()
    big = f.put("job-a", rank(3.0), ("10.0.0.1",))
    small = f.put("job-a", rank(1.0, n=2, tp=2), ("10.0.0.2", "10.0.0.3"))
    f.put("job-b", rank(2.0), ("10.0.1.1",))
    f.put("job-b", rank(None, tp=2), ("10.0.1.2",))  # one rank without a planned weight: all weigh the same
    f.put("job-c", rank(1.0), ())  # launching: no ready replica
    gone = f.put("job-d", rank(1.0), ("10.0.3.1",), DeploymentState.DRAINING)
    t = route_table("c1", f.routes(), 8000)
    assert sorted(t.jobs) == ["job-a", "job-b"]
    assert {(b.rank_id, b.address, b.weight) for b in t.jobs["job-a"]} == {
        (big, "10.0.0.1:8000", 12), (small, "10.0.0.2:8000", 4), (small, "10.0.0.3:8000", 4)}
    assert [b.weight for b in t.jobs["job-b"]] == [4, 4]
    assert gone not in {b.rank_id for bs in t.jobs.values() for b in bs}


def test_nginx_conf_has_an_upstream_per_job_and_503_for_a_job_without_replicas():
    f = Fleet()
    f.put("job-a", rank(1.0), ("10.0.0.1",))
    t = route_table("c1", f.routes(), 8000)
    ups, locs = nginx_conf(t, ["job-a", "job-z"])
    name = upstream_name("c1", "job-a")
    assert f"upstream {name} {{" in ups and "server 10.0.0.1:8000 weight=4;" in ups
    assert f"location /job-a/ {{\n    proxy_pass http://{name}/;" in locs
    assert "location /job-z/ {\n    add_header Retry-After 15 always;\n    return 503;" in locs
    assert upstream_name("c1", "job-a") != upstream_name("c2", "job-a")


# ---- a real nginx ------------------------------------------------------------------------------------------
def nginx_bin() -> str:
    local = ROOT / ".venv/opt/nginx/usr/sbin/nginx"
    found = os.environ.get("KOI_NGINX_BIN") or shutil.which("nginx") or (str(local) if local.exists() else None)
    if not found:
        pytest.fail("no nginx binary: run scripts/ensure-debian-tools.sh (make test does) or set KOI_NGINX_BIN")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Engine:
    """An engine on its own loopback address (127.0.0.x, one port for all, as a fleet's engines share one): answers
    every request with its name and the path it got."""

    def __init__(self, host: str, port: int, name: str) -> None:
        class Handler(TextHandler):
            def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
                self.send_text(json.dumps({"engine": name, "path": self.path}))

        self.httpd = serve(Handler, host, port)

    def close(self) -> None:
        stop(self.httpd)


@pytest.fixture
def nginx(tmp_path) -> Iterator[dict[str, Any]]:
    """nginx on loopback including the files Koi writes in ``conf``; ``reload``: the command Koi runs."""
    conf, tmp = tmp_path / "conf", tmp_path / "tmp"
    conf.mkdir()
    tmp.mkdir()
    port = free_port()
    temps = "".join(f"  {k}_temp_path {tmp}/{k};\n" for k in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    (tmp_path / "nginx.conf").write_text(
        f"worker_processes 1;\npid {tmp_path}/nginx.pid;\nerror_log {tmp_path}/error.log warn;\nevents {{}}\n"
        f"http {{\n  access_log off;\n{temps}  include {conf}/koi-*-upstreams.conf;\n"
        f"  server {{\n    listen 127.0.0.1:{port};\n    include {conf}/koi-*-locations.conf;\n  }}\n}}\n")
    base = [nginx_bin(), "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-e", str(tmp_path / "error.log")]
    done = subprocess.run(base, capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    try:
        yield {"url": f"http://127.0.0.1:{port}", "conf": conf, "reload": [*base, "-s", "reload"]}
    finally:
        subprocess.run([*base, "-s", "stop"], capture_output=True, timeout=30)


def split(url: str, n: int) -> Counter[str]:
    """Which engine answered each of ``n`` requests (a new connection each)."""
    out: Counter[str] = Counter()
    for _ in range(n):
        r = httpx.get(url, timeout=5)
        out[r.json()["engine"] if r.status_code == 200 else f"HTTP {r.status_code}"] += 1
    return out


def settles(url: str, want: dict[str, int]) -> None:
    """After a reload the old worker hands over to the new: one cycle of requests must split exactly as ``want``."""
    n, last = sum(want.values()), None
    for _ in range(50):
        last = split(url, n)
        if last == want:
            return
        time.sleep(0.1)
    pytest.fail(f"split {dict(last or {})}, want {want}")


def test_nginx_splits_a_jobs_requests_by_koi_weights_and_follows_each_change(nginx):
    port = free_port()
    engines = [Engine(f"127.0.0.{i + 2}", port, name) for i, name in enumerate(["big", "small-0", "small-1"])]
    try:
        f = Fleet()
        big = f.put("job-a", rank(3.0), ("127.0.0.2",))
        small = rank(1.0, n=2, tp=2)
        f.put("job-a", small, ("127.0.0.3", "127.0.0.4"))
        f.put("job-b", rank(1.0), ())  # launching
        sync = GatewaySync(GatewaySpec(kind="nginx", directory=str(nginx["conf"]), reload_command=nginx["reload"]),
                           "c1", f, port)
        assert sync.sync() and sync.reloads == 1
        assert not sync.sync() and sync.reloads == 1  # nothing changed: no write, no reload

        job_a = f"{nginx['url']}/job-a/v1/models"
        settles(job_a, {"big": 12, "small-0": 4, "small-1": 4})  # 3.0 against 1.0 per replica
        assert httpx.get(job_a, timeout=5).json()["path"] == "/v1/models"  # the job's prefix is stripped
        r = httpx.get(f"{nginx['url']}/job-b/v1/models", timeout=5)
        assert r.status_code == 503 and r.headers["retry-after"] == "15"

        # the planner reweighs the small rank (its id does not change with the weight): all replicas equal now
        f.ranks[("job-a", small.rank_id("job-a"))] = (rank(3.0, n=2, tp=2), DeploymentState.SERVING)
        assert sync.sync() and sync.reloads == 2
        settles(job_a, {"big": 4, "small-0": 4, "small-1": 4})

        del f.ranks[("job-a", big)]  # torn down
        assert sync.sync()
        settles(job_a, {"small-0": 4, "small-1": 4})
        table = json.loads((nginx["conf"] / "routes-c1.json").read_text())
        assert [b["address"] for b in table["jobs"]["job-a"]] == [f"127.0.0.3:{port}", f"127.0.0.4:{port}"]
    finally:
        for e in engines:
            e.close()


def test_a_failing_reload_is_raised_and_tried_again_until_nginx_takes_the_files(tmp_path):
    f = Fleet()
    f.put("job-a", rank(1.0), ("10.0.0.1",))
    flag = tmp_path / "nginx-down"
    flag.touch()
    reload = ["sh", "-c", f"test ! -e {flag}"]  # fails while the flag exists
    sync = GatewaySync(GatewaySpec(kind="nginx", directory=str(tmp_path), reload_command=reload), "c1", f, 8000)
    with pytest.raises(RuntimeError, match="exited 1"):
        sync.sync()
    assert (tmp_path / "koi-c1-upstreams.conf").exists() and sync.reloads == 0
    with pytest.raises(RuntimeError, match="exited 1"):  # the table did not change: the reload is still due
        sync.sync()
    flag.unlink()
    assert sync.sync() and sync.reloads == 1  # nginx took them
    assert not sync.sync() and sync.reloads == 1
    json_only = GatewaySync(GatewaySpec(directory=str(tmp_path / "j")), "c1", f, 8000)
    assert json_only.sync() and not list((tmp_path / "j").glob("*.conf"))
