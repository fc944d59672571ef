"""``koi fleet check`` / ``RankReads.preflight``: what each cloud is asked before the first tick, launching nothing —
EC2 on moto's server (and through a loopback proxy that refuses what a real account would), Compute Engine and Azure
on their loopback fakes."""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any
from urllib.parse import parse_qs

import pytest
from typer.testing import CliRunner

from koi.cli import app
from tests.fakes.http import TextHandler, serve, stop
from tests.test_infra_azure import arm  # noqa: F401 - the fake ARM fixture
from tests.test_infra_cloud import CREDS, FLEET_YAML

FLEET = FLEET_YAML.replace("image_id:", """  - env: {cloud: aws, region: us-east-1, zone: us-east-1b, market: spot, gpu_type: H100}
    instance_type: p5.48xlarge
    gpus_per_instance: 8
    total_instances: 2
    free_instances: 2
    hourly_price: 40.0
image_id:""", 1)

_EC2_ERROR = ('<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error><Code>{code}</Code><Message>{message}'
              '</Message></Error></Errors><RequestID>7a62c49f-347e-4fc4-9331-6e8eEXAMPLE</RequestID></Response>')


def _proxy(moto: str, refuse: dict[str, tuple[int, str, str]],
           answer: Callable[[dict[str, str]], str | None] | None = None) -> Any:
    """EC2 as an account would answer: ``refuse`` maps an action (``Action=``, or ``RunInstances:<type>`` for a
    dry-run launch of that instance type) to (status, code, message); ``answer`` may give a request's XML reply
    (what moto cannot say); the rest goes to moto."""

    class Proxy(TextHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            q = {k: v[0] for k, v in parse_qs(body.decode()).items()}
            if answer is not None and (xml := answer(q)) is not None:
                return self.send_text(xml)
            for key in (q.get("Action", ""), f"{q.get('Action')}:{q.get('InstanceType')}"):
                if key in refuse:
                    status, code, message = refuse[key]
                    return self.send_text(_EC2_ERROR.format(code=code, message=message), status)
            req = urllib.request.Request(moto + self.path, data=body, method="POST", headers={
                k: v for k, v in self.headers.items() if k.lower() not in ("host", "content-length")})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    status, text = r.status, r.read().decode()
            except urllib.error.HTTPError as e:  # moto's own errors (a dry run's DryRunOperation) pass through
                status, text = e.code, e.read().decode()
            return self.send_text(text, status)

    httpd = serve(Proxy)
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}"


def _check_through(tmp_path, moto: str, refuse: dict[str, tuple[int, str, str]]) -> tuple[int, dict]:
    """``koi fleet check`` against EC2 answering as :func:`_proxy` says."""
    httpd, url = _proxy(moto, refuse)
    try:
        return _check(tmp_path, url)
    finally:
        stop(httpd)


def _check(tmp_path, endpoint: str) -> tuple[int, dict]:
    f = tmp_path / "fleet.yaml"
    f.write_text(FLEET + f"endpoint_url: {endpoint}\n")
    r = CliRunner().invoke(app, ["fleet", "check", "--fleet", str(f), "--cluster", f"c-{uuid.uuid4().hex[:8]}",
                                 "--json"], env=CREDS)
    return r.exit_code, json.loads(r.stdout) if r.stdout.strip().startswith("{") else {"output": r.output}


def test_ec2_every_pool_launch_is_dry_run_and_nothing_is_launched(tmp_path, moto_endpoint, ec2_factory):
    code, doc = _check(tmp_path, moto_endpoint)
    assert code == 0, doc
    assert doc["ok"] is True and doc["cloud"] == "aws"
    assert [(c["check"].split(":")[-1].strip(), c["ok"], c["detail"]) for c in doc["checks"][1:]] == [
        ("run_instances (dry run)", True, "would launch")] * 2
    assert doc["checks"][0]["check"] == "list the cluster's instances" and doc["checks"][0]["ok"]
    insts = [i for r in ec2_factory("us-east-1").describe_instances()["Reservations"] for i in r["Instances"]]
    assert not [i for i in insts if i["InstanceType"] in ("g6.xlarge", "p5.48xlarge")
                and i["ImageId"] == "ami-0123456789abcdef0" and i["State"]["Name"] != "terminated"
                and any(t["Key"] == "koi:job" and t["Value"] == "koi-preflight" for t in i.get("Tags", []))]


