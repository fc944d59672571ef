"""``koi bench run|report|jobs|diff|policies``: the benchmark suite (issue 8) from the command line.

``koi bench run --scenario hetero-3h --policies all --seeds 3 [--hours H] [--jobs 2]`` runs every
(policy, seed) not already cached, in ``--jobs`` worker processes (each runs whole runs), with
a progress bar for the suite and one per running run (ticks); then writes the tables and
figures under ``KOI_DATA_DIR/bench/<scenario>/report/`` and prints the main table.
``koi bench report --scenario hetero-3h`` rebuilds them from the cache; ``--json`` prints one
JSON document (every policy's mean and std of every metric). ``koi bench jobs --policies koi,milp``
breaks the cached runs down by job (:mod:`koi.bench.jobs`: where each policy's dollars, GPU-hours, swaps and
SLO misses go). ``koi bench diff report.json`` says whether the cache's runs reproduce a published
report, field by field (:mod:`koi.bench.diff`).

Ctrl-C or SIGTERM stops a suite: queued runs are dropped and running ones terminated (finished
runs stay cached, so the same command resumes); a worker whose suite process died some other way
(SIGKILL, out of memory) notices within a second and exits instead of finishing a run for nobody.

Extra policies (experiments, tests) register themselves when their module is imported: name the
modules in ``KOI_BENCH_POLICY_MODULES`` (comma-separated) and every worker imports them.

``--via temporal`` runs each run through Temporal instead (a local dev server, a worker and
the ClusterWorkflow in simulated mode), one run at a time in a child process
(``python -m workers.bench``: the orchestration rooms stay out of ``koi/``); those runs are
cached apart (``runs-temporal/``) and reported with ``koi bench report --via temporal``.
"""

from __future__ import annotations

import json
import os
import queue as queue_mod
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import typer

from koi.cli.output import console, emit, err_console, fail

app = typer.Typer(help="Benchmarks: run policies on scenarios (cached), rebuild the paper's tables and figures.",
                  no_args_is_help=True)

JSON = typer.Option(False, "--json", help="print one JSON document")
SCENARIO = typer.Option("hetero-3h", "--scenario", help="a scenario name (koi/bench/scenarios, demo) or a YAML path")
CACHE = typer.Option(None, "--cache-dir", help="cache root (default: KOI_DATA_DIR/bench)")
VIA = typer.Option("in-process", "--via", help="in-process | temporal")


def _quiet(verbose: bool) -> None:
    from koi.logging import configure, log_numeric_warnings

    configure(level="INFO" if verbose else "WARNING")
    log_numeric_warnings()  # logged once per place, never hidden


def _plugins() -> None:
    """Import the modules named in ``KOI_BENCH_POLICY_MODULES`` (comma-separated): extra policies
    register themselves on import, here and in every worker process."""
    import importlib

    for name in [m.strip() for m in os.environ.get("KOI_BENCH_POLICY_MODULES", "").split(",") if m.strip()]:
        importlib.import_module(name)


def _policies(names: str) -> list[Any]:
    from koi.bench.policy import all_policies, get_policy
    from koi.config import get_settings

    _plugins()

    if names.strip().lower() == "all":
        specs = all_policies(llm_configured=bool(get_settings().llm_base_url))
        if not specs:
            fail("no policies are registered (koi.bench.policies has not landed)")
        return specs
    out = []
    for n in [x.strip() for x in names.split(",") if x.strip()]:
        try:
            out.append(get_policy(n))
        except KeyError as exc:
            fail(str(exc.args[0]))
    return out


# ---- worker processes ---------------------------------------------------------------------------------------
def _init_worker(verbose: bool, parent: int | None = None) -> None:
    _quiet(verbose)
    _plugins()
    if parent is not None:
        _exit_with_parent(parent)


#: how often a worker checks that the suite process that started it is still there
PARENT_POLL_S = 1.0


