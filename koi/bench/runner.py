"""One benchmark run: a policy on a scenario under a seed, through the tick pipeline, evaluated.

:func:`run_one` builds a fresh store (a SQLite file), an in-process world
(``koi.sim.world.World(scenario, seed=seed)`` behind
:class:`~koi.pipeline.world.InProcessWorldProvider`: no checkpoints) and a
:class:`~koi.pipeline.runtime.Runtime` whose proposer is the policy's (built once per run)
and whose S2/S3 are no-ops unless the policy runs them; then
:func:`~koi.pipeline.runner.run_ticks` over the horizon at the tick interval (300 s), and
:func:`assemble` turns the store, the world and the per-tick world views into a
:class:`~koi.bench.cache.RunResult` (metrics, trace, metadata) and the records. Results are
cached (:mod:`koi.bench.cache`) by (scenario digest, policy, seed, hours).

The same :func:`assemble` builds the result of a run made through Temporal
(``workers/bench.py``), from the same store tables and the world checkpoints of each tick,
so the two paths are compared on identical definitions.

What a tick's :class:`~koi.bench.evaluator.TickTrace` holds (choices where the brief is open):

- ``outcome``; ``swaps`` / ``keeps`` / ``places`` / ``defers``: action counts of the tick's
  *committed* plan (places include resume and retry); a fallback tick committed keep-all,
  so it counts its active jobs as keeps and its pending ones as defers;
- ``actions``: per job, ``place`` / ``swap`` / ``relaunch`` (a place of a job some earlier
  committed plan had placed: it lost its ranks) — the markers of Fig. 5;
- ``gpus_by_job``: job → GPU type → GPUs of its ranks in the world right after the tick's
  deploy (launching, serving and degraded ranks at their requested replicas: the
  plan-declared allocation; draining and failed ranks hold no allocation);
  ``serving_jobs``: jobs with a replica up at that moment;
- learning policies (S2 or S3 run): ``dro_radius`` is ε of the slow state after the tick;
  ``active_mechanisms`` the registered, active mechanisms whose scope holds for at least one
  live rank after the tick; ``cumulative_mechanisms`` the mechanisms tested in at least one
  decided (rank, mechanism) pair up to the tick plus those admitted beyond the seed table;
  ``mean_u`` the mean uncertainty U, after the tick's S3, of the edges exercised so far;
- ``ttft_attainment`` / ``tpot_attainment``: the evaluator's attainment (same formulas, same
  grace) over the online requests that *arrived during the tick's interval*, read from the
  run's final records so that every outcome is known; None when none arrived.

Admitted jobs are those with a replica that came up (the world's ``replica_ready`` events);
the evaluated jobs are those submitted before the horizon (later ones have no traffic in
the run); fleet cost is the world's (allocated instances plus idle reserved capacity) and
the reserved commitment over the horizon is the world's fleet's; ``job_cost_usd`` is the world's
showback of the allocated instances by job and market (``World.cost()["per_job_market"]``), so the
evaluated jobs' dollars plus the idle reserved commitment make the fleet's cost.
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import sqlalchemy as sa

from koi.bench.cache import (
    JobInfo,
    RunCache,
    RunEvalInputs,
    RunKey,
    RunMeta,
    RunResult,
    code_digest,
    scenario_digest,
)
from koi.bench.evaluator import (
    EVAL_VERSION,
    GRACE_S,
    EvalInputs,
    Metrics,
    TickTrace,
    evaluate,
    window_attainment,
)
from koi.bench.policy import BenchContext, Family, PolicySpec, get_policy
from koi.domain import ActionType, DeploymentState, Job
from koi.logging import get_logger
from koi.numerics import kernels

log = get_logger(__name__)

#: The planning tick (Appendix B: ~300 s).
TICK_S = 300.0
#: Where named scenarios are looked up, in order: the benchmark's, then the simulator's (demo).
SCENARIO_DIRS = (Path(__file__).resolve().parent / "scenarios", Path(__file__).resolve().parents[1] / "sim" / "scenarios")

ProgressFn = Callable[[int, int], None]


# ---- scenarios ----------------------------------------------------------------------------------------------
def scenario_path(scenario: str | Path) -> Path:
    """A scenario by path, or by name in the benchmark's scenarios (then the simulator's)."""
    p = Path(scenario)
    if p.suffix in (".yaml", ".yml") or p.is_file():
        if not p.is_file():
            raise FileNotFoundError(f"no scenario file {p}")
        return p.resolve()
    for d in SCENARIO_DIRS:
        cand = d / f"{scenario}.yaml"
        if cand.is_file():
            return cand
    known = sorted({q.stem for d in SCENARIO_DIRS if d.is_dir() for q in d.glob("*.yaml")})
    raise FileNotFoundError(f"unknown scenario {scenario!r}; known: {', '.join(known) or 'none'} (or give a path)")


def load(scenario: Any) -> tuple[Any, Path | None]:
    """(Scenario, its file) from a name, a path or a Scenario object (no file)."""
    from koi.sim.scenario import Scenario, load_scenario

    if isinstance(scenario, Scenario):
        return scenario, None
    p = scenario_path(scenario)
    return load_scenario(p), p


def n_ticks_for(scenario: Any, hours: float | None, tick_s: float = TICK_S) -> tuple[float, int]:
    """(hours, ticks): the scenario's duration unless ``hours`` is given; ticks cover it."""
    h = scenario.duration_s / 3600.0 if hours is None else float(hours)
    if h <= 0:
        raise ValueError(f"hours must be positive, got {h}")
    return h, max(1, math.ceil(round(h * 3600.0 / tick_s, 9)))


