"""Ops commands on a running cluster: ``koi submit``, ``cancel``, ``status``, ``jobs``, ``ticks``, ``plan``, ``reset-tick``.

They talk to the cluster workflow through Temporal. This module is the CLI's thin
layer: the Temporal client code lives in ``workers/ops.py`` and is imported inside each
command, so ``koi`` itself (and the domain) never imports Temporal at import time.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import typer

from koi.cli.output import console, emit, fail, print_json, table

CLUSTER = typer.Option(None, "--cluster", "-c", help="cluster id (default: KOI_CLUSTER_ID)")
JSON = typer.Option(False, "--json", help="print one JSON document")


def _cluster(cluster: str | None) -> str:
    from koi.config import get_settings

    return cluster or get_settings().cluster_id


def _run(coro_fn: Any) -> Any:
    async def go() -> Any:
        from workers.client import connect

        try:
            client = await connect()
        except Exception as exc:  # noqa: BLE001 - one clear message instead of a gRPC trace
            from koi.config import get_settings

            fail(f"cannot reach Temporal at {get_settings().temporal_address}: {exc}. Start it with `koi up` or `koi dev`.")
        return await coro_fn(client)

    try:
        return asyncio.run(go())
    except typer.Exit:
        raise
    except Exception as exc:  # noqa: BLE001
        fail(f"{type(exc).__name__}: {exc}")


def load_jobs(path: Path) -> list[dict[str, Any]]:
    """A YAML or JSON file holding one job, a list of jobs, or ``{jobs: [...]}``."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror}")
    except yaml.YAMLError as exc:
        fail(f"{path} is not valid YAML/JSON: {exc}")
    if isinstance(data, dict) and "jobs" in data and "job_id" not in data:
        data = data["jobs"]
    jobs = data if isinstance(data, list) else [data]
    if not all(isinstance(j, dict) for j in jobs):
        fail(f"{path}: expected a job (a mapping) or a list of jobs")
    return jobs


def submit(
    path: Path = typer.Argument(..., help="YAML/JSON file: a job, or a list of jobs"),
    cluster: str | None = CLUSTER,
    wait: bool = typer.Option(False, "--wait", help="use the update: wait for accepted/rejected with the reason"),
    check: bool = typer.Option(True, "--check/--no-check", help="validate locally before sending"),
    json_out: bool = JSON,
) -> None:
    """Submit jobs to the cluster workflow (a signal; with --wait an update that answers accepted/rejected)."""
    from koi.domain import Job

    jobs = load_jobs(path)
    if check:
        for j in jobs:
            try:
                Job.model_validate(j)
            except Exception as exc:  # noqa: BLE001
                fail(f"job {j.get('job_id', '?')!r} is invalid (nothing sent):\n{exc}")
    cid = _cluster(cluster)

    async def go(client: Any) -> list[Any]:
        from workers import ops

        return [await ops.submit(client, cid, j, wait=wait) for j in jobs]

    results = _run(go)
    rows = [r.model_dump(mode="json") for r in results]
    emit(rows, json_out, title=f"submit → {cid}", columns=["job_id", "accepted", "reason"])
    if wait and not all(r.accepted for r in results):
        raise typer.Exit(1)


def cancel(job_id: str = typer.Argument(...), cluster: str | None = CLUSTER) -> None:
    """Cancel a job (signal ``cancel_job``); its ranks are released at the next committed tick."""
    cid = _cluster(cluster)

    async def go(client: Any) -> None:
        from workers import ops

        await ops.cancel(client, cid, job_id)

    _run(go)
    console.print(f"cancel_job {job_id} → {cid}")


def status(cluster: str | None = CLUSTER, json_out: bool = JSON) -> None:
    """The cluster workflow's state: tick, clock, jobs, deployments, recent outcomes."""
    cid = _cluster(cluster)

    async def go(client: Any) -> Any:
        from workers import ops

        return await ops.status(client, cid)

    st = _run(go)
    if json_out:
        print_json(st)
        return
    from workers.dev import ui_url

    head = {
        "cluster": st.cluster_id, "mode": st.mode, "next tick": st.next_tick, "ticks done": st.ticks_done,
        "world clock (s)": st.world_now, "jobs": ", ".join(f"{k} {v}" for k, v in sorted(st.jobs.items())) or "-",
        "ranks / GPUs": f"{st.deployments} / {st.gpus}", "committed / fallback / failed":
        f"{st.committed} / {st.fallback} / {st.failed}", "last committed tick": st.last_committed_tick,
        "runs (continue-as-new)": st.runs, "dropped signals": st.dropped_signals, "UI": ui_url(workflow_id=cid),
    }
    emit(head, False, title=f"koi status {cid}")
    if st.recent:
        console.print(table([b.model_dump(mode="json") for b in st.recent[-10:]], title="recent ticks",
                            columns=["tick", "outcome", "launched", "world_now", "reason"]))


def jobs(cluster: str | None = CLUSTER, json_out: bool = JSON) -> None:
    """The cluster's job queue as the workflow holds it."""
    cid = _cluster(cluster)

    async def go(client: Any) -> Any:
        from workers import ops

        return await ops.jobs(client, cid)

    rows = [j.model_dump(mode="json") for j in _run(go)]
    emit(rows, json_out, title=f"jobs of {cid}",
         columns=["job_id", "job_class", "model", "status", "submitted_at", "ranks", "gpus"])


