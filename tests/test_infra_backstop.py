"""infra.backstop: the time a drained instance releases itself, and the watchdog in its start-up script — run for
real by bash, per cloud, with stubs for ``curl`` (the instance metadata and the cloud's API), ``shutdown`` and
``vllm`` on PATH."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from infra import drain
from infra.backstop import RELEASE_GRACE_S, release_by, replica_release_by, watchdog
from infra.engine import EngineSpec, Node, start_script
from koi.domain import ChainConfig, Environment, Rank

ENV = Environment(cloud="aws", region="us-east-1", zone="us-east-1a", market="on_demand", gpu_type="H100")
IDENTITY = "/subscriptions/s/resourceGroups/rg/providers/Microsoft.ManagedIdentity/userAssignedIdentities/koi-vm"
VM_ID = "/subscriptions/s/resourceGroups/rg/providers/Microsoft.Compute/virtualMachines/koi-vm-0"

# curl as each cloud's metadata service and API: answers by URL, records every call
CURL = r"""#!/bin/bash
echo "curl $*" >> "$OUT/calls"
case "$*" in
  *api/token*) echo tok;;
  *tags/instance/koi:release-by*|*attributes/koi-release-by*) [ -n "${BY:-}" ] && echo "$BY" || exit 22;;
  *tagsList*) if [ -n "${BY:-}" ]; then echo "[{\"name\":\"koi:job\",\"value\":\"job-1\"},{\"name\":\"koi:release-by\",\"value\":\"$BY\"}]"; else echo '[{"name":"koi:job","value":"job-1"}]'; fi;;
  *service-accounts/default/token*|*oauth2/token*) echo '{"access_token": "tok-123", "expires_in": 3599}';;
  *instance/zone*) echo projects/12345/zones/us-central1-a;;
  *instance/name*) echo koi-vm-0;;
  *project/project-id*) echo proj;;
  *compute/resourceId*) echo "$VM_ID";;
  *"-X DELETE"*) exit "${DELETE_RC:-0}";;
  *) exit 22;;
esac
"""


def test_the_backstop_comes_only_after_the_sweep_would_have_released():
    """For every kind of deferred release, the sweep (run by a worker) releases before ``release-by`` - grace."""
    for handover, started in ((True, None), (True, 1000.0), (False, 1000.0)):
        d = drain.Drain(at=1000.0, drain_s=30.0, handover=handover, started=started)
        by = int(release_by(d))
        # the latest the sweep releases: the handover times out (no replacement ever serves), then the drain
        views = {"r": drain.RankView("job-1", 2, 2, d)}
        t = d.at + drain.HANDOVER_TIMEOUT_S if started is None else started
        begun, _ = drain.sweep(views, t)
        d2 = begun.get("r", d)
        assert drain.phase(d2, t + 30.0) == "done"
        assert by >= t + 30.0 + RELEASE_GRACE_S and by - (t + 30.0 + RELEASE_GRACE_S) < 1
    assert replica_release_by(1000.25) == str(math.ceil(1000.25 + RELEASE_GRACE_S))


def test_azure_without_an_identity_has_no_watchdog():
    """A guest shutdown does not stop Azure's bill: without an identity to delete itself with, nothing is rendered."""
    assert watchdog("azure", "/var/log/x") is None
    assert "msi_res_id=" + IDENTITY in watchdog("azure", "/var/log/x", IDENTITY)