def run_key(scenario: Any, policy: str, seed: int, hours: float) -> RunKey:
    """The run's cache key; a language-model policy's carries its model setup as the settings give it now."""
    from koi.bench.policies.llm import llm_setup_tag
    from koi.bench.policy import get_policy
    from koi.config import get_settings

    llm = llm_setup_tag(policy, get_settings()) if get_policy(policy).needs_llm else ""
    return RunKey(scenario=scenario.name, scenario_digest=scenario_digest(scenario), policy=policy, seed=int(seed),
                  hours=float(hours), llm=llm)


def default_cluster_id(policy: str, seed: int) -> str:
    return f"bench-{policy}-s{seed}"


# ---- the world at a tick ------------------------------------------------------------------------------------
_HOLDING = (DeploymentState.LAUNCHING, DeploymentState.SERVING, DeploymentState.DEGRADED)


@dataclass
class WorldView:
    """What the trace needs from the world right after a tick's deploy."""

    gpus_by_job: dict[str, dict[str, int]]
    serving_jobs: list[str]
    ranks: list[tuple[str, Any]]  # (job id, Rank) of the ranks holding an allocation


def world_view(world: Any) -> WorldView:
    gpus: dict[str, dict[str, int]] = {}
    serving: set[str] = set()
    ranks: list[tuple[str, Any]] = []
    for d in sorted(world.deployments(), key=lambda d: d.rank_id):
        if d.replicas_ready > 0:
            serving.add(d.job_id)
        if d.state not in _HOLDING:
            continue
        by = gpus.setdefault(d.job_id, {})
        by[d.rank.env.gpu_type] = by.get(d.rank.env.gpu_type, 0) + d.rank.gpus
        ranks.append((d.job_id, d.rank))
    return WorldView(gpus_by_job=dict(sorted(gpus.items())), serving_jobs=sorted(serving), ranks=ranks)


# ---- learning figures ---------------------------------------------------------------------------------------
@dataclass
class _Learning:
    """Cumulative learning state across ticks (exercised edges, tested mechanisms)."""

    jobs: dict[str, Job]
    edges: set[str] = field(default_factory=set)
    tested: set[str] = field(default_factory=set)
    seeds: frozenset[str] = frozenset()
    _features: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        from koi.causal.mechanisms import default_mechanisms

        self.seeds = frozenset(default_mechanisms())

    def _feat(self, job_id: str, rank: Any) -> dict[str, Any] | None:
        key = (job_id, rank.rank_id(job_id))
        if key not in self._features:
            from koi import catalog
            from koi.causal.features import rank_features

            job = self.jobs.get(job_id)
            try:
                self._features[key] = None if job is None else rank_features(job, rank, catalog.model(job.model))
            except Exception:  # noqa: BLE001 - a rank the catalog cannot describe has no scope features
                self._features[key] = None
        return self._features[key]

    def at(self, s: Any, cluster_id: str, tick: int, view: WorldView) -> dict[str, Any]:
        from koi.calibration import load_slow
        from koi.causal.mechanisms import applicable
        from koi.causal.store import load_beliefs, load_registry
        from koi.store import get_evidence

        for row in get_evidence(s, cluster_id, tick=tick):
            for me in row.mechanisms:
                self.tested.add(me.mechanism_id)
                self.edges.update(me.edges)
        registry = load_registry(s, cluster_id, tick)
        beliefs = load_beliefs(s, cluster_id, tick, registry)
        active: set[str] = set()
        for job_id, rank in view.ranks:
            f = self._feat(job_id, rank)
            if f is not None:
                active.update(m.mechanism_id for m in applicable(registry, f))
        admitted = {k for k in registry if k not in self.seeds}
        us = [beliefs.edges[e].u for e in sorted(self.edges) if e in beliefs.edges]
        return {
            "dro_radius": float(load_slow(s, cluster_id, tick).epsilon),
            "active_mechanisms": len(active),
            "cumulative_mechanisms": len(self.tested | admitted),
            "mean_u": float(np.mean(us)) if us else None,
        }


