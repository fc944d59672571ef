"""``koi worker``, ``koi dev``, ``koi up``, ``koi down``: running Koi on this machine.

The process and Temporal code lives in ``workers/`` and is imported inside each command.
"""

from __future__ import annotations

import asyncio

import typer

from koi.cli.output import console, emit, fail

JSON = typer.Option(False, "--json", help="print one JSON document")


def worker(
    queue: list[str] = typer.Option(["ticks", "planning"], "--queue", "-q", help="task queues to serve: ticks, planning"),
    world: str | None = typer.Option(None, help="sim (the simulator, checkpointed in the store), aws / gcp / azure (EC2 "
                                                 "/ Compute Engine / Azure VMs and the engines' vLLM metrics) or "
                                                 "ledger; default "
                                                 "KOI_WORLD (sim)"),
    fleet: str | None = typer.Option(None, help="aws/gcp/azure: the fleet file (pools, image, metrics port; docs/OPS.md); "
                                                "default KOI_FLEET_FILE"),
    launch_delay: float = typer.Option(0.0, help="sim: real seconds each launch takes (like a cloud API call)"),
    metrics_port: int | None = typer.Option(None, help="serve Koi's metrics for Prometheus on this port "
                                                       "(infra/metrics.py); default KOI_METRICS_PORT, else none"),
) -> None:
    """Run a worker: the tick and planning task queues, until SIGINT/SIGTERM."""
    from koi.config import get_settings
    from koi.logging import configure
    from workers.main import run_worker
    from workers.runtime import build_runtime

    configure()
    s = get_settings()
    if metrics_port is not None:
        s = s.model_copy(update={"metrics_port": metrics_port})
    world = world or s.world
    opts: dict = {"world_options": {"launch_delay_s": launch_delay}} if world == "sim" else {}
    if world == "ledger":
        fail("the ledger world needs a resource map; it is for tests (use --world sim)")
    if world in ("aws", "gcp", "azure"):
        opts["fleet"] = fleet
    try:
        rt = build_runtime(world=world, **opts)
    except ValueError as exc:  # an unknown world, a missing or malformed fleet file (FleetError)
        fail(str(exc))
        return
    asyncio.run(run_worker(rt, queues=queue, settings=s))


def dev(
    scenario: str = typer.Option("demo", help="the simulated world: a scenario name or a YAML path"),
    mode: str = typer.Option("simulated", help="simulated (advance the world per tick) or live (wall-clock timer)"),
    pace: float = typer.Option(5.0, help="simulated mode: real seconds between ticks, so you can watch"),
    interval: float | None = typer.Option(None, help="tick interval in seconds (default KOI_TICK_INTERVAL_S)"),
    start_cluster: bool = typer.Option(True, "--cluster/--no-cluster", help="start the cluster workflow"),
) -> None:
    """The whole stack in the foreground: Temporal dev server (UI on :8233), a worker, the simulated world."""
    from koi.logging import configure
    from workers.dev import run_dev

    configure()
    asyncio.run(run_dev(scenario=scenario, mode=mode, pace=pace, interval=interval, start_cluster=start_cluster))


def up(json_out: bool = JSON) -> None:
    """Start the dev server and a worker in the background (pid files and logs under KOI_DATA_DIR)."""
    from workers.dev import up as _up
    from workers.dev import wait_for_server_sync

    try:
        out = _up()
        wait_for_server_sync()
    except Exception as exc:  # noqa: BLE001
        fail(str(exc))
    emit(out, json_out, title="koi up")
    if not json_out:
        console.print("stop with [bold]koi down[/]")


def down(json_out: bool = JSON) -> None:
    """Stop what `koi up` started (by the pids in its pid files)."""
    from workers.dev import down as _down

    emit(_down(), json_out, title="koi down")


def register(app: typer.Typer) -> None:
    app.command("worker")(worker)
    app.command("dev")(dev)
    app.command("up")(up)
    app.command("down")(down)
