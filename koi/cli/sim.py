"""``koi sim run|bench|fidelity|check``: the fleet simulator from the command line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from koi.cli.output import console, emit, err_console, fail

app = typer.Typer(help="The fleet simulator: run scenarios, measure its speed and its fidelity.", no_args_is_help=True)

JSON = typer.Option(False, "--json", help="print one JSON document")


def _progress(enabled: bool, description: str, total: float):  # noqa: ANN202 - a rich Progress or None
    if not enabled:
        return None
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    p = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.percentage:>5.1f}%"),
                 TimeElapsedColumn(), console=err_console, transient=True)  # fmt: skip
    p.add_task(description, total=total)
    return p


def scenario_arg(scenario: Path) -> Any:
    """The scenario a command's argument names ('demo': the shipped one); a clear error and exit 2 if it does
    not load."""
    from koi.sim.scenario import ScenarioError, demo_path, load_scenario

    try:
        return load_scenario(demo_path() if str(scenario) == "demo" else scenario)
    except ScenarioError as exc:
        fail(str(exc))


@app.command()
def run(
    scenario: Path = typer.Argument(..., help="scenario YAML (see koi/sim/SCENARIO.md); 'demo' for the shipped one"),
    hours: float | None = typer.Option(None, "--hours", help="simulated hours (default: the scenario's duration)"),
    seed: int | None = typer.Option(None, "--seed", help="override the scenario's seed"),
    json_out: bool = JSON,
) -> None:
    """Run a scenario under fixed deployments and summarise it."""
    from koi.sim.driver import run_scenario

    sc = scenario_arg(scenario)
    until = sc.duration_s if hours is None else hours * 3600.0
    prog = _progress(not json_out, f"simulating {sc.name}", until)
    if prog:
        with prog:
            _, summary = run_scenario(sc, hours=until / 3600.0, seed=seed,
                                      on_progress=lambda t: prog.update(prog.task_ids[0], completed=t))  # fmt: skip
    else:
        _, summary = run_scenario(sc, hours=until / 3600.0, seed=seed)
    if json_out:
        emit(summary, True)
        return
    f = summary["fleet"]
    emit({k: v for k, v in f.items() if k != "failed_launches"} | {"failed_launches": len(f["failed_launches"])},
         False, title=f"{summary['scenario']} (seed {summary['seed']}): fleet")  # fmt: skip
    cols = ["job_id", "class", "model", "requests", "served", "not_served", "p99_ttft_ms", "p99_ttft_ms_ready",
            "p99_tpot_ms",
            "output_tokens", "cost_usd", "slo_attainment", "deadline_met"]  # fmt: skip
    emit(summary["jobs"], False, title="jobs", columns=cols)
    for fl in f["failed_launches"]:
        console.print(f"[red]failed launch[/] {fl['job_id']}: {fl['reason']}")


@app.command()
def bench(
    hours: float = typer.Option(3.0, "--hours", help="simulated hours"),
    gpus: int = typer.Option(400, "--gpus", help="fleet size (GPUs)"),
    seed: int = typer.Option(0, "--seed"),
    step: float = typer.Option(1.0, "--step", help="macro-step of the replica engine, seconds"),
    json_out: bool = JSON,
) -> None:
    """Speed benchmark: a generated heterogeneous fleet with 25 jobs under fixed deployments."""
    from koi.sim.bench import run_benchmark

    prog = _progress(not json_out, f"{hours:g} h on {gpus} GPUs", hours * 3600.0)
    if prog:
        with prog:
            res = run_benchmark(hours, gpus, seed, step_s=step,
                                on_progress=lambda t, _u: prog.update(prog.task_ids[0], completed=t))  # fmt: skip
    else:
        res = run_benchmark(hours, gpus, seed, step_s=step)
    emit(res, json_out, title="koi sim bench")


@app.command()
def fidelity(
    step: float = typer.Option(1.0, "--step", help="macro-step of the replica engine, seconds"),
    limit: int | None = typer.Option(None, "--limit", help="replay a deterministic sample of this many rows"),
    json_out: bool = JSON,
) -> None:
    """Replay measured silicon rows through the simulator's engine; median/p90 |% error| of TTFT and TPOT."""
    from koi.sim.fidelity import fidelity as run_fidelity
    from koi.sim.fidelity import fidelity_rows

    n = limit or len(fidelity_rows())
    prog = _progress(not json_out, "replaying silicon rows", n)
    if prog:
        with prog:
            res = run_fidelity(step_s=step, limit=limit,
                               on_row=lambda i, _n: prog.update(prog.task_ids[0], completed=i))  # fmt: skip
    else:
        res = run_fidelity(step_s=step, limit=limit)
    if json_out:
        emit(res, True)
        return
    rows: list[dict[str, Any]] = [{"split": k, **v} for k, v in res.items() if isinstance(v, dict)]
    emit(rows, False, title=f"simulator fidelity vs {res['source']} (step {res['step_s']} s); "
                            f"'holdout' was never used to fit anything")  # fmt: skip


@app.command()
def check(scenario: Path = typer.Argument(..., help="scenario YAML"), json_out: bool = JSON) -> None:
    """Validate a scenario file (schema, catalog names, deployment feasibility)."""
    from koi.sim.scenario import ScenarioError, load_scenario

    try:
        sc = load_scenario(scenario)
    except ScenarioError as exc:
        fail(str(exc))
        return
    emit({"scenario": sc.name, "pools": len(sc.pools), "gpus": sc.total_gpus, "jobs": len(sc.jobs),
          "events": len(sc.events), "hidden_effects": len(sc.hidden), "valid": True}, json_out)  # fmt: skip


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="sim")
