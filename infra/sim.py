"""The simulated executor and observer: :mod:`koi.sim`'s World behind Koi's ports.

:class:`SimWorld` wraps one ``koi.sim.world.World`` and is what a tick's stages see:

- Observer: ``now``, ``capacity``, ``telemetry`` (per-rank windows), plus
  ``deployments`` (the ranks as the world runs them: replicas that failed to
  materialize, spot reclaims) and ``job_states`` (requests served, finished, departed);
- Executor: ``launch`` / ``teardown`` / ``scale`` with idempotency keys (the world
  remembers every key inside its checkpoint and answers a repeat with ``DUPLICATE``);
  a job the world has not seen yet is registered before its first launch;
- ``ensure_job``: a job submitted to the cluster starts sending traffic (what a real
  tenant does), so ``sync_jobs`` registers it in the world;
- ``launch_delay_s``: real seconds each launch takes, like a cloud API call (0 by
  default; the worker-kill test uses it to catch a worker mid-deploy).

Where the world lives: a checkpoint per cluster per tick in the store
(:class:`koi.pipeline.world.CheckpointWorldProvider`), so any worker runs any activity
and a killed worker loses nothing that was committed (see ``koi/pipeline/world.py``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from koi.domain import Deployment, Job, Rank, ResourceMap, TelemetryWindow
from koi.logging import get_logger
from koi.ports import LaunchResult

log = get_logger(__name__)


def load_scenario(scenario: str | None) -> Any:
    """A scenario by name (``demo`` → ``koi/sim/scenarios/demo.yaml``) or by path."""
    from koi.sim.scenario import demo_path
    from koi.sim.scenario import load_scenario as _load

    name = scenario or "demo"
    p = Path(name)
    if not p.suffix:
        p = demo_path().parent / f"{name}.yaml"
    return _load(p)


def create_world(cluster_id: str, scenario: str | None, seed: int | None) -> Any:
    from koi.sim.world import World

    return World(load_scenario(scenario), seed=seed, cluster_id=cluster_id)


def restore_world(blob: bytes) -> Any:
    from koi.sim.world import World

    return World.restore(blob)


class SimWorld:
    """The ports over one simulated world (delegation; ``inner`` is the World itself)."""

    def __init__(self, world: Any, *, launch_delay_s: float = 0.0) -> None:
        self.inner = world
        self.launch_delay_s = launch_delay_s

    # ---- Observer -------------------------------------------------------------------------------
    def now(self) -> float:
        return float(self.inner.now())

    def capacity(self) -> ResourceMap:
        return self.inner.capacity()

    def telemetry(self, t_start: float, t_end: float, *, cluster_id: str, tick: int) -> list[TelemetryWindow]:
        return self.inner.telemetry(t_start, t_end, cluster_id=cluster_id, tick=tick)

    def deployments(self) -> list[Deployment]:
        return self.inner.deployments()

    def job_states(self) -> dict[str, tuple[int, bool]]:
        """job id -> (requests served, finished: a batch job done or an online job departed)."""
        out = {}
        for job_id in self.inner.job_ids:
            p = self.inner.progress(job_id)
            out[job_id] = (int(p.served), bool(p.departed or p.finished_at is not None))
        return out

    def advance(self, t: float) -> None:
        self.inner.advance(t)

    def checkpoint(self) -> bytes:
        return self.inner.checkpoint()

    # ---- jobs -------------------------------------------------------------------------------------
    def ensure_job(self, job: Job) -> bool:
        """Register a job's traffic in the world; False when it is already there."""
        if job.job_id in self.inner.job_index:
            return False
        self.inner.submit(job)
        log.info("sim.job_registered", job=job.job_id, submitted_at=job.submitted_at)
        return True

    # ---- Executor ---------------------------------------------------------------------------------
    def launch(self, job: Job, rank: Rank, idempotency_key: str) -> LaunchResult:
        if self.launch_delay_s > 0:
            time.sleep(self.launch_delay_s)
        self.ensure_job(job)
        return self.inner.launch(job, rank, idempotency_key)

    def teardown(self, job_id: str, rank_id: str, idempotency_key: str, *, drain_s: float = 0.0,
                 handover: bool = False) -> bool:
        return self.inner.teardown(job_id, rank_id, idempotency_key, drain_s=drain_s, handover=handover)

    def scale(self, job_id: str, rank_id: str, n_replicas: int, idempotency_key: str, *,
              drain_s: float | None = None) -> LaunchResult:
        return self.inner.scale(job_id, rank_id, n_replicas, idempotency_key, drain_s=drain_s)

    def reweight(self, job_id: str, rank_id: str, route_weight: float, idempotency_key: str) -> bool:
        return self.inner.reweight(job_id, rank_id, route_weight, idempotency_key)


def sim_world_provider(*, launch_delay_s: float = 0.0, keep: int | None = None) -> Any:
    """The simulator kept as a checkpoint per cluster per tick in the store."""
    from koi.pipeline.world import KEEP_CHECKPOINTS, CheckpointWorldProvider

    return CheckpointWorldProvider(
        create=create_world,
        restore=restore_world,
        wrap=lambda w: SimWorld(w, launch_delay_s=launch_delay_s),
        keep=keep or KEEP_CHECKPOINTS,
    )