# ---- assembling a run's result ----------------------------------------------------------------------------
_PLACE = {ActionType.PLACE, ActionType.RESUME, ActionType.RETRY}


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:  # pragma: no cover - not on Linux
        return None


@dataclass
class RunClock:
    """Wall and CPU seconds of a run, with the load average before and after."""

    wall_s: float = 0.0
    cpu_s: float = 0.0
    load_before: float | None = None
    load_after: float | None = None
    sim_s: float = 0.0
    _w0: float = 0.0
    _c0: float = 0.0

    def start(self) -> RunClock:
        self.load_before = _load()
        self._w0, self._c0 = time.perf_counter(), time.process_time()
        return self

    def stop(self) -> RunClock:
        self.wall_s = time.perf_counter() - self._w0
        self.cpu_s = time.process_time() - self._c0
        self.load_after = _load()
        return self


def evaluated_jobs(world: Any, horizon_s: float) -> tuple[list[Job], np.ndarray]:
    """The jobs submitted before the horizon and a map from world job index to their index (-1: left out)."""
    all_jobs = [jr.job for jr in world.jobs]
    remap = np.full(len(all_jobs), -1, dtype=np.int64)
    kept: list[Job] = []
    for i, j in enumerate(all_jobs):
        if j.submitted_at < horizon_s:
            remap[i] = len(kept)
            kept.append(j)
    return kept, remap


