"""``koi learn SCENARIO.yaml``: the learning loop (S1 → S2 → S3 → PerfDB → surrogate) on the simulator.

Runs :func:`koi.calibration.learn.run_learn` under the scenario's fixed deployments and
reports, every ``--every`` ticks, how calibration improves: U of the exercised edges and
mechanisms, the Q1 rate, the share of decisive tests that support the predicted path, ICP
acceptance, the DRO radius ε and the surrogate's error before/after learning; then the
summary (the U factor, first → last support share and ICP acceptance). ``--json`` prints
one document with the per-tick series, the summary and the timings.

The store is a fresh SQLite file under ``KOI_DATA_DIR/learn/`` unless ``--db`` names one;
``koi why ... --url <that database> --cluster learn`` then explains what was learned.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import typer

from koi.cli.output import console, emit, fail

JSON = typer.Option(False, "--json", help="print one JSON document (per-tick series, summary, timings)")

#: The periodic table's columns: (header, width, formatter of a TickReport).
_COLS: list[tuple[str, int]] = [
    ("tick", 5), ("hour", 5), ("ranks", 5), ("decided", 7), ("Q1", 5), ("support", 7), ("ICP acc", 7),
    ("U edges", 8), ("U med", 8), ("U mech", 8), ("eps", 5), ("TTFT err b→a %", 14), ("TPOT err b→a %", 14),
    ("thr err b→a %", 14),
]


def _f(v: float | None, fmt: str = ".3f") -> str:
    return "-" if v is None else format(v, fmt)


def _err(r: Any, key: str) -> str:
    e = r.errors.get(key)
    if e is None or e.before is None:
        return "-"
    return f"{e.before:5.1f} → {e.after:4.1f}"


def _row(b: Any, ranks: int) -> list[str]:
    return [str(b.last_tick), f"{b.hours:.2f}", str(ranks), str(b.decided), _f(b.q1_rate, ".2f"),
            _f(b.support_share, ".3f"), _f(b.icp_accept_rate, ".3f"), _f(b.mean_u_edges, ".2e"),
            _f(b.median_u_edges, ".2e"), _f(b.mean_u_mechanisms, ".2e"), _f(b.epsilon, ".3f"),
            _err(b, "p99_ttft_ms"), _err(b, "p99_tpot_ms"), _err(b, "throughput_tokens_per_sec")]


def _line(cells: list[str]) -> str:
    return "  ".join(c.rjust(w) for c, (_, w) in zip(cells, _COLS, strict=True))


def _quiet_logs(level: str | None) -> None:
    """Logs at WARNING unless asked (or KOI_LOG_LEVEL says otherwise): S2/S3 log every tick at INFO."""
    import os

    from koi.logging import configure

    lvl = level or os.environ.get("KOI_LOG_LEVEL") or "WARNING"
    configure(level=lvl)
    logging.getLogger().setLevel(getattr(logging, lvl.upper(), logging.WARNING))
    logging.getLogger("alembic").setLevel(max(logging.WARNING, getattr(logging, lvl.upper(), logging.WARNING)))


def learn(
    scenario: Path = typer.Argument(..., help="scenario YAML (koi/sim/SCENARIO.md); 'demo' for the shipped demo"),
    hours: float = typer.Option(12.0, "--hours", help="simulated hours"),
    tick_s: float = typer.Option(300.0, "--tick-s", help="tick interval, seconds"),
    seed: int | None = typer.Option(None, "--seed", help="the world's seed (default: the scenario's)"),
    db: str | None = typer.Option(None, "--db", help="database URL (default: a fresh SQLite under KOI_DATA_DIR/learn/)"),
    cluster: str = typer.Option("learn", "--cluster", help="cluster id the run is stored under"),
    refit_every: int = typer.Option(1, "--refit-every", help="ticks between surrogate refits (0: never learn)"),
    learn_window_h: float = typer.Option(2.0, "--learn-window-h",
                                         help="hours of PerfDB records per refit (0: all of them)"),
    every: int | None = typer.Option(None, "--every", help="a table row every N ticks (default: every hour)"),
    log_level: str | None = typer.Option(None, "--log-level", help="log level on stderr (default WARNING)"),
    json_out: bool = JSON,
) -> None:
    """Run the learning loop on the simulator under fixed deployments and report calibration over time."""
    from koi.calibration.learn import default_db_url, run_learn
    from koi.calibration.learn_report import LearnConfig
    from koi.cli.sim import scenario_arg
    from koi.store import init_db, make_engine

    _quiet_logs(log_level)
    sc = scenario_arg(scenario)
    if tick_s < sc.sample_s * 8:
        fail(f"--tick-s {tick_s:g} gives fewer than 8 telemetry samples per window (sample_s = {sc.sample_s:g}): "
             "S2 would decide nothing")
    cfg = LearnConfig(hours=hours, tick_s=tick_s, seed=seed, cluster_id=cluster, refit_every=refit_every,
                      learn_window_s=learn_window_h * 3600.0 if learn_window_h > 0 else None)
    url = db or default_db_url(sc.name, sc.seed if seed is None else seed)
    engine = make_engine(url)
    try:
        init_db(engine)
        n = cfg.n_ticks
        step = every or max(1, int(round(3600.0 / tick_s)))
        if json_out:
            report = run_learn(sc, cfg, engine=engine)
        else:
            report = _run_with_progress(sc, cfg, engine, n, step)
    except ValueError as exc:
        fail(str(exc))
        return
    finally:
        engine.dispose()
    if json_out:
        emit(report, True)
        return
    s = report.summary
    emit({
        "scenario": f"{report.scenario} (seed {report.seed}), {n} ticks of {tick_s:g} s",
        "U of exercised edges, mean: first → last (factor)":
            f"{_f(s.mean_u_edges_first, '.3e')} → {_f(s.mean_u_edges_last, '.3e')} ({_f(s.mean_u_factor, '.1f')}×)",
        "U of exercised edges, median: first → last (factor)":
            f"{_f(s.median_u_edges_first, '.3e')} → {_f(s.median_u_edges_last, '.3e')} "
            f"({_f(s.median_u_factor, '.1f')}×)",
        "U factor from the seed priors (mean, median)":
            f"{_f(s.mean_u_factor_from_prior, '.1f')}×, {_f(s.median_u_factor_from_prior, '.1f')}×",
        "support share: first → last tick (first → last hour)":
            f"{_f(s.support_share_first)} → {_f(s.support_share_last)} "
            f"({_f(s.support_share_first_hour)} → {_f(s.support_share_last_hour)})",
        "ICP acceptance: first → last tick (first → last hour)":
            f"{_f(s.icp_accept_first)} → {_f(s.icp_accept_last)} "
            f"({_f(s.icp_accept_first_hour)} → {_f(s.icp_accept_last_hour)})",
        "Q1 rate: overall (first → last hour)":
            f"{_f(s.q1_rate_overall)} ({_f(s.q1_rate_first_hour)} → {_f(s.q1_rate_last_hour)})",
        "DRO radius ε: first → max (at tick) → last; median":
            f"{_f(s.epsilon_first)} → {_f(s.epsilon_max)} ({s.epsilon_max_tick}) → {_f(s.epsilon_last)}; "
            f"{_f(s.epsilon_median)}",
        **{f"median |error| {k}, last hour: base → learned %": f"{_f(v.before, '.1f')} → {_f(v.after, '.1f')}"
           for k, v in s.errors_last_hour.items()},
        "exercised edges / mechanisms": f"{s.exercised_edges} / {s.exercised_mechanisms}",
        "evidence rows / decided pairs": f"{s.evidence_rows} / {s.decided_pairs}",
        "wall time, s (cpu)": f"{report.timings.get('total')} ({report.timings.get('cpu')})",
        "database": report.database,
    }, False, title="koi learn: summary")


def _run_with_progress(sc: Any, cfg: Any, engine: Any, n: int, step: int) -> Any:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from koi.calibration.learn import run_learn
    from koi.calibration.learn_report import pool

    console.print(f"[bold]koi learn[/] {sc.name}: {n} ticks of {cfg.tick_s:g} s; a row every {step} tick(s): "
                  "counts and rates pooled over the row's ticks, U and ε at its last tick, errors (base physics "
                  "→ learned) the median over its ticks")
    console.print(_line([h for h, _ in _COLS]), style="bold", markup=False, highlight=False)
    prog = Progress(TextColumn("[bold]learning"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=console, transient=True)  # rows print above the bar, on stdout
    task = prog.add_task("learn", total=n)

    block: list[Any] = []

    def on_tick(r: Any) -> None:
        prog.update(task, completed=r.tick)
        block.append(r)
        if r.tick % step == 0 or r.tick == n:
            prog.console.print(_line(_row(pool(block), r.ranks)), markup=False, highlight=False)
            block.clear()

    with prog:
        return run_learn(sc, cfg, engine=engine, on_tick=on_tick)


def register(root: typer.Typer) -> None:
    root.command(name="learn")(learn)
