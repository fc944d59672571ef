"""Worker entry points: the tick task queue and the planning task queue.

``koi worker`` (and ``python -m workers``) runs one process polling

- the tick queue (``KOI_TICK_TASK_QUEUE``, default ``koi-ticks``): the cluster, tick and
  trajectory workflows and every stage activity;
- the planning queue (``KOI_PLAN_TASK_QUEUE``, default ``koi-planning``): S4 (the
  planner, possibly slow LLM trajectories) and the trajectory workflows.

Either queue can be served alone (``--queue ticks`` / ``--queue planning``) to scale them
apart. Activities are synchronous and run in a thread pool.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from temporalio.client import Client
from temporalio.worker import Worker
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner, SandboxRestrictions

from activities.tick import PlanningActivities, TickActivities
from koi.config import Settings, get_settings
from koi.logging import get_logger
from koi.pipeline.runtime import Runtime
from workflows import WORKFLOWS

log = get_logger(__name__)


def build_workers(
    client: Client,
    runtime: Runtime,
    *,
    queues: Sequence[str] = ("ticks", "planning"),
    settings: Settings | None = None,
    tick_queue: str | None = None,
    plan_queue: str | None = None,
    max_concurrent_activities: int = 4,
    activity_overrides: Sequence[Any] = (),
    **worker_kwargs: Any,
) -> tuple[list[Worker], ThreadPoolExecutor]:
    """The workers of one process; ``activity_overrides`` replace activities by name (tests)."""
    s = settings or get_settings()
    worker_kwargs.setdefault("workflow_runner", workflow_runner())
    _warm_caches()
    pool = ThreadPoolExecutor(max_workers=max_concurrent_activities + 2, thread_name_prefix="koi-activity")
    tick_acts = TickActivities(runtime).all()
    plan_acts = PlanningActivities(runtime).all() + agent_activities(runtime)
    workers = []
    for q in queues:
        if q == "ticks":
            name, acts, wfs = tick_queue or s.tick_task_queue, tick_acts + plan_acts, WORKFLOWS
        elif q == "planning":
            name, acts, wfs = plan_queue or s.plan_task_queue, plan_acts, WORKFLOWS
        else:
            raise ValueError(f"unknown queue {q!r}: ticks or planning")
        acts = _override(acts, activity_overrides)
        workers.append(
            Worker(
                client,
                task_queue=name,
                workflows=wfs,
                activities=acts,
                activity_executor=pool,
                max_concurrent_activities=max_concurrent_activities,
                **worker_kwargs,
            )
        )
    return workers, pool


def agent_activities(runtime: Runtime, **kw: Any) -> list[Any]:
    """The RLM planner's trajectory activities (``activities/agent.py``), when koi.agent is installed."""
    try:
        from activities.agent import AgentActivities
    except ImportError as exc:  # the planner is optional for a worker: S4 falls back to the deterministic one
        log.warning("worker.no_rlm_planner", error=str(exc))
        return []
    return AgentActivities(runtime, **kw).all()


def workflow_runner() -> SandboxedWorkflowRunner:
    """The sandbox, with Koi's domain (pure, deterministic) and its YAML catalogs passed through.

    Domain models validate lazily against the catalogs (``koi.catalog``); without the
    pass-through the sandbox would re-import the catalogs and YAML inside every workflow run.
    """
    return SandboxedWorkflowRunner(restrictions=SandboxRestrictions.default.with_passthrough_modules("koi", "yaml"))


def _activity_name(fn: Any) -> str:
    from temporalio.activity import _Definition

    defn = _Definition.from_callable(fn)
    return defn.name if defn and defn.name else getattr(fn, "__name__", "?")


def _override(acts: list[Any], overrides: Sequence[Any]) -> list[Any]:
    if not overrides:
        return acts
    names = {_activity_name(o) for o in overrides}
    return [a for a in acts if _activity_name(a) not in names] + list(overrides)


def _warm_caches() -> None:
    """Load the catalogs outside the workflow sandbox (the update validator uses them)."""
    from koi.catalog import models

    models()


async def run_worker(
    runtime: Runtime | None = None,
    *,
    queues: Sequence[str] = ("ticks", "planning"),
    settings: Settings | None = None,
    client: Client | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Run until SIGINT/SIGTERM (or ``stop``); a graceful shutdown lets running activities finish."""
    from workers.client import connect
    from workers.runtime import build_runtime

    s = settings or get_settings()
    client = client or await connect(s)
    runtime = runtime or build_runtime(s)
    workers, pool = build_workers(client, runtime, queues=queues, settings=s)
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not the main thread
            loop.add_signal_handler(sig, stop.set)
    if s.metrics_port:
        from infra.metrics import METRICS

        METRICS.serve(s.metrics_port, s.metrics_addr)
    log.info("worker.start", address=s.temporal_address, queues=[w.task_queue for w in workers])
    tasks = [asyncio.create_task(w.run()) for w in workers]
    try:
        done, _ = await asyncio.wait([*tasks, asyncio.create_task(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
        for t in done:
            if t in tasks and t.exception():
                raise t.exception()  # type: ignore[misc]
    finally:
        await asyncio.gather(*(w.shutdown() for w in workers), return_exceptions=True)
        pool.shutdown(wait=False, cancel_futures=True)
        log.info("worker.stop")