def assemble(
    *,
    engine: Any,
    cluster_id: str,
    spec: PolicySpec,
    key: RunKey,
    scenario_file: Path | None,
    n_ticks: int,
    tick_s: float,
    views: Sequence[WorldView],
    final_world: Any,
    clock: RunClock,
    via: str = "in-process",
) -> tuple[RunResult, np.ndarray]:
    """The run's result from the store (plans, outcomes, learning state as of each tick), the
    per-tick world views and the final world (records, cost, events)."""
    from koi import __version__
    from koi.bench.llm_use import run_llm_use
    from koi.domain import ClusterSnapshot
    from koi.pipeline.stages import clock_bound_at
    from koi.store import Stage, digest, get_plan, get_plan_row, list_ticks, load_stage_model, session_scope

    horizon = n_ticks * tick_s
    jobs, remap = evaluated_jobs(final_world, horizon)
    raw = final_world.records()
    rec = raw[remap[raw["job"].astype(np.int64)] >= 0] if len(raw) else raw
    rec = rec.copy()
    if len(rec):
        rec["job"] = remap[rec["job"].astype(np.int64)]
    job_ids = {j.job_id for j in jobs}
    learning = _Learning(jobs={j.job_id: j for j in jobs}) if (spec.run_s2 or spec.run_s3) else None

    trace: list[TickTrace] = []
    plans: list[str | None] = []
    fallbacks: list[dict[str, Any]] = []
    clock_bound: list[dict[str, Any]] = []
    stage_s: Counter[str] = Counter()
    placed_before: set[str] = set()
    with session_scope(engine) as s:
        rows = {r.tick: r for r in list_ticks(s, cluster_id)}
        for n in range(n_ticks):
            row = rows.get(n)
            outcome = row.status if row is not None else "missing"
            for k, v in ((row.timings or {}) if row is not None else {}).items():
                stage_s[k] += float(v)
            counts: Counter[str] = Counter()
            actions: dict[str, str] = {}
            clock_bound += clock_bound_at(s, cluster_id, n)
            prow = get_plan_row(s, cluster_id, n)
            plan = get_plan(s, cluster_id, n) if prow is not None and prow.committed else None
            if outcome == "committed" and plan is not None:
                plans.append(digest(plan))
                for a in plan.actions:
                    if a.type in _PLACE:
                        counts["places"] += 1
                        actions[a.job_id] = "relaunch" if a.job_id in placed_before else "place"
                        placed_before.add(a.job_id)
                    elif a.type is ActionType.SWAP:
                        counts["swaps"] += 1
                        actions[a.job_id] = "swap"
                    elif a.type is ActionType.KEEP:
                        counts["keeps"] += 1
                    elif a.type is ActionType.DEFER:
                        counts["defers"] += 1
            else:
                plans.append(None)
                fallbacks.append({"tick": n, "reason": (row.reason if row is not None else "no tick record")[:500]})
                snap = load_stage_model(s, cluster_id, n, Stage.S0_SNAPSHOT, ClusterSnapshot)
                if snap is not None:  # keep-all: the active jobs keep, the pending ones wait
                    counts["keeps"] = len(snap.active_jobs)
                    counts["defers"] = len(snap.pending_jobs)
            view = views[n] if n < len(views) else WorldView({}, [], [])
            extra = learning.at(s, cluster_id, n, view) if learning is not None else {}
            trace.append(TickTrace(
                tick=n, t=n * tick_s, outcome=outcome, swaps=counts["swaps"], keeps=counts["keeps"],
                places=counts["places"], defers=counts["defers"], actions=actions,
                gpus_by_job={j: g for j, g in view.gpus_by_job.items() if j in job_ids},
                serving_jobs=[j for j in view.serving_jobs if j in job_ids], **extra,
            ))  # fmt: skip
        llm = run_llm_use(s, cluster_id, n_ticks)
    for t, (a, b) in zip(trace, window_attainment(jobs, rec, n_ticks, tick_s, horizon, GRACE_S), strict=True):
        t.ttft_attainment, t.tpot_attainment = a, b
    cost = final_world.cost()
    reserved, _used = final_world.fleet.reserved_commitment(final_world.now())
    admitted = {e["job_id"] for e in final_world.events() if e.get("kind") == "replica_ready"} & job_ids
    stored = RunEvalInputs(jobs=jobs, fleet_cost_usd=float(cost["total"]), reserved_cost_usd=float(reserved),
                           admitted_jobs=sorted(admitted), grace_s=GRACE_S)
    metrics = evaluate(EvalInputs(jobs=jobs, records=rec, horizon_s=horizon, fleet_cost_usd=stored.fleet_cost_usd,
                                  reserved_cost_usd=stored.reserved_cost_usd, trace=trace, admitted_jobs=admitted,
                                  grace_s=GRACE_S, window_s=tick_s))
    committed = sum(1 for t in trace if t.outcome == "committed")
    meta = RunMeta(
        label=spec.label, family=str(spec.family.value), via=via, cluster_id=cluster_id,
        scenario_path=str(scenario_file) if scenario_file else None, tick_s=tick_s, n_ticks=n_ticks,
        horizon_s=horizon, ticks_committed=committed, ticks_fallback=n_ticks - committed, fallbacks=fallbacks,
        clock_bound=clock_bound,
        wall_s=round(clock.wall_s, 3), cpu_s=round(clock.cpu_s, 3), load_before=clock.load_before,
        load_after=clock.load_after, stage_s={k: round(v, 3) for k, v in sorted(stage_s.items())},
        sim_s=round(clock.sim_s, 3), llm=llm, koi_version=__version__, code_digest=code_digest(),
        kernels=kernels(), eval_version=EVAL_VERSION,
        finished_at=datetime.now(UTC).isoformat(timespec="seconds"),
    )  # fmt: skip
    info = [JobInfo(job_id=j.job_id, job_class=j.job_class.value, model=j.model, submitted_at=j.submitted_at)
            for j in jobs]
    job_cost = {j: {m: round(usd, 6) for m, usd in by.items()} for j, by in cost["per_job_market"].items()
                if j in job_ids}
    return RunResult(key=key, meta=meta, metrics=metrics, trace=trace, plans=plans, jobs=info,
                     eval_inputs=stored, job_cost_usd=dict(sorted(job_cost.items()))), rec