def _exit_with_parent(parent: int) -> None:
    """End this worker when the suite process is gone (SIGKILL, OOM, a crash): a pool worker
    otherwise runs its 12-hour run to the end for nobody, and holds a core while it does
    (reparented processes see another parent id)."""
    def watch() -> None:
        while True:
            time.sleep(PARENT_POLL_S)
            if os.getppid() != parent:
                os._exit(143)

    threading.Thread(target=watch, name="koi-bench-parent-watch", daemon=True).start()


def _terminate_on_sigterm() -> Any:
    """SIGTERM in the suite process raises KeyboardInterrupt (as Ctrl-C does), so the pool is shut
    down and the workers are stopped instead of being orphaned; returns the previous handler."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    return signal.signal(signal.SIGTERM, handler)


def _run_in_worker(spec: Any, cache_dir: str | None, fresh: bool, q: Any, keep_store: bool = False) -> dict[str, Any]:
    from koi.bench.runner import run_one

    rid = f"{spec.policy}/{spec.seed}"

    def tick(done: int, total: int) -> None:
        q.put(("tick", rid, done, total))

    q.put(("start", rid, 0, 0))
    r = run_one(spec.scenario, spec.policy, spec.seed, hours=spec.hours, cache_dir=cache_dir, fresh=fresh, on_tick=tick,
                keep_store=keep_store)
    q.put(("done", rid, 0, 0))
    return _brief(r)


def _brief(r: Any) -> dict[str, Any]:
    m = r.metrics
    return {"policy": r.key.policy, "seed": r.key.seed, "hours": r.key.hours, "cached": r.cached,
            "via": r.meta.via, "wall_s": r.meta.wall_s, "cpu_s": r.meta.cpu_s, "load_after": r.meta.load_after,
            "ticks": r.meta.n_ticks, "fallback_ticks": r.meta.ticks_fallback,
            "clock_bound_ticks": sorted({c["tick"] for c in r.meta.clock_bound or []}), "composite": m.composite,
            "goodput_tok_s": m.goodput_tok_s, "cluster_id": r.meta.cluster_id, "store": r.meta.store}


def _progress():  # noqa: ANN202 - rich Progress
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err_console, transient=False)


def longest_first(todo: list[Any]) -> list[Any]:
    """Runs in the order a pool should start them: the costliest policies first (each policy's
    ``relative_cost``), ties in the given order — longest processing time first, so the last
    minutes of a suite are short runs on every worker, not one long run on one."""
    from koi.bench.policy import get_policy

    return sorted(todo, key=lambda s: -get_policy(s.policy).relative_cost)


def _run_parallel(todo: list[Any], cache_dir: str | None, fresh: bool, jobs: int, verbose: bool,
                  show: bool, keep_store: bool = False) -> list[dict[str, Any]]:
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    ctx = mp.get_context("spawn")
    manager = ctx.Manager()
    q = manager.Queue()
    out: list[dict[str, Any]] = []
    prog = _progress() if show else None
    bars: dict[str, Any] = {}
    previous = _terminate_on_sigterm()
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_init_worker,
                               initargs=(verbose, os.getpid()))  # fmt: skip
    try:
        futs = {pool.submit(_run_in_worker, s, cache_dir, fresh, q, keep_store): s for s in longest_first(todo)}
        if prog:
            prog.start()
            overall = prog.add_task("suite", total=len(todo))
        pending = set(futs)
        while pending:
            done, pending = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
            _drain(q, prog, bars)
            for f in done:
                s = futs[f]
                try:
                    out.append(f.result())
                except Exception as exc:  # noqa: BLE001 - one failed run does not stop the suite
                    err_console.print(f"[red]run {s.policy} seed {s.seed} failed:[/] {type(exc).__name__}: {exc}")
                    out.append({"policy": s.policy, "seed": s.seed, "error": f"{type(exc).__name__}: {exc}"})
                if prog:
                    prog.advance(overall)
        _drain(q, prog, bars)
        pool.shutdown(wait=True)
    except BaseException:
        # interrupted (Ctrl-C, SIGTERM): drop the queued runs and stop the running ones now (a plain
        # shutdown would wait for them to finish); finished runs are already in the cache
        procs = list((getattr(pool, "_processes", None) or {}).values())  # the stdlib keeps no public handle
        pool.shutdown(wait=False, cancel_futures=True)
        for proc in procs:
            proc.terminate()
        raise
    finally:
        if prog:
            prog.stop()
        manager.shutdown()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    return out


def _drain(q: Any, prog: Any, bars: dict[str, Any]) -> None:
    while True:
        try:
            kind, rid, done, total = q.get_nowait()
        except queue_mod.Empty:
            return
        if prog is None:
            continue
        if kind == "start" and rid not in bars:
            bars[rid] = prog.add_task(f"  {rid}", total=None)
        elif kind == "tick" and rid in bars:
            prog.update(bars[rid], completed=done, total=total)
        elif kind == "done" and rid in bars:
            prog.remove_task(bars.pop(rid))


def _run_serial(todo: list[Any], cache_dir: str | None, fresh: bool, show: bool,
                keep_store: bool = False) -> list[dict[str, Any]]:
    from koi.bench.runner import run_one

    out = []
    prog = _progress() if show else None
    if prog:
        prog.start()
        overall = prog.add_task("suite", total=len(todo))
    try:
        for s in todo:
            task = prog.add_task(f"  {s.policy}/{s.seed}", total=None) if prog else None

            def tick(done: int, total: int, task: Any = task) -> None:
                if prog:
                    prog.update(task, completed=done, total=total)

            try:
                out.append(_brief(run_one(s.scenario, s.policy, s.seed, hours=s.hours, cache_dir=cache_dir,
                                          fresh=fresh, on_tick=tick, keep_store=keep_store)))
            except Exception as exc:  # noqa: BLE001
                err_console.print(f"[red]run {s.policy} seed {s.seed} failed:[/] {type(exc).__name__}: {exc}")
                out.append({"policy": s.policy, "seed": s.seed, "error": f"{type(exc).__name__}: {exc}"})
            if prog:
                prog.remove_task(task)
                prog.advance(overall)
    finally:
        if prog:
            prog.stop()
    return out


def _run_temporal(todo: list[Any], cache_dir: str | None, fresh: bool, verbose: bool) -> list[dict[str, Any]]:
    """Each run through Temporal in a child process (``python -m workers.bench``), one at a time."""
    out = []
    for s in todo:
        cmd = [sys.executable, "-m", "workers.bench", "--scenario", str(s.scenario), "--policy", s.policy,
               "--seed", str(s.seed)]
        if s.hours is not None:
            cmd += ["--hours", str(s.hours)]
        if cache_dir:
            cmd += ["--cache-dir", str(cache_dir)]
        if fresh:
            cmd.append("--fresh")
        if verbose:
            cmd.append("--verbose")
        err_console.print(f"[bold]temporal[/] {s.policy} seed {s.seed} …")
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
        if proc.returncode != 0:
            out.append({"policy": s.policy, "seed": s.seed, "error": f"workers.bench exited {proc.returncode}"})
            continue
        out.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    return out


# ---- commands ---------------------------------------------------------------------------------------------
def _print_table(rep: Any) -> None:
    """The report's tables on the terminal; the headers are the report's own (:data:`koi.bench.report.MAIN_COLUMNS`),
    so a column added there shows here."""
    from koi.bench.paired import CLAIM_COLS, PAIRED_COLS, claim_table_rows, paired_table_rows
    from koi.bench.report import LLM_COLS, MAIN_COLUMNS, ablation_rows, cell, llm_rows, main_rows

    main_cols = ["Method", *(header for _m, header, _s, _hi, _p in MAIN_COLUMNS)]

    def rows_of(prs: list[Any]) -> list[dict[str, str]]:
        rows = []
        for r in prs:
            row = {"Method": r.label + (" (upper bound)" if r.is_oracle else "")}
            for m, header, scale, _hi, _p in MAIN_COLUMNS:
                row[header] = cell(r.stats[m], scale, len(r.seeds))
            rows.append(row)
        return rows

    emit(rows_of(main_rows(rep.rows)), False, title=f"{rep.scenario}: {rep.hours:g} h, mean ± std over seeds",
         columns=main_cols)
    abl = ablation_rows(rep.rows)
    if len(abl) > 1:
        emit(rows_of(abl), False, title="ablations", columns=main_cols)
    llm = llm_rows(rep.rows)
    if llm:
        emit(llm, False, title="language models: whose plans the ticks proposed, and what the model was asked for",
             columns=LLM_COLS)
    if rep.paired:
        emit(paired_table_rows(rep.paired), False, columns=PAIRED_COLS,
             title="Koi − each policy, paired by seed: mean ± s.e. (seeds Koi was better)")
    if rep.claims:
        emit(claim_table_rows(rep.claims), False, columns=CLAIM_COLS, title="the paper's claims on these runs")
    console.print(f"report: {rep.files['markdown']}")


@app.command()
def run(
    scenario: str = SCENARIO,
    policies: str = typer.Option("all", "--policies", help="'all' or comma-separated policy names"),
    seeds: int = typer.Option(3, "--seeds", min=1, help="how many seeds (first-seed … first-seed + N − 1)"),
    first_seed: int = typer.Option(0, "--first-seed", min=0),
    hours: float | None = typer.Option(None, "--hours", help="simulated hours (default: the scenario's duration)"),
    jobs: int = typer.Option(2, "--jobs", min=1, help="worker processes (each runs whole runs)"),
    fresh: bool = typer.Option(False, "--fresh", help="recompute runs even when cached"),
    via: str = VIA,
    cache_dir: Path | None = CACHE,
    no_report: bool = typer.Option(False, "--no-report", help="skip the tables and figures"),
    verbose: bool = typer.Option(False, "--verbose", help="the pipeline's logs on stderr"),
    keep_store: bool = typer.Option(False, "--keep-store",
                                    help="keep each run's SQLite store (for koi plan replay, koi why); with --fresh "
                                         "for runs already cached"),
    json_out: bool = JSON,
) -> None:
    """Run policies × seeds on a scenario (cached runs are not recomputed), then report."""
    from koi.bench.cache import RunCache
    from koi.bench.report import rebuild
    from koi.bench.runner import RunSpec, load, n_ticks_for, run_key

    _quiet(verbose)
    if via not in ("in-process", "temporal"):
        fail(f"--via must be in-process or temporal, not {via!r}")
    if keep_store and via == "temporal":
        fail("--keep-store keeps the in-process runner's SQLite store; a run --via temporal writes to the workers' store")
    try:
        sc, path = load(scenario)
    except (FileNotFoundError, ValueError) as exc:
        fail(str(exc))
        return
    specs = _policies(policies)
    h, _n = n_ticks_for(sc, hours)
    target = str(path) if path is not None else scenario
    todo_all = [RunSpec(target, p.name, s, h) for p in specs for s in range(first_seed, first_seed + seeds)]
    cache = RunCache(str(cache_dir) if cache_dir else None, via=via)
    from koi.bench.cache import code_digest
    from koi.numerics import kernels

    hits = {s: None if fresh else cache.load(run_key(sc, s.policy, s.seed, h)) for s in todo_all}
    todo = [s for s in todo_all if hits[s] is None]
    cached = [s for s in todo_all if s not in todo]
    stale = [s for s in cached if hits[s].meta.code_digest != code_digest()]  # type: ignore[union-attr]
    if stale and not json_out:
        err_console.print(f"[yellow]{len(stale)} cached run(s) were made by other code; --fresh recomputes them[/]")
    here = kernels()
    other = [s for s in cached if hits[s].meta.kernels not in ("", here)]  # type: ignore[union-attr]
    if other and not json_out:
        theirs = "; ".join(sorted({hits[s].meta.kernels for s in other}))  # type: ignore[union-attr]
        err_console.print(f"[yellow]{len(other)} cached run(s) were made with other numeric kernels ({theirs}; "
                          f"here: {here}) and may differ from a run made here; --fresh recomputes them[/]")
    show = not json_out and sys.stderr.isatty() or os.environ.get("KOI_PROGRESS") == "1"
    if not json_out:
        err_console.print(f"{sc.name}: {len(specs)} policies × {seeds} seeds, {h:g} h; {len(cached)} cached, "
                          f"{len(todo)} to run ({'temporal' if via == 'temporal' else f'{min(jobs, max(len(todo), 1))} process(es)'}); "
                          f"{here}")
    t0 = time.perf_counter()
    cd = str(cache_dir) if cache_dir else None
    if via == "temporal":
        ran = _run_temporal(todo, cd, fresh, verbose)
    elif jobs > 1 and len(todo) > 1:
        ran = _run_parallel(todo, cd, fresh, min(jobs, len(todo)), verbose, show, keep_store)
    else:
        ran = _run_serial(todo, cd, fresh, show, keep_store)
    wall = time.perf_counter() - t0
    briefs = [{"policy": s.policy, "seed": s.seed, "cached": True, "stale_code": s in stale} for s in cached] + ran
    load_avg = os.getloadavg() if hasattr(os, "getloadavg") else None
    doc: dict[str, Any] = {"scenario": sc.name, "hours": h, "via": via, "wall_s": round(wall, 2),
                           "load_avg": list(load_avg) if load_avg else None, "runs": briefs}
    errors = [b for b in ran if "error" in b]
    if not no_report:
        try:
            rep = rebuild(target, cache_dir=cd, hours=h, via=via)
            doc["report"] = rep.json()
        except LookupError as exc:
            rep = None
            doc["report"] = None
            err_console.print(f"[yellow]{exc}[/]")
    else:
        rep = None
    if json_out:
        emit(doc, True)
    else:
        err_console.print(f"suite wall {wall:.1f} s, load average {', '.join(f'{x:.2f}' for x in load_avg or [])}")
        for b in ran:
            if b.get("clock_bound_ticks"):
                err_console.print(f"[yellow]{b['policy']} seed {b['seed']}: a wall-clock limit cut the planning of "
                                  f"tick(s) {', '.join(map(str, b['clock_bound_ticks']))}; another machine may not "
                                  "reproduce this run[/]")
            if b.get("store"):
                err_console.print(f"store of {b['policy']} seed {b['seed']}: koi plan replay TICK "
                                  f"--cluster {b['cluster_id']} --url sqlite:///{b['store']}")
        if rep is not None:
            _print_table(rep)
    if errors:
        raise typer.Exit(1)


@app.command()
def report(
    scenario: str = SCENARIO,
    hours: float | None = typer.Option(None, "--hours", help="the horizon to report (default: the scenario's)"),
    via: str = VIA,
    cache_dir: Path | None = CACHE,
    no_figures: bool = typer.Option(False, "--no-figures"),
    policies: str = typer.Option("all", "--policies", help="'all' (every cached one) or comma-separated names"),
    seeds: int | None = typer.Option(None, "--seeds", min=1,
                                     help="only seeds first-seed … first-seed + N − 1 (default: every cached one)"),
    first_seed: int = typer.Option(0, "--first-seed", min=0),
    json_out: bool = JSON,
) -> None:
    """Rebuild the tables and figures from cached runs (runs scored by an older evaluator are re-scored
    from their records); --json prints each policy's mean metrics."""
    from koi.bench.report import rebuild

    _quiet(False)
    names = None if policies.strip().lower() == "all" else {p.name for p in _policies(policies)}
    chosen = None if seeds is None else set(range(first_seed, first_seed + seeds))
    try:
        rep = rebuild(scenario, cache_dir=str(cache_dir) if cache_dir else None, hours=hours, via=via,
                      figures=not no_figures, policies=names, seeds=chosen)
    except (LookupError, FileNotFoundError, ValueError) as exc:
        fail(str(exc))
        return
    if json_out:
        emit(rep.json(), True)
        return
    _print_table(rep)