def plan(cluster: str | None = CLUSTER, json_out: bool = JSON) -> None:
    """The last committed plan's summary and the live ranks."""
    cid = _cluster(cluster)

    async def go(client: Any) -> Any:
        from workers import ops

        return await ops.current_plan(client, cid)

    cp = _run(go)
    if json_out:
        print_json(cp)
        return
    emit({"tick": cp.tick, **(cp.plan.model_dump(mode="json") if cp.plan else {})}, False, title="current plan")
    emit([d.model_dump(mode="json") for d in cp.deployments], False, title="live ranks",
         columns=["job_id", "env_id", "n_replicas", "gpus", "state", "since_tick"])


def ticks(
    cluster: str | None = CLUSTER,
    limit: int = typer.Option(20, help="how many recent ticks"),
    json_out: bool = JSON,
) -> None:
    """Recent ticks with their outcome: committed, fallback (keep-all, with the reason), failed, running."""
    cid = _cluster(cluster)

    async def go(client: Any) -> Any:
        from workers import ops

        return await ops.list_tick_records(client, cid, limit=limit)

    rows = [r.as_dict() for r in _run(go)]
    emit(rows, json_out, title=f"ticks of {cid}", columns=["tick", "outcome", "reset", "started", "reason"])


def reset_tick(
    tick: int = typer.Argument(..., help="the tick number n (workflow id <cluster>-tick-<n>)"),
    cluster: str | None = CLUSTER,
    stage: str | None = typer.Option(None, help="re-run this stage (default: the stage that failed)"),
    event_id: int | None = typer.Option(None, help="reset to this WorkflowTaskCompleted event id instead"),
    reason: str = typer.Option("koi reset-tick", help="recorded with the reset"),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="wait for the new run's outcome"),
    dry_run: bool = typer.Option(False, "--dry-run", help="only show the reset point and the `temporal` command"),
    json_out: bool = JSON,
) -> None:
    """Reset a tick at the step that failed, so it runs again (the fence refuses it if a newer tick committed)."""
    cid = _cluster(cluster)

    async def go(client: Any) -> Any:
        from workers import ops

        return await ops.reset_tick(client, cid, tick, stage=stage, event_id=event_id, reason=reason,
                                    wait=wait and not dry_run, dry_run=dry_run)

    out = _run(go)
    emit(out, json_out, title=f"reset {cid}-tick-{tick}")
    if wait and out.get("outcome") not in (None, "committed"):
        raise typer.Exit(1)


cluster_app = typer.Typer(help="Start or stop the cluster workflow.", no_args_is_help=True)


@cluster_app.command("start")
def cluster_start(
    cluster: str | None = CLUSTER,
    mode: str | None = typer.Option(None, help="simulated (advance the world per tick) or live (wall-clock timer); "
                                               "default: live on a real fleet (KOI_WORLD=aws|gcp), else simulated"),
    scenario: str = typer.Option("demo", help="the simulated world: a scenario name or a YAML path"),
    interval: float | None = typer.Option(None, help="tick interval, seconds (default KOI_TICK_INTERVAL_S)"),
    pace: float = typer.Option(0.0, help="simulated mode: real seconds between ticks"),
    max_ticks: int | None = typer.Option(None, help="stop after this many ticks"),
    proposer: str | None = typer.Option(None, help="S4 proposer: deterministic (default) or rlm"),
    trajectories: int = typer.Option(1, min=1, max=16, help="S4 proposals per tick (child workflows when > 1)"),
    json_out: bool = JSON,
) -> None:
    """Start the cluster workflow (nothing happens when it already runs)."""
    from koi.config import get_settings

    world = get_settings().world
    mode = mode or ("simulated" if world == "sim" else "live")
    if mode not in ("simulated", "live"):
        fail("--mode is simulated or live")
    if world != "sim" and mode == "simulated":
        # simulated mode ticks as fast as the stages run: on a real fleet that is a plan (and maybe a swap)
        # every few seconds, with no time for telemetry to accrue between them
        fail(f"KOI_WORLD={world} is a real fleet on the wall clock: start the cluster with --mode live")
    cid = _cluster(cluster)

    async def go(client: Any) -> Any:
        from koi.config import get_settings
        from workers import ops
        from workflows.types import TickOptions

        opts = TickOptions(plan_task_queue=get_settings().plan_task_queue, trajectories=trajectories)
        h = await ops.start_cluster(client, cluster_id=cid, mode=mode, scenario=scenario, interval_s=interval,
                                    sim_pace_s=pace, max_ticks=max_ticks, proposer=proposer, tick_options=opts)
        return {"cluster": h.id, "run_id": h.run_id or h.result_run_id, "mode": mode, "scenario": scenario}

    emit(_run(go), json_out, title="cluster start")


@cluster_app.command("stop")
def cluster_stop(cluster: str | None = CLUSTER) -> None:
    """Ask the cluster workflow to finish after its current tick (signal ``stop``)."""
    cid = _cluster(cluster)

    async def go(client: Any) -> None:
        from workers import ops

        await ops.stop_cluster(client, cid)

    _run(go)
    console.print(f"stop → {cid}")


def register(app: typer.Typer) -> None:
    app.add_typer(cluster_app, name="cluster")
    app.command("submit")(submit)
    app.command("cancel")(cancel)
    app.command("status")(status)
    app.command("jobs")(jobs)
    app.command("current-plan")(plan)
    app.command("ticks")(ticks)
    app.command("reset-tick")(reset_tick)