def test_ec2_a_pool_the_account_may_not_launch_fails_with_ec2s_words(tmp_path, moto_endpoint):
    code, doc = _check_through(tmp_path, moto_endpoint, {"RunInstances:p5.48xlarge": (
        403, "UnauthorizedOperation", "You are not authorized to perform this operation. Encoded message: x")})
    assert code == 1 and doc["ok"] is False
    ok = {c["check"].split(":")[-2].split("/")[-1]: (c["ok"], c["detail"]) for c in doc["checks"][1:]}
    assert ok["g6.xlarge"] == (True, "would launch")
    assert ok["p5.48xlarge"][0] is False and ok["p5.48xlarge"][1].startswith("UnauthorizedOperation: You are not")


def test_ec2_credentials_refused_stop_at_the_listing(tmp_path, moto_endpoint):
    code, doc = _check_through(tmp_path, moto_endpoint, {"DescribeInstances": (
        401, "AuthFailure", "AWS was not able to validate the provided access credentials")})
    assert code == 1 and [(c["ok"], c["detail"].split(":")[0]) for c in doc["checks"]] == [(False, "AuthFailure")]


def test_check_without_a_fleet_file_says_so(tmp_path):
    r = CliRunner().invoke(app, ["fleet", "check", "--fleet", str(tmp_path / "none.yaml")])
    assert r.exit_code == 2 and "cannot read fleet file" in r.output


# ---- Compute Engine -------------------------------------------------------------------------------------------
def test_gce_checks_the_image_and_each_machine_type_in_its_zone():
    from google.api_core.client_options import ClientOptions
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import compute_v1

    from infra.gcp import GceFleet
    from tests import test_infra_gcp as t
    from tests.fakes.gce_server import FakeGceServer

    with FakeGceServer(zones=(t.ZONE_A, t.ZONE_B)) as server:
        creds = AnonymousCredentials()
        client = compute_v1.InstancesClient(transport="rest", client_options=ClientOptions(api_endpoint=server.url),
                                            credentials=creds)
        fleet = GceFleet("c1", t.pools(), project=t.PROJECT, client=client, image=t.IMAGE, api_endpoint=server.url,
                         credentials=creds)
        [big, small] = t.pools().pools  # a2-highgpu-8g in zone A, g2-standard-4 in zone B
        server.machine_types = {t.ZONE_A: {big.instance_type: ("nvidia-a100-80gb", 8)},
                                t.ZONE_B: {small.instance_type: ("nvidia-l4", 2)}}
        family = t.IMAGE.split("/projects/")[-1].replace("/global/images/", "/")
        server.images = {family.removeprefix("projects/")}
        checks = fleet.preflight()
        assert [c.ok for c in checks] == [True, True, True, False]
        assert checks[1].detail.endswith("(READY)") and checks[2].detail == "offered, 8 x nvidia-a100-80gb"
        assert checks[3].detail == "the type carries 2 GPU(s), the pool counts 1"
        server.machine_types = {t.ZONE_A: {}, t.ZONE_B: {small.instance_type: ("nvidia-l4", 1)}}
        server.images = set()
        checks = fleet.preflight()
        assert [c.ok for c in checks] == [True, False, False, True]
        assert checks[1].detail.startswith("notFound: ") and "family" in checks[1].detail
        assert checks[2].detail.startswith("notFound: ") and f"zones/{t.ZONE_A}/machineTypes/" in checks[2].detail
        assert not server.all_instances()  # nothing launched


# ---- Azure --------------------------------------------------------------------------------------------------------
def _sku(name: str, gpus: int, zones: list[str], restricted: list[str] = (), location: bool = False) -> dict:
    r = [{"type": "Zone", "values": ["eastus"], "reasonCode": "NotAvailableForSubscription",
          "restrictionInfo": {"locations": ["eastus"], "zones": list(restricted)}}] if restricted else []
    if location:
        r = [{"type": "Location", "values": ["eastus"], "reasonCode": "NotAvailableForSubscription",
              "restrictionInfo": {"locations": ["eastus"]}}]
    return {"resourceType": "virtualMachines", "name": name, "locations": ["eastus"],
            "locationInfo": [{"location": "eastus", "zones": zones}], "restrictions": r,
            "capabilities": [{"name": "GPUs", "value": str(gpus)}]}


