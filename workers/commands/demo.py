"""``koi demo`` — what ``make run`` calls: the main job end to end on the embedded default.

The Temporal and process code lives in ``workers/demo.py`` (imported inside the command).
"""

from __future__ import annotations

import asyncio

import typer

from koi.cli.output import fail, print_json


def demo(
    ticks: int = typer.Option(12, "--ticks", "-n", min=1, help="planning ticks to run (12 × 300 s = the scenario's hour)"),
    keep_running: bool = typer.Option(False, "--keep-running", help="leave the dev server and a worker running"),
    json_out: bool = typer.Option(False, "--json", help="print the summary as one JSON document"),
    scenario: str = typer.Option("demo", help="scenario name (koi/sim/scenarios) or YAML path"),
    interval: float = typer.Option(300.0, min=1.0, help="tick interval, simulated seconds"),
    seed: int | None = typer.Option(None, help="the world's seed (default: the scenario's)"),
) -> None:
    """Start Temporal, a worker and the simulated fleet; submit the demo jobs; tick; print the summary."""
    import logging

    from koi.logging import configure
    from workers.demo import render, run_demo

    configure(level="WARNING")
    logging.getLogger().setLevel(logging.WARNING)  # basicConfig keeps the first level it was given
    try:
        summary = asyncio.run(
            run_demo(ticks=ticks, keep_running=keep_running, scenario=scenario, interval_s=interval, seed=seed,
                     progress=True)
        )
    except KeyboardInterrupt:
        fail("interrupted", code=130)
    except Exception as exc:  # noqa: BLE001 - one clear line for a new user
        fail(f"the demo failed: {type(exc).__name__}: {exc}")
    if json_out:
        print_json(summary)
    else:
        render(summary)


def register(app: typer.Typer) -> None:
    app.command("demo")(demo)