@app.command()
def jobs(
    scenario: str = SCENARIO,
    policies: str = typer.Option("koi,milp", "--policies", help="comma-separated names, in the table's order"),
    hours: float | None = typer.Option(None, "--hours", help="the horizon to report (default: the scenario's)"),
    via: str = VIA,
    cache_dir: Path | None = CACHE,
    seeds: int | None = typer.Option(None, "--seeds", min=1,
                                     help="only seeds first-seed … first-seed + N − 1 (default: every cached one)"),
    first_seed: int = typer.Option(0, "--first-seed", min=0),
    json_out: bool = JSON,
) -> None:
    """Break cached runs down by job: each policy's dollars (by market), GPU-hours, swaps and SLO attainment
    per job (mean over seeds), the jobs where the policies' dollars differ most first, then the reserved
    capacity no job held; also written as jobs.md in the report directory."""
    from koi.bench.cache import RunCache
    from koi.bench.jobs import JOB_COLUMNS, display_rows, job_breakdown, markdown
    from koi.bench.report import select_runs

    _quiet(False)
    names = [p.name for p in _policies(policies)]
    chosen = None if seeds is None else set(range(first_seed, first_seed + seeds))
    cd = str(cache_dir) if cache_dir else None
    try:
        name, _digest, h, runs = select_runs(scenario, cache_dir=cd, hours=hours, via=via, policies=set(names),
                                             seeds=chosen)
    except (FileNotFoundError, ValueError) as exc:
        fail(str(exc))
        return
    missing = [p for p in names if not any(r.key.policy == p for r in runs)]
    if missing:
        fail(f"no cached runs of {scenario!r} (hours {h:g}) for {', '.join(missing)}; "
             f"run `koi bench run --scenario {scenario} --policies {','.join(missing)}` first")
        return
    cache = RunCache(cd, via=via)
    try:
        rows = job_breakdown(runs, lambda r: cache.records(r.key))
    except (FileNotFoundError, ValueError) as exc:
        fail(str(exc))
        return
    rows.sort(key=lambda r: names.index(r.policy))
    seeds_of = {p: sorted(r.key.seed for r in runs if r.key.policy == p) for p in names}
    title = f"{name}: {h:g} h, per job, mean over seeds " + "; ".join(
        f"{p} {','.join(map(str, s))}" for p, s in seeds_of.items())
    out = cache.report_dir(name) / "jobs.md"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(rows, title))
    if json_out:
        emit({"scenario": name, "hours": h, "seeds": seeds_of, "jobs": [r.model_dump(mode="json") for r in rows],
              "markdown": str(out)}, True)
        return
    emit(display_rows(rows), False, title=title, columns=JOB_COLUMNS)
    console.print(f"written: {out}")