@pytest.mark.parametrize(("skus", "want"), [
    ([_sku("Standard_ND96asr_v4", 8, ["1", "3"]), _sku("Standard_NV36ads_A10_v5", 1, ["2"])],
     [(True, "offered, 8 GPU(s)"), (True, "offered, 1 GPU(s)")]),
    ([_sku("Standard_ND96asr_v4", 8, ["2", "3"]), _sku("Standard_NV36ads_A10_v5", 1, ["1", "2"], restricted=["2"])],
     [(False, "offered in zone(s) 2, 3 only"), (False, "NotAvailableForSubscription: Zone 2")]),
    ([_sku("Standard_ND96asr_v4", 4, ["1"]), _sku("Standard_NV36ads_A10_v5", 1, ["2"], location=True)],
     [(False, "the size carries 4 GPU(s), the pool counts 8"), (False, "NotAvailableForSubscription: Location eastus")]),
    ([], [(False, "not offered in the region")] * 2),
])
def test_azure_checks_each_size_in_its_zone_for_this_subscription(arm, skus, want):  # noqa: F811
    from tests import test_infra_azure as z

    server = arm[0]
    fleet = z.make_fleet(arm, f"c-{uuid.uuid4().hex[:8]}")
    ref = fleet.image
    server.skus = skus
    server.image_versions = {"/".join(("eastus", ref["publisher"], ref["offer"], ref["sku"])): ["1.0.1", "1.0.2"]}
    checks = fleet.preflight()
    assert checks[0].ok and checks[1].ok and checks[1].detail == "2 version(s), newest 1.0.2"
    assert [(c.ok, c.detail) for c in checks[2:]] == want
    server.image_versions = {}
    assert fleet.preflight()[1].detail == "not offered there (0 version(s) listed)"


def test_check_also_asks_this_host_what_the_fleet_file_needs(tmp_path, moto_endpoint):
    """Prometheus answering, the directories Koi writes writable, nginx's reload command on PATH: each an answer."""
    from tests.test_infra_prometheus import FakePrometheus
    from tests.test_infra_vllm_metrics import closed_port_url

    fake = FakePrometheus()
    fake.reply = (200, {"status": "success", "data": {"version": "2.42.0"}})
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    good = (f"prometheus_url: {fake.url}\nprometheus_file_sd: {tmp_path / 'sd'}\n"
            f"gateway: {{kind: nginx, directory: {tmp_path / 'gw'}, reload_command: [sh, -c, 'true']}}\n")
    bad = (f"prometheus_url: {closed_port_url().removesuffix('/metrics')}\nprometheus_file_sd: {blocker / 'sd'}\n"
           f"gateway: {{kind: nginx, directory: {tmp_path / 'gw'}, reload_command: [nginx-nowhere, -s, reload]}}\n")
    try:
        results = {}
        for name, extra in (("good", good), ("bad", bad)):
            f = tmp_path / f"{name}.yaml"
            f.write_text(FLEET + f"endpoint_url: {moto_endpoint}\n" + extra)
            r = CliRunner().invoke(app, ["fleet", "check", "--fleet", str(f), "--cluster", "c-host", "--json"],
                                   env=CREDS)
            results[name] = (r.exit_code, {c["check"]: (c["ok"], c["detail"]) for c in json.loads(r.stdout)["checks"]})
    finally:
        fake.close()
    code, good_checks = results["good"]
    assert code == 0 and good_checks[f"Prometheus at {fake.url}"] == (True, "version 2.42.0")
    assert good_checks["Prometheus file discovery"][0] and good_checks["gateway (nginx)"][0]
    assert good_checks["gateway reload command"][0]
    assert (tmp_path / "sd").is_dir() and not list((tmp_path / "sd").iterdir())  # nothing left behind
    code, bad_checks = results["bad"]
    assert code == 1
    prom = next(v for k, v in bad_checks.items() if k.startswith("Prometheus at"))
    assert prom[0] is False and "ConnectError" in prom[1]
    assert bad_checks["Prometheus file discovery"] == (False, f"{blocker / 'sd'}: Not a directory")
    assert bad_checks["gateway reload command"][0] is False and "nginx-nowhere is not on PATH" in bad_checks[
        "gateway reload command"][1]
