"""A benchmark run through Temporal: the same run as ``koi.bench.runner.run_one``, as durable workflows.

``koi bench run --via temporal`` runs ``python -m workers.bench`` per run (the orchestration
rooms stay out of ``koi/``); tests call :func:`run_via_temporal` with the shared dev server.

The run: a fresh store (SQLite), a runtime built exactly as the in-process runner builds it
(:func:`koi.bench.runner.make_runtime`: the policy's proposer under the policy's name, S2/S3
no-ops unless the policy runs them, the seed), whose world is the simulator kept as
checkpoints in the store (:class:`koi.pipeline.world.CheckpointWorldProvider`, wrapped in
``infra.sim.SimWorld``) and created from the same Scenario object, seed and cluster id; a
worker in this process on its own task queue; and the :class:`~workflows.cluster.ClusterWorkflow`
in simulated mode, started with every scenario job already in its queue (its initial
state), so all of them are synced before tick 0 exactly as the in-process runner stores them
before tick 0 (S0 shows each only once the world's clock reaches its ``submitted_at``). The
cluster ticks ``n`` times and advances the world after each tick, like ``run_ticks``.

The result is assembled by :func:`koi.bench.runner.assemble` from the same store tables, with
each tick's world read back from its checkpoint (the one saved after the tick's deploy; the
provider keeps all of them) and the final world from the newest. So the in-process path and
this one are compared on the same definitions: their committed plans per tick and their
metrics are identical (``tests/test_bench_temporal.py``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from temporalio.client import Client

from koi.bench.cache import RunCache, RunResult
from koi.bench.policy import PolicySpec, get_policy
from koi.bench.runner import (
    TICK_S,
    RunClock,
    assemble,
    bench_context,
    default_cluster_id,
    fresh_store,
    load,
    make_runtime,
    n_ticks_for,
    run_key,
    world_view,
)
from koi.logging import get_logger

log = get_logger(__name__)


def checkpoint_provider(scenario: Any, seed: int, cluster_id: str, keep: int) -> Any:
    """The simulator as checkpoints in the store, built from this Scenario object (not re-read by name)."""
    from infra.sim import SimWorld
    from koi.pipeline.world import CheckpointWorldProvider
    from koi.sim.world import World

    def create(cid: str, _scenario: str | None, _seed: int | None) -> Any:
        return World(scenario, seed=seed, cluster_id=cid)

    return CheckpointWorldProvider(create=create, restore=World.restore, wrap=lambda w: SimWorld(w), keep=keep)


def world_at(engine: Any, cluster_id: str, tick: int | None) -> Any:
    """The world checkpointed at ``tick`` (None: the newest)."""
    from koi.pipeline.world import decode_checkpoint, load_checkpoint
    from koi.sim.world import World
    from koi.store import session_scope

    with session_scope(engine) as s:
        found = load_checkpoint(s, cluster_id, tick)
    if found is None or (tick is not None and found[0] != tick):
        raise LookupError(f"no world checkpoint of {cluster_id!r} at tick {tick}")
    return World.restore(decode_checkpoint(found[1]))


@contextlib.asynccontextmanager
async def _client(client: Client | None) -> AsyncIterator[Client]:
    if client is not None:
        yield client
        return
    from temporalio.contrib.pydantic import pydantic_data_converter
    from temporalio.testing import WorkflowEnvironment

    from workers.client import temporal_cli

    env = await WorkflowEnvironment.start_local(dev_server_existing_path=temporal_cli(),
                                                data_converter=pydantic_data_converter)
    try:
        yield env.client
    finally:
        await env.shutdown()


async def run_via_temporal(
    scenario: Any,
    policy: str | PolicySpec,
    seed: int,
    *,
    hours: float | None = None,
    cache_dir: str | Path | None = None,
    client: Client | None = None,
    cluster_id: str | None = None,
    task_queue: str | None = None,
    fresh: bool = False,
    tick_s: float = TICK_S,
    cache: bool = True,
) -> RunResult:
    """One run through Temporal (a local dev server unless ``client`` is given); cached under ``runs-temporal``."""
    from workers.main import build_workers
    from workflows.cluster import ClusterWorkflow
    from workflows.types import ClusterInput, ClusterState, ClusterStatus, JobEntry

    sc, path = load(scenario)
    spec = policy if isinstance(policy, PolicySpec) else get_policy(policy)
    hours, n_ticks = n_ticks_for(sc, hours, tick_s)
    key = run_key(sc, spec.name, seed, hours)
    store = RunCache(cache_dir, via="temporal")
    if cache and not fresh:
        hit = store.load(key)
        if hit is not None:
            return hit
    cid = cluster_id or default_cluster_id(spec.name, seed)
    work = store.work_dir() / f"temporal-{cid}-{uuid.uuid4().hex[:8]}"
    clock = RunClock().start()
    engine = fresh_store(work)
    try:
        provider = checkpoint_provider(sc, seed, cid, keep=n_ticks + 2)
        # the policy is built as the in-process runner builds it; only the oracle sees a world
        probe = provider.create(cid, None, seed)
        proposer = spec.make_proposer(bench_context(spec, sc, seed, cid, probe))
        rt = make_runtime(engine, provider, spec, proposer, seed=seed, tick_s=tick_s)
        jobs = {jr.job.job_id: JobEntry(job=jr.job.model_dump(mode="json"), status="pending", synced=False,
                                        submitted_tick=0) for jr in probe.jobs}  # fmt: skip
        queue = task_queue or f"bench-{uuid.uuid4().hex[:8]}"
        inp = ClusterInput(cluster_id=cid, mode="simulated", interval_s=tick_s, scenario=sc.name, seed=seed,
                           proposer=spec.name, max_ticks=n_ticks, tick_task_queue=queue,
                           state=ClusterState(cluster_id=cid, jobs=jobs))  # fmt: skip
        async with _client(client) as c:
            workers, pool = build_workers(c, rt, queues=("ticks",), tick_queue=queue,
                                          workflow_failure_exception_types=[Exception])  # fmt: skip
            tasks = [asyncio.create_task(w.run()) for w in workers]
            try:
                handle = await c.start_workflow(ClusterWorkflow.run, inp, id=f"{cid}-{uuid.uuid4().hex[:8]}",
                                                task_queue=queue, result_type=ClusterStatus)  # fmt: skip
                status: ClusterStatus = await handle.result()
            finally:
                await asyncio.gather(*(w.shutdown() for w in workers), return_exceptions=True)
                for t in tasks:
                    with contextlib.suppress(Exception):
                        await t
                pool.shutdown(wait=False, cancel_futures=True)
        clock.stop()
        if status.ticks_done != n_ticks:
            raise RuntimeError(f"the cluster workflow ran {status.ticks_done} of {n_ticks} ticks")
        views = [world_view(world_at(engine, cid, n)) for n in range(n_ticks)]
        final = world_at(engine, cid, None)
        result, records = assemble(engine=engine, cluster_id=cid, spec=spec, key=key, scenario_file=path,
                                   n_ticks=n_ticks, tick_s=tick_s, views=views, final_world=final, clock=clock,
                                   via="temporal")  # fmt: skip
    finally:
        engine.dispose()
        shutil.rmtree(work, ignore_errors=True)
    if cache:
        store.save(result, records)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m workers.bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", required=True)
    ap.add_argument("--policy", required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hours", type=float, default=None)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--fresh", action="store_true")
    ap.add_argument("--verbose", action="store_true")
    a = ap.parse_args(argv)
    from koi.logging import configure

    configure(level="INFO" if a.verbose else "WARNING")
    r = asyncio.run(run_via_temporal(a.scenario, a.policy, a.seed, hours=a.hours, cache_dir=a.cache_dir, fresh=a.fresh))
    m = r.metrics
    sys.stdout.write(json.dumps({
        "policy": r.key.policy, "seed": r.key.seed, "hours": r.key.hours, "cached": r.cached, "via": r.meta.via,
        "wall_s": r.meta.wall_s, "cpu_s": r.meta.cpu_s, "ticks": r.meta.n_ticks,
        "fallback_ticks": r.meta.ticks_fallback, "composite": m.composite, "goodput_tok_s": m.goodput_tok_s,
    }) + "\n")
    return 0


if __name__ == "__main__":
    from koi.procexit import exit_process

    exit_process(main())