def _run_commands(missing: dict[str, list[int]], scenario: Any, cache_dir: Path | None) -> list[str]:
    """`koi bench run` commands that make the missing runs: policies grouped by their seeds, a seed range as
    --seeds/--first-seed (a range with gaps makes the whole range; cached runs are not made again)."""
    groups: dict[tuple[int, ...], list[str]] = {}
    for p, seeds in sorted(missing.items()):
        groups.setdefault(tuple(sorted(seeds)), []).append(p)
    tail = f" --cache-dir {cache_dir}" if cache_dir else ""
    return [f"koi bench run --scenario {scenario} --policies {','.join(ps)} --seeds {ss[-1] - ss[0] + 1} "
            f"--first-seed {ss[0]}{tail}" for ss, ps in groups.items()]


@app.command()
def diff(
    base: Path = typer.Argument(..., help="a report's JSON: report.json, summary.json or `koi bench report --json`"),
    against: Path | None = typer.Option(None, "--against", help="another report's JSON (default: the cache's runs "
                                                                "of the base's policies and seeds)"),
    scenario: str | None = typer.Option(None, "--scenario", help="the scenario (default: the one the base names)"),
    via: str = VIA,
    cache_dir: Path | None = CACHE,
    rel_tol: float = typer.Option(1e-9, "--rel-tol", min=0.0, help="numbers equal within this relative tolerance"),
    abs_tol: float = typer.Option(0.0, "--abs-tol", min=0.0, help="… or within this absolute one"),
    policies: str = typer.Option("all", "--policies", help="'all' (the base's) or comma-separated names: compare "
                                                           "only these rows (and Koi's paired rows; not the claims)"),
    limit: int = typer.Option(40, "--limit", min=1, help="differences to list"),
    json_out: bool = JSON,
) -> None:
    """Does a benchmark reproduce? Compare a report's figures — every policy's mean and std of every metric,
    Koi paired by seed, the claims — with another report or with the cached runs of the same policies and
    seeds; exit 1 when any differs (wall seconds and kernels are not compared)."""
    from koi.bench.diff import cached_counterpart, compare, restrict

    _quiet(False)
    docs = []
    for p in (base, against):
        if p is None:
            continue
        try:
            docs.append(json.loads(p.read_text(encoding="utf-8")))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            fail(f"cannot read {p}: {exc}")
            return
    try:
        if policies.strip().lower() != "all":
            names = {p.strip() for p in policies.split(",") if p.strip()}
            docs = [restrict(d, names, strict=i == 0) for i, d in enumerate(docs)]
        if against is None:
            cc = cached_counterpart(docs[0], scenario=scenario, cache_dir=str(cache_dir) if cache_dir else None,
                                    via=via)
            if cc.missing_runs:
                miss = "; ".join(f"{p} seeds {', '.join(map(str, s))}" for p, s in sorted(cc.missing_runs.items()))
                fail(f"the cache lacks runs the base was made of ({miss}); make them with "
                     + " and ".join(f"`{c}`" for c in _run_commands(cc.missing_runs, scenario or docs[0].get("scenario"),
                                                                   cache_dir)))
                return
            docs.append(cc.doc)
        res = compare(docs[0], docs[1], rel_tol=rel_tol, abs_tol=abs_tol)
    except (LookupError, FileNotFoundError, ValueError) as exc:
        fail(str(exc))
        return
    if json_out:
        emit({**res.model_dump(mode="json"), "equal": res.equal}, True)
    else:
        other = str(against) if against is not None else "the cached runs"
        if res.equal:
            console.print(f"[green]equal[/]: {res.scenario}, {res.compared:,} fields of {base} and {other} "
                          f"(rel. tol {rel_tol:g}, abs. tol {abs_tol:g}; wall seconds and kernels not compared)")
        else:
            def show(x: Any) -> Any:
                return f"{x:.10g}" if isinstance(x, float) else x

            rows = [{"field": d.path, "base": show(d.base), "other": show(d.other),
                     "Δ": "" if d.delta is None else f"{d.delta:+.6g}", "what": d.what} for d in res.differences[:limit]]
            rows += [{"field": f"policies.{p}", "base": "(row)", "other": None, "Δ": "", "what": "missing"}
                     for p in res.missing_policies]
            emit(rows, False, title=f"{res.scenario}: {len(res.differences) + len(res.missing_policies)} of "
                                    f"{res.compared:,} fields differ ({base} against {other})",
                 columns=["field", "base", "other", "Δ", "what"])
            if len(res.differences) > limit:
                console.print(f"… and {len(res.differences) - limit} more (--limit, --json)")
    if not res.equal:
        raise typer.Exit(1)


@app.command()
def policies(json_out: bool = JSON) -> None:
    """The registered policies in table order."""
    from koi.bench.policy import all_policies

    rows = [{"name": p.name, "label": p.label, "family": p.family.value, "S2": p.run_s2, "S3": p.run_s3,
             "needs_llm": p.needs_llm, "stochastic": p.stochastic} for p in all_policies(llm_configured=True)]
    emit(rows, json_out, title=f"{len(rows)} policies")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="bench")