# ---- the in-process run -------------------------------------------------------------------------------------
def skip_stage(session: Any, cluster_id: str, tick: int) -> dict[str, Any]:
    """S2/S3 of a policy that does not run them."""
    return {"skipped": True}


class IncrementalS2:
    """S2 exactly as :func:`koi.evidence.run_s2` computes it, with the ICP history kept across ticks.

    ``run_s2`` rebuilds the ICP samples of the whole history window (60 ticks: all of a 3-hour
    run) from the stored rows at every tick, so a run's S2 costs grow with the square of its
    length. A benchmark run is linear (tick after tick, one process), and a past tick's evidence
    rows and the predictions they were validated against never change once written, so this keeps
    the rows and their samples and reads only the previous tick's rows each tick. Everything else
    is :func:`koi.evidence.store.build_inputs`'s resolution, step by step, and the output is
    :func:`koi.evidence.validate.validate_detailed`'s, saved and summarised like ``run_s2``
    (``tests/test_bench_runner.py`` checks the rows, plans and metrics equal the original's).
    A tick at or before one already loaded (a reset) reloads the history from the store.
    """

    def __init__(self) -> None:
        self.cluster_id: str | None = None
        self.upto = 0  # rows of ticks < upto are loaded
        self.rows: list[Any] = []
        self.samples: list[Any] = []

    def _history(self, session: Any, cluster_id: str, tick: int, window: int) -> tuple[list[Any], list[Any]]:
        from koi.evidence.icp import icp_samples_for_row
        from koi.evidence.store import load_predictions_before
        from koi.store import get_evidence

        if cluster_id != self.cluster_id or tick < self.upto:
            self.cluster_id, self.upto, self.rows, self.samples = cluster_id, 0, [], []
        if tick <= 0:
            return [], []
        if tick > self.upto:
            new = get_evidence(session, cluster_id, start=self.upto, end=tick - 1)
            idx = load_predictions_before(session, cluster_id, tick, (r.rank_id for r in new))
            for r in new:
                self.samples.extend(icp_samples_for_row(r, idx.before(r.rank_id, r.tick)))
            self.rows.extend(new)
            self.upto = tick
        lo = max(0, tick - window)
        rows = [r for r in self.rows if lo <= r.tick <= tick - 1]
        samples = sorted((x for x in self.samples if lo <= x.tick <= tick - 1),
                         key=lambda x: (x.tick, x.rank_id, x.edge_id))
        return samples, rows

    def __call__(self, session: Any, cluster_id: str, tick: int) -> dict[str, Any]:
        from koi.causal.store import load_registry
        from koi.domain import ClusterSnapshot
        from koi.evidence import store as ev
        from koi.evidence.cusum import CusumConfig
        from koi.evidence.icp import IcpConfig
        from koi.evidence.perfdb import previous_snapshot
        from koi.evidence.validate import ValidateInputs, cusum_history_from_rows, validate_detailed
        from koi.store import Stage, get_telemetry, load_stage_model, save_evidence

        icp_cfg, cus_cfg = IcpConfig(), CusumConfig()
        telemetry = {w.rank_id: w for w in get_telemetry(session, cluster_id, tick)}
        snapshot = load_stage_model(session, cluster_id, tick, Stage.S0_SNAPSHOT, ClusterSnapshot)
        previous = previous_snapshot(session, cluster_id, tick)
        ranks = ev.rank_contexts(snapshot, previous) if snapshot is not None else []
        idx = ev.load_predictions_before(session, cluster_id, tick, telemetry)
        predictions = {rid: p for rid in telemetry if (p := idx.before(rid, tick)) is not None}
        mechanisms = load_registry(session, cluster_id, tick - 1)
        cusum_table = ev._cusum_table(session, cluster_id, tick - 1)
        history, past_rows = self._history(session, cluster_id, tick, icp_cfg.window_ticks)
        cusum_hist = cusum_history_from_rows((r for r in past_rows if r.rank_id in telemetry), tick, cus_cfg)
        inputs = ValidateInputs(
            cluster_id=cluster_id, tick=tick, ranks=ranks, predictions=predictions, telemetry=telemetry,
            mechanisms=sorted(mechanisms.values(), key=lambda m: m.mechanism_id), cusum_table=cusum_table,
            icp_history=history, **cusum_hist, cusum_config=cus_cfg, icp_config=icp_cfg,
        )  # fmt: skip
        out = validate_detailed(inputs)
        if out.rows:
            save_evidence(session, out.rows)
        verdicts = [r.verdict.value for r in out.icp.values()]
        q = [me.quadrant.value for r in out.rows for me in r.mechanisms]
        return {
            "tick": tick, "n_rows": len(out.rows), "n_decided": len(q),
            "q1": q.count("Q1"), "q2": q.count("Q2"), "q3": q.count("Q3"), "q4": q.count("Q4"),
            "edges_tested": len(verdicts), "icp_accept": verdicts.count("accept"),
            "icp_reject": verdicts.count("reject"), "icp_undecided": verdicts.count("undecided"),
        }  # fmt: skip


