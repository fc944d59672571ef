"""The fleet simulator: the world Koi is measured in (DESIGN.md, "The world: simulator versus surrogate").

Public API::

    from koi.sim import World, load_scenario, parse_scenario, load_demo, ScenarioError

    world = World(load_scenario("koi/sim/scenarios/demo.yaml"), seed=7)

    # Executor (koi.ports.Executor semantics)
    world.launch(job: Job, rank: Rank, idempotency_key: str) -> LaunchResult   # DUPLICATE on a repeated key
    world.teardown(job_id, rank_id, idempotency_key, *, drain_s=None, handover=False) -> bool
    world.scale(job_id, rank_id, n_replicas, idempotency_key) -> LaunchResult
    # Observer (koi.ports.Observer semantics)
    world.now() -> float
    world.capacity() -> ResourceMap                       # free instances per pool
    world.telemetry(t0, t1, *, cluster_id=None, tick=0) -> list[TelemetryWindow]
    # time and state
    world.advance(t) -> None
    world.checkpoint() -> bytes ;  World.restore(data) -> World   # continues identically
    # what drivers and the evaluator read
    world.job_arrivals() -> list[(t, Job)] ; world.jobs_submitted(t0, t1) -> list[Job]
    world.submit(job)                                     # a job not in the scenario
    world.progress(job_id) -> JobProgress ; world.deployments() -> list[Deployment]
    world.records(include_unfinished=True) -> np.ndarray  # RECORD_DTYPE, one row per request
    world.telemetry_columns() -> (times, rank idx, values)  # every sample, columnar
    world.events(t0, t1) -> list[dict] ; world.cost() -> dict

Modules: :mod:`~koi.sim.scenario` (schema, ``SCENARIO.md``), :mod:`~koi.sim.world`
(the world: actions, observation, time, checkpoints) with its parts :mod:`~koi.sim.runtime`
(runtime state), :mod:`~koi.sim.routing` (request flow), :mod:`~koi.sim.lifecycle`
(replicas and instances) and :mod:`~koi.sim.events` (the event queue),
:mod:`~koi.sim.engine` (the vectorised replica engine) with :mod:`~koi.sim.segments` (its
segmented primitives), :mod:`~koi.sim.physics` (the adapter to koi/perf), :mod:`~koi.sim.telemetry`,
:mod:`~koi.sim.records`, :mod:`~koi.sim.driver` (fixed deployments, ``koi sim run``),
:mod:`~koi.sim.bench` (``koi sim bench``), :mod:`~koi.sim.fidelity` (``koi sim fidelity``).
"""

from koi.sim.records import RECORD_DTYPE, Status
from koi.sim.scenario import Scenario, ScenarioError, load_demo, load_scenario, parse_scenario
from koi.sim.world import JobProgress, World

__all__ = [
    "RECORD_DTYPE",
    "JobProgress",
    "Scenario",
    "ScenarioError",
    "Status",
    "World",
    "load_demo",
    "load_scenario",
    "parse_scenario",
]
