"""``make run`` as a new user runs it: no data directory, no Temporal server, then the summary.

The run gets an empty ``KOI_DATA_DIR`` and free ports, so it must start its own dev
server, worker and simulated world, tick, print the summary and stop what it started.
(The same with a brand-new clone and virtualenv takes minutes of pip install; that was
run by hand, see the issue report.)
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from fakes.ports import free_ports

pytestmark = [pytest.mark.temporal, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]


def test_make_run_on_a_fresh_machine_prints_the_summary(tmp_path):
    port, ui = free_ports(2)
    env = dict(os.environ)
    env.update({
        "KOI_DATA_DIR": str(tmp_path / "data"),
        "KOI_TEMPORAL_ADDRESS": f"localhost:{port}",
        "KOI_TEMPORAL_UI_PORT": str(ui),
    })
    env.pop("KOI_DATABASE_URL", None)
    venv = Path(sys.executable).parent.parent
    # --assume-old: the venv running this test is installed; a checkout newer than its stamp (a second
    # worktree sharing the venv) must not re-point the venv's editable install at itself
    out = subprocess.run(
        ["make", "--no-print-directory", f"--assume-old={venv}/.installed", "run", f"VENV={venv}",
         "ARGS=--ticks 2 --json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    start = out.stdout.index("{")
    summary = json.loads(out.stdout[start:])
    assert summary["ticks"] == {**summary["ticks"], "total": 2, "committed": 2}
    assert summary["jobs"]["admitted"] >= 4 and summary["goodput_tokens_per_s"] > 0
    assert summary["usd_per_mtok"] > 0 and 0 < summary["ttft_attainment"] <= 1
    assert summary["ui"].startswith(f"http://localhost:{ui}/namespaces/default/workflows/demo-")
    assert "temporal" in summary["started"] and not summary["kept_running"]
    assert (tmp_path / "data" / "temporal.db").exists() and (tmp_path / "data" / "koi.db").exists()
    # the run's report stays after the servers are gone: the JSON it printed and the Markdown
    run_dir = tmp_path / "data" / "runs" / summary["cluster_id"]
    assert summary["report"] == {"markdown": str(run_dir / "report.md"), "json": str(run_dir / "summary.json")}
    assert json.loads((run_dir / "summary.json").read_text()) == summary
    md = (run_dir / "report.md").read_text()
    assert md.startswith(f"# Koi run {summary['cluster_id']} — scenario demo") and "| 1 | committed | " in md
    assert summary["next"][0]["command"] == "koi up" and f"koi plan replay 1 --cluster {summary['cluster_id']}" in md
    # it stopped what it started: nothing listens on its ports any more
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_koi_up_cluster_start_status_down(tmp_path):
    import time

    port, ui = free_ports(2)
    env = dict(os.environ)
    env.update({
        "KOI_DATA_DIR": str(tmp_path / "data"),
        "KOI_TEMPORAL_ADDRESS": f"localhost:{port}",
        "KOI_TEMPORAL_UI_PORT": str(ui),
        "KOI_CLUSTER_ID": "up-test",
        "KOI_TICK_INTERVAL_S": "60",
    })
    env.pop("KOI_DATABASE_URL", None)
    koi = str(Path(sys.executable).parent / "koi")

    def run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([koi, *args], env=env, capture_output=True, text=True, timeout=timeout)

    up = run("up", "--json")
    try:
        assert up.returncode == 0, up.stderr
        pids = json.loads(up.stdout)
        assert pids["started"] == ["temporal", "worker"]
        assert (tmp_path / "data" / "run" / "worker.pid").read_text() == str(pids["worker_pid"])
        start = run("cluster", "start", "--max-ticks", "2", "--json")
        assert start.returncode == 0, start.stderr
        deadline = time.monotonic() + 180
        while True:
            st = run("status", "--json")
            if st.returncode == 0 and json.loads(st.stdout)["ticks_done"] >= 2:
                break
            assert time.monotonic() < deadline, st.stderr
            time.sleep(1)
        assert json.loads(st.stdout)["committed"] == 2
    finally:
        down = run("down", "--json")
    assert down.returncode == 0, down.stderr
    assert {p["name"] for p in json.loads(down.stdout)["stopped"]} == {"worker", "temporal"}
    assert not (tmp_path / "data" / "run" / "worker.pid").exists()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0