def fresh_store(work_dir: Path, name: str = "koi.db") -> Any:
    """A migrated SQLite store in ``work_dir`` (copied from a migrated template kept beside it, so a run
    does not pay for the migrations), with scratch pragmas."""
    from koi.store import head_revision, init_db, make_engine

    work_dir.mkdir(parents=True, exist_ok=True)
    template = work_dir.parent / f".template-{head_revision()}.db"
    if not template.is_file():
        tmp = template.with_name(f"{template.name}.{os.getpid()}.tmp")
        eng = make_engine(f"sqlite:///{tmp}")
        init_db(eng)
        eng.dispose()
        os.replace(tmp, template)
    db = work_dir / name
    shutil.copyfile(template, db)
    engine = make_engine(f"sqlite:///{db}")
    sa.event.listen(engine, "connect", _scratch_pragmas)  # after the store's own pragmas
    return engine


def _scratch_pragmas(dbapi_conn: Any, _record: Any) -> None:
    """A run's store is scratch (deleted after the run): no fsync, temporary tables in memory."""
    cur = dbapi_conn.cursor()
    try:
        cur.execute("PRAGMA synchronous=OFF")
        cur.execute("PRAGMA temp_store=MEMORY")
        cur.execute("PRAGMA cache_size=-65536")
    finally:
        cur.close()


#: S2 of the benchmark's learning policies: "incremental" (:class:`IncrementalS2`, the same rows) or
#: "store" (:func:`koi.evidence.run_s2` itself).
S2_MODES = ("incremental", "store")


def make_runtime(engine: Any, world_provider: Any, spec: PolicySpec, proposer: Any, *, seed: int,
                 tick_s: float = TICK_S, s2: str = "incremental") -> Any:
    """The runtime every path uses: the policy's proposer, S2/S3 only when the policy runs them."""
    from koi.pipeline.runtime import Runtime

    if s2 not in S2_MODES:
        raise ValueError(f"s2 must be one of {S2_MODES}, not {s2!r}")
    if not spec.run_s2:
        s2_fn: Any = skip_stage
    else:
        s2_fn = IncrementalS2() if s2 == "incremental" else None
    return Runtime(
        engine=engine, world=world_provider, proposers={spec.name: proposer}, default_proposer=spec.name,
        s2=s2_fn, s3=None if spec.run_s3 else skip_stage, interval_s=tick_s, seed=int(seed),
    )  # fmt: skip


def bench_context(spec: PolicySpec, scenario: Any, seed: int, cluster_id: str, world: Any,
                  options: dict[str, Any] | None = None) -> BenchContext:
    """What the policy sees when it is built; only the oracle gets the world (true performance)."""
    return BenchContext(scenario=scenario, seed=int(seed), cluster_id=cluster_id,
                        world=world if spec.family is Family.ORACLE else None, options=dict(options or {}))