def _run(tmp_path: Path, cloud: str, by: int | None, script: str | None = None,
         **env: str) -> tuple[subprocess.Popen, Path]:
    """Run the start-up script of a one-node rank on ``cloud`` (or ``script``) with the stubs; the watchdog checks
    every 0.05 s."""
    bin_ = tmp_path / "bin"
    bin_.mkdir(exist_ok=True)
    for name, text in {"curl": CURL, "shutdown": '#!/bin/bash\necho "shutdown $*" >> "$OUT/calls"\n',
                       "vllm": '#!/bin/bash\necho "vllm" >> "$OUT/calls"\n'}.items():
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    log = tmp_path / "engine.log"
    r = Rank(env=ENV, config=ChainConfig(instance_type="p5.48xlarge"), n_replicas=1)
    script = script or start_script("c1", "job-1", r.rank_id("job-1"), "llama-3.1-8b", r, 8000, EngineSpec(log_file=str(log)),
                          Node(index="0", count=1, gpus=8, imds=cloud == "aws"),
                          watchdog(cloud, str(log), IDENTITY if cloud == "azure" else None))  # type: ignore[arg-type]
    (tmp_path / "start.sh").write_text(script)
    (tmp_path / "calls").write_text("")
    full = {**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "OUT": str(tmp_path), "KOI_WATCH_EVERY_S": "0.05",
            "BY": "" if by is None else str(by), "VM_ID": VM_ID, **env}
    proc = subprocess.Popen(["bash", str(tmp_path / "start.sh")], env=full, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    return proc, tmp_path / "calls"


def _wait_for(calls: Path, pred, proc: subprocess.Popen) -> list[str]:
    deadline = time.monotonic() + 20.0
    while time.monotonic() < deadline:
        lines = calls.read_text().splitlines()
        if pred(lines):
            return lines
        time.sleep(0.05)
    raise AssertionError(f"not seen: {calls.read_text()!r} stderr={proc.stderr.read() if proc.poll() is not None else ''}")


def _stop(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=10)


def _reads(lines: list[str]) -> int:
    return sum("release-by" in x or "tagsList" in x for x in lines)


RELEASED = {
    "aws": lambda x: x == "shutdown -h now",
    "gcp": lambda x: "-X DELETE" in x and "Bearer tok-123" in x
                     and x.endswith("https://compute.googleapis.com/compute/v1/projects/proj/zones/us-central1-a/"
                                    "instances/koi-vm-0"),
    "azure": lambda x: "-X DELETE" in x and "Bearer tok-123" in x and f"https://management.azure.com{VM_ID}?" in x,
}


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_a_drained_instance_past_its_time_releases_itself_and_the_engine_still_starts(tmp_path, cloud):
    proc, calls = _run(tmp_path, cloud, int(time.time()) - 5)
    try:
        lines = _wait_for(calls, lambda ls: any(map(RELEASED[cloud], ls)), proc)
    finally:
        _stop(proc)
    assert "vllm" in lines  # the engine started as always; the watchdog runs beside it
    assert "shutdown -h now" not in lines or cloud == "aws"  # the API delete worked: no fallback
    assert "no worker released this instance" in (tmp_path / "engine.log").read_text()
    if cloud == "azure":  # the token is the fleet's identity's
        assert any("oauth2/token" in x and f"msi_res_id={IDENTITY}" in x for x in lines)


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
@pytest.mark.parametrize("when", ["absent", "future", "garbage"])
def test_a_live_instance_or_one_not_yet_due_keeps_running(tmp_path, cloud, when):
    by = {"absent": None, "future": int(time.time()) + 3600, "garbage": None}[when]
    extra = {"BY": "soon"} if when == "garbage" else {}
    proc, calls = _run(tmp_path, cloud, by, **extra)
    try:
        lines = _wait_for(calls, lambda ls: _reads(ls) >= 5, proc)  # it looked five times
    finally:
        _stop(proc)
    assert not any(map(RELEASED[cloud], lines)) and "shutdown -h now" not in lines
    assert not (tmp_path / "engine.log").exists() or "releasing" not in (tmp_path / "engine.log").read_text()


def test_gce_without_the_right_to_delete_itself_stops(tmp_path):
    """The service account may not delete instances: the instance stops (no GPU held or billed), and the sweep deletes
    it when a worker returns."""
    proc, calls = _run(tmp_path, "gcp", int(time.time()) - 5, DELETE_RC="22")
    try:
        lines = _wait_for(calls, lambda ls: "shutdown -h now" in ls, proc)
    finally:
        _stop(proc)
    assert any(map(RELEASED["gcp"], lines))  # tried the API first


def test_the_azure_tag_reader_picks_the_release_tag_from_the_list():
    """Azure's metadata lists every tag; only koi:release-by counts."""
    script = watchdog("azure", "/dev/null", IDENTITY)
    assert script is not None
    tags = [{"name": "koi:replica-drain-until", "value": "1"}, {"name": "koi:release-by", "value": "1700000000"}]
    reader = script.split("koi_release_by() {", 1)[1].split("\n}", 1)[0]
    code = reader.split("-c '", 1)[1].rsplit("'", 1)[0]
    out = subprocess.run(["python3", "-c", code], input=json.dumps(tags), capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1700000000"


def test_koi_fleet_backstop_script_runs_on_an_image_of_the_operators_own(tmp_path):
    """The printed script is the watchdog alone (no engine): past its time the instance releases itself."""
    from typer.testing import CliRunner

    from koi.cli import app

    r = CliRunner().invoke(app, ["fleet", "backstop-script", "--cloud", "aws", "--log-file", str(tmp_path / "b.log")])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("#!/bin/bash") and "vllm" not in r.stdout
    proc, calls = _run(tmp_path, "aws", int(time.time()) - 5, r.stdout)
    try:
        lines = _wait_for(calls, lambda ls: "shutdown -h now" in ls, proc)
    finally:
        _stop(proc)
    assert any("tags/instance/koi:release-by" in x for x in lines)
    assert "releasing it" in (tmp_path / "b.log").read_text()
    # --foreground (a systemd unit): the script itself is the watchdog, and ends once it has released the instance
    (tmp_path / "calls").write_text("")
    env = {**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "OUT": str(tmp_path),
           "KOI_WATCH_EVERY_S": "0.05", "BY": str(int(time.time()) - 5)}
    (tmp_path / "backstop.sh").write_text(r.stdout)
    done = subprocess.run(["bash", str(tmp_path / "backstop.sh"), "--foreground"], env=env, capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0 and "shutdown -h now" in (tmp_path / "calls").read_text().splitlines()
    r = CliRunner().invoke(app, ["fleet", "backstop-script", "--cloud", "azure"])
    assert r.exit_code == 2 and "managed identity" in r.output
    r = CliRunner().invoke(app, ["fleet", "backstop-script", "--cloud", "azure", "--identity", IDENTITY])
    assert r.exit_code == 0 and f"msi_res_id={IDENTITY}" in r.stdout