def run_one(
    scenario: Any,
    policy: str | PolicySpec,
    seed: int,
    *,
    hours: float | None = None,
    cache_dir: str | Path | None = None,
    fresh: bool = False,
    tick_s: float = TICK_S,
    cluster_id: str | None = None,
    on_tick: ProgressFn | None = None,
    keep_store: bool = False,
    options: dict[str, Any] | None = None,
    s2: str = "incremental",
) -> RunResult:
    """Run ``policy`` on ``scenario`` (a name, a path or a Scenario) under ``seed``; cached.

    ``on_tick(done, total)`` reports progress. ``keep_store`` keeps the run's SQLite store
    (``<cache>/.work/<run>/koi.db``) for inspection; otherwise it is deleted. ``s2`` picks
    the learning policies' S2 implementation (:data:`S2_MODES`; the results are the same).
    """
    sc, path = load(scenario)
    spec = policy if isinstance(policy, PolicySpec) else get_policy(policy)
    hours, n_ticks = n_ticks_for(sc, hours, tick_s)
    key = run_key(sc, spec.name, seed, hours)
    cache = RunCache(cache_dir)
    if not fresh:
        hit = cache.load(key)
        if hit is not None:
            if on_tick is not None:
                on_tick(n_ticks, n_ticks)
            return hit
    code_digest()  # read the sources now, as the run starts on them (cached per process), not when it ends
    result, records = execute(sc, path, spec, key, seed, n_ticks=n_ticks, tick_s=tick_s, cache=cache,
                              cluster_id=cluster_id or default_cluster_id(spec.name, seed), on_tick=on_tick,
                              keep_store=keep_store, options=options, s2=s2)  # fmt: skip
    cache.save(result, records)
    return result


class _TimedProvider:
    """The in-process world provider, timing the world's advance."""

    def __init__(self, inner: Any, clock: RunClock) -> None:
        self.inner, self.clock = inner, clock

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def advance(self, session: Any, cluster_id: str, tick: int, t_target: float) -> float:
        t0 = time.perf_counter()
        try:
            return self.inner.advance(session, cluster_id, tick, t_target)
        finally:
            self.clock.sim_s += time.perf_counter() - t0


def execute(scenario: Any, path: Path | None, spec: PolicySpec, key: RunKey, seed: int, *, n_ticks: int,
            tick_s: float, cache: RunCache, cluster_id: str, on_tick: ProgressFn | None = None,
            keep_store: bool = False, options: dict[str, Any] | None = None,
            s2: str = "incremental") -> tuple[RunResult, np.ndarray]:
    """The in-process run itself (no cache)."""
    from koi.pipeline.runner import run_ticks
    from koi.pipeline.world import InProcessWorldProvider
    from koi.sim.world import World

    work = cache.work_dir() / f"{key.scenario}-{key.policy}-{key.stem}-{os.getpid()}"
    if work.exists():
        shutil.rmtree(work)
    clock = RunClock().start()
    engine = fresh_store(work)
    try:
        world = World(scenario, seed=seed, cluster_id=cluster_id)
        proposer = spec.make_proposer(bench_context(spec, scenario, seed, cluster_id, world, options))
        provider = _TimedProvider(InProcessWorldProvider(worlds={cluster_id: world}), clock)
        rt = make_runtime(engine, provider, spec, proposer, seed=seed, tick_s=tick_s, s2=s2)
        views: list[WorldView] = []

        def collect(res: Any) -> None:
            views.append(world_view(world))
            if on_tick is not None:
                on_tick(len(views), n_ticks)

        run_ticks(rt, cluster_id, n_ticks, jobs=[jr.job for jr in world.jobs], seed=seed, proposer=spec.name,
                  on_tick=collect)
        clock.stop()
        result, records = assemble(engine=engine, cluster_id=cluster_id, spec=spec, key=key, scenario_file=path,
                                   n_ticks=n_ticks, tick_s=tick_s, views=views, final_world=world, clock=clock)
        if keep_store:
            result.meta.store = str(work / "koi.db")
    finally:
        engine.dispose()
        if not keep_store:
            shutil.rmtree(work, ignore_errors=True)
    log.info("bench.run", scenario=key.scenario, policy=key.policy, seed=seed, hours=key.hours,
             wall_s=result.meta.wall_s, composite=round(result.metrics.composite, 2),
             fallbacks=result.meta.ticks_fallback)
    return result, records


# ---- many runs ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RunSpec:
    """One run of a suite (picklable, for worker processes)."""

    scenario: str
    policy: str
    seed: int
    hours: float | None = None


def plan_suite(scenario: str, policies: Iterable[str], seeds: Iterable[int], hours: float | None = None) -> list[RunSpec]:
    return [RunSpec(scenario, p, int(s), hours) for p in policies for s in seeds]


def metrics_of(results: Iterable[RunResult]) -> dict[str, list[Metrics]]:
    out: dict[str, list[Metrics]] = {}
    for r in results:
        out.setdefault(r.key.policy, []).append(r.metrics)
    return out
