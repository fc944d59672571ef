"""``koi learn``: the learning loop S1 → S2 → S3 → PerfDB → surrogate refit, on the simulator.

Overview §3.3 ("Evidence improves calibration") and the paper digest report how Koi's
beliefs sharpen over a 12-hour run: mean causal uncertainty of the exercised edges falls
41×, the share of decisive tests that support the predicted path and the ICP acceptance
rate rise, the DRO radius contracts. :func:`run_learn` reproduces that loop on a
:class:`koi.sim.World` under **fixed deployments** (the scenario's ``deploy``, or derived
as ``koi sim run`` does: :class:`koi.sim.driver.FixedDriver`), so only the learning moves;
no planner (S4–S6) is involved.

Every tick ``t`` (interval ``tick_s``), in the spec's order:

1. advance the world to ``t · tick_s`` (the fixed driver deploys arriving jobs and tears
   finished ones down);
2. S0: freeze jobs and deployments (stored, so S2 can rebuild the ranks' scope features);
3. S1: one telemetry window per rank for ``(t − 1, t]``, stored;
4. PerfDB: one :class:`koi.store.PerfRecord` per rank that was predicted at ``t − 1``:
   the window's mean of every V and Y against the prediction's *base* values
   (``RankPrediction.base_values``, the physics alone, as koi.surrogate asks);
5. S2: :func:`koi.evidence.validate_detailed` (residuals against each rank's newest stored
   prediction, CUSUM, quadrants, ICP) on the inputs :func:`koi.evidence.build_inputs` would
   load, kept in memory (:class:`LearnLoop`); rows stored as :func:`koi.evidence.run_s2` does;
6. S3: :func:`koi.calibration.run_beliefs` (Beta fan-out) and :func:`koi.calibration.run_slow`
   (the slow loop: q, β, B, λ, ε, z*, w, CUSUM recalibration), stored;
7. learn: every ``refit_every`` ticks, ``Surrogate.from_records`` on the PerfDB records of the
   last ``learn_window_s``, queried back from the store (:func:`learned_surrogate`: the same
   fit without the prequential residual history nothing here reads);
8. predict: for every serving rank, the surrogate's ``RankPrediction`` at its offered load
   (a one-rank job: the job's rate; several ranks: :meth:`Surrogate.predict_ladder`, which
   splits the rate by capacity; batch jobs run saturated), stored as the domain
   :class:`~koi.domain.Prediction` of tick ``t`` for S2 at ``t + 1``.

Cost (the 12-hour ``learn-hetero`` run, 16–20 ranks, 144 ticks): about 280 s of CPU, a third of
it the simulator; S2, S3 and the per-tick refit on a two-hour window take about 0.6 s each
per tick.

Everything S2 and S3 read is in the store, so the run is replayable: ``validate(build_inputs(
session, cluster, t))`` gives the stored rows again, and folding them with
:func:`koi.causal.apply_evidence` from the seed gives the stored beliefs exactly.

Choices where the brief is vague (and why):

- **Which ranks are predicted.** Only ranks with a serving replica at the tick. A rank still
  booting has no steady state to predict; its first full window after it comes up is the
  first one validated. A degraded rank is predicted with the replicas that are up.
- **Price.** A rank owns whole instances (koi/sim), so its $/GPU-hour is the pool's instance
  price × instances the rank holds ÷ its GPUs: the bill the operator pays, passed to the
  surrogate. With the catalog's per-GPU price, a one-GPU chain on an eight-GPU instance
  would have its cost per token predicted 8× too low, a bias no residual corrects (cost
  follows throughput in koi.surrogate's learner).
- **Batch SLO margin** is predicted with the tokens the job still owes and the time to its
  deadline at the tick (what the simulator's telemetry reports), not the job's whole budget.
- **Batch TTFT** is not compared (:data:`NOT_COMPARABLE`): the simulator counts a batch
  request's TTFT from the job's submission, so its telemetry reports the job's deliberate
  backlog (hours), while the surrogate predicts the engine's steady-state TTFT. The two
  measure different things; comparing them would fail every TTFT mechanism on batch ranks
  (and, learned from, drag the GPU- and environment-level TTFT corrections of the online jobs
  sharing them). Batch ranks are validated and learned on everything else.
- **Learning window.** Each refit sees the PerfDB records of the last ``learn_window_s``
  (default 2 h), not the whole history: koi.surrogate's residual learner weighs every record
  equally, so after an engine update a full-history fit would take as many post-change
  ticks as pre-change ones to move halfway; a window forgets the old regime in bounded
  time and keeps the refit's cost constant per tick. ``learn_window_s = None`` uses all.
- **Exercised** edges and mechanisms are cumulative: those in at least one decided
  (rank, mechanism) pair up to the tick; their mean and median U are read from the beliefs
  after that tick's S3. The **U factor** compares the first tick with an exercised edge
  with the last tick (both after S3); the factor from the seed priors of the same edges is
  reported too.
- **Per-tick rates** (Q1 rate, decisive support share, ICP acceptance = accept / (accept +
  reject), over (row, edge) verdicts) are over the tick's own rows
  (:func:`koi.evidence.learning_metrics`). One tick's rates are noisy (a handful of edges
  near ICP's 5% practical margin flip between accept and reject), so the report also pools
  them per simulated hour (:class:`~koi.calibration.learn_report.BlockFigures`: counts summed
  over the hour), and the summary gives both the first/last tick where a rate is defined and
  the first hour with an ICP decision / the last hour.
- **Surrogate error** per tick: median |prediction − observed| / observed over the ranks
  validated that tick, for p99 TTFT, p99 TPOT and throughput, with the base physics
  ("before" learning) and with the corrected prediction actually stored ("after").

This module holds the loop (:class:`LearnLoop`, :func:`run_learn`); the run's configuration and
report models, and the figures computed from them (:func:`~koi.calibration.learn_report.pool`,
:func:`~koi.calibration.learn_report.summarize`), are in :mod:`koi.calibration.learn_report`.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from sqlalchemy.engine import Engine

from koi import variables
from koi.calibration.learn_report import (
    ERROR_OBJECTIVES,
    ErrorFigure,
    LearnConfig,
    LearnReport,
    TickReport,
    _ape,
    _median,
    blocks,
    summarize,
)
from koi.calibration.store import run_beliefs, run_slow
from koi.causal.updates import BeliefState
from koi.domain import ClusterSnapshot, Deployment, DeploymentState, Job, JobClass, Ladder, Rank
from koi.domain.job import JobState, JobStatus
from koi.domain.telemetry import EvidenceRow, Prediction, TelemetryWindow
from koi.evidence.cusum import CusumConfig, CusumTable
from koi.evidence.icp import IcpConfig, IcpSample
from koi.evidence.metrics import learning_metrics
from koi.evidence.store import rank_contexts
from koi.evidence.validate import ValidateInputs, cusum_history_from_rows, validate_detailed
from koi.logging import get_logger
from koi.surrogate import ProfileBook, RankPrediction, ResidualModel, Surrogate

log = get_logger(__name__)

_VY = frozenset(variables.V_NAMES + variables.Y_NAMES)
#: What the simulator measures for a job class differently from what the surrogate predicts
#: (module docstring, "Batch TTFT"): left out of that class's stored predictions and PerfDB records.
NOT_COMPARABLE = variables.NOT_COMPARABLE


# ---- helpers ------------------------------------------------------------------------------------------
def window_means(w: TelemetryWindow) -> tuple[dict[str, float], dict[str, float]]:
    """(observed V, observed Y): the window's mean of every series, split by kind."""
    v: dict[str, float] = {}
    y: dict[str, float] = {}
    for name, xs in sorted(w.series.items()):
        if not xs:
            continue
        kind = variables.kind_of(name)
        (v if kind is variables.Kind.V else y)[name] = float(np.mean(xs))
    return v, y


class _Pricing:
    """$/GPU-hour of a rank as billed: the pool's instance price over the GPUs the rank uses."""

    def __init__(self, scenario: Any) -> None:
        self.sc = scenario

    def per_gpu_hour(self, rank: Rank) -> float | None:
        from koi.sim.physics import instances_per_replica

        for pool in self.sc.pools:
            env = self.sc.environment(pool)
            if env.env_id != rank.env.env_id:
                continue
            if rank.config.instance_type and pool.instance_type != rank.config.instance_type:
                continue
            itype = self.sc.instance_type(pool)
            ipr, rpi = instances_per_replica(rank.config, itype)
            n = rank.n_replicas
            instances = n * ipr if ipr > 1 else math.ceil(n / max(rpi, 1))
            return self.sc.price(pool) * instances / (rank.config.gpus * n)
        return None


def learned_surrogate(records: Sequence[Any]) -> Surrogate:
    """``Surrogate.from_records(records)`` without the prequential residual history.

    :meth:`ResidualModel.fit` also rebuilds, by default, the prequential residuals the DRO band
    reads (about twenty refits over the history): 95% of a refit's time, and nothing this loop
    predicts depends on it (S3's band checks read the PerfDB). One block gives the same speed
    and output corrections, hence the same predictions, at a twentieth of the cost.
    """
    residuals = ResidualModel.fit(records, block=max(1, len(records)))
    return Surrogate(residuals=residuals, profiles=ProfileBook())


class LearnLoop:
    """The loop's state between ticks: the world, the surrogate, and S2's rolling inputs.

    S2 runs on inputs held in memory — exactly what :func:`koi.evidence.build_inputs` would
    load from the store (the tick's telemetry and snapshot, each rank's newest prediction
    before the tick, the registry and CUSUM table as of t − 1, the ICP samples and σ history
    of the last ``IcpConfig.window_ticks`` ticks) — because re-reading and re-parsing five
    hours of evidence rows every tick costs more than the simulation. The rows are written
    to the store as :func:`koi.evidence.run_s2` writes them, and ``tests/test_learn.py``
    checks that ``validate(build_inputs(session, cluster, t))`` reproduces them.
    """

    def __init__(self, scenario: Any, config: LearnConfig, engine: Engine) -> None:
        from koi.sim.driver import FixedDriver
        from koi.sim.world import World

        self.sc = scenario
        self.cfg = config
        self.engine = engine
        self.world = World(scenario, seed=config.seed, cluster_id=config.cluster_id)
        self.driver = FixedDriver(self.world)
        self.pricing = _Pricing(scenario)
        self.surrogate = Surrogate()
        self.last_preds: dict[str, RankPrediction] = {}
        self.stored_preds: dict[str, Prediction] = {}  # rank → newest stored prediction
        self.icp_cfg = IcpConfig()
        self.cusum_cfg = CusumConfig()
        self.cusum_table = CusumTable()
        self.icp_samples: list[IcpSample] = []
        self.recent_rows: list[EvidenceRow] = []
        self.jobs: dict[str, Job] = {j.job.job_id: j.job for j in scenario.jobs}
        self.exercised_edges: set[str] = set()
        self.exercised_mechs: set[str] = set()
        self.timings: dict[str, float] = {k: 0.0 for k in ("simulate", "s0_s1", "perfdb", "s2", "s3", "refit",
                                                           "predict", "metrics")}

    # ---- S0 ----------------------------------------------------------------------------------------
    def _job_states(self) -> list[JobState]:
        w = self.world
        now = w.now()
        out = []
        for jid in w.job_ids:
            job = w.jobs[w.job_index[jid]].job
            if job.submitted_at > now:
                continue
            p = w.progress(jid)
            done = p.finished_at is not None or (p.departed and job.job_class is JobClass.ONLINE)
            status = JobStatus.FINISHED if done else JobStatus.ACTIVE
            out.append(JobState(job=job, status=status, completed_requests=p.served, finished_at=p.finished_at))
        return out

    def snapshot(self, tick: int) -> ClusterSnapshot:
        return ClusterSnapshot(cluster_id=self.cfg.cluster_id, tick=tick, now=self.world.now(),
                               jobs=self._job_states(), deployments=self.world.deployments(),
                               resources=self.world.capacity())

    # ---- predictions ---------------------------------------------------------------------------------
    def predict(self, snap: ClusterSnapshot) -> dict[str, RankPrediction]:
        """The surrogate's prediction of every serving rank at its offered load (see the module docstring)."""
        w = self.world
        by_job: dict[str, list[Deployment]] = {}
        for d in snap.deployments:
            if d.state in (DeploymentState.SERVING, DeploymentState.DEGRADED) and d.replicas_ready > 0:
                by_job.setdefault(d.job_id, []).append(d)
        owed = w.tokens_owed()
        out: dict[str, RankPrediction] = {}
        for jid in sorted(by_job):
            job = self.jobs[jid]
            deps = sorted(by_job[jid], key=lambda d: d.rank_id)
            ranks = [d.rank.model_copy(update={"n_replicas": d.replicas_ready}) for d in deps]
            prices = [self.pricing.per_gpu_hour(r) for r in ranks]
            kw: dict[str, Any] = {}
            if job.job_class is JobClass.BATCH:
                kw["tokens_remaining"] = float(owed[w.job_index[jid]])
                kw["seconds_left"] = max(1.0, float((job.deadline_at or w.now()) - w.now()))
            try:
                if len(ranks) == 1:  # the whole offered load on one rank: no capacity split to compute
                    b = self.surrogate.predict_many(job, [ranks[0].chain], n_replicas=ranks[0].n_replicas,
                                                    price_per_gpu_hour=prices[0], with_capacity=False, **kw)
                    rps = [b.rank(0)]
                else:
                    lp = self.surrogate.predict_ladder(job, Ladder(ranks=ranks),
                                                       None if any(p is None for p in prices) else prices, **kw)
                    rps = lp.ranks
            except Exception as exc:  # a job the surrogate cannot model is observed but never validated
                log.warning("learn.predict_failed", cluster=self.cfg.cluster_id, tick=snap.tick, job=jid, error=str(exc))
                continue
            for d, rp in zip(deps, rps, strict=True):
                if rp.feasible:
                    out[d.rank_id] = rp
        return out

    def _store_predictions(self, t: int, preds: dict[str, RankPrediction]) -> None:
        from koi.store import save_prediction, session_scope

        stored = []
        for rid, p in sorted(preds.items()):
            sp = p.to_prediction(self.cfg.cluster_id, t, rid)
            drop = NOT_COMPARABLE.get(self.jobs[p.job_id].job_class, frozenset())
            if drop:
                sp = sp.model_copy(update={"values": {k: v for k, v in sp.values.items() if k not in drop}})
            stored.append(sp)
        if stored:
            with session_scope(self.engine) as s:
                save_prediction(s, stored)
        for p in stored:
            self.stored_preds[p.rank_id] = p
        self.last_preds = preds

    # ---- S2 -------------------------------------------------------------------------------------------
    def s2(self, t: int, snap: ClusterSnapshot, windows: list[TelemetryWindow]) -> list[EvidenceRow]:
        """S2 on the in-memory inputs (see the class docstring); rows persisted like run_s2."""
        from koi.causal.store import load_registry
        from koi.store import save_evidence, session_scope

        cid = self.cfg.cluster_id
        telemetry = {w.rank_id: w for w in windows}
        window = self.icp_cfg.window_ticks
        lo = max(0, t - window)
        self.icp_samples = [x for x in self.icp_samples if lo <= x.tick < t]
        self.recent_rows = [r for r in self.recent_rows if lo <= r.tick < t]
        with session_scope(self.engine) as s:
            registry = load_registry(s, cid, t - 1)
        cusum_hist = cusum_history_from_rows((r for r in self.recent_rows if r.rank_id in telemetry), t,
                                             self.cusum_cfg)
        inputs = ValidateInputs(
            cluster_id=cid, tick=t, ranks=rank_contexts(snap),
            predictions={rid: self.stored_preds[rid] for rid in telemetry if rid in self.stored_preds},
            telemetry=telemetry, mechanisms=sorted(registry.values(), key=lambda m: m.mechanism_id),
            cusum_table=self.cusum_table, icp_history=list(self.icp_samples), **cusum_hist,
            cusum_config=self.cusum_cfg, icp_config=self.icp_cfg,
        )
        out = validate_detailed(inputs)
        if out.rows:
            with session_scope(self.engine) as s:
                save_evidence(s, out.rows)
        self.icp_samples.extend(out.samples)
        self.recent_rows.extend(out.rows)
        return out.rows

    # ---- one tick ----------------------------------------------------------------------------------------
    def tick(self, t: int) -> TickReport:
        from koi.store import (
            PerfRecord,
            Stage,
            query_perf,
            save_job_state,
            save_perf_records,
            save_stage_output,
            save_telemetry,
            session_scope,
        )

        cfg, cid = self.cfg, self.cfg.cluster_id
        t_wall = time.perf_counter()
        c0 = time.perf_counter()
        self.driver.run(t * cfg.tick_s)
        c1 = time.perf_counter()
        self.timings["simulate"] += c1 - c0

        # S0 + S1
        snap = self.snapshot(t)
        windows = self.world.telemetry((t - 1) * cfg.tick_s, t * cfg.tick_s, cluster_id=cid, tick=t)
        with session_scope(self.engine) as s:
            for js in snap.jobs:
                save_job_state(s, cid, js)
            save_stage_output(s, cid, t, Stage.S0_SNAPSHOT, snap, input_digest="")
            if windows:
                save_telemetry(s, windows)
        c2 = time.perf_counter()
        self.timings["s0_s1"] += c2 - c1

        # PerfDB: observed means against the base prediction the rank was kept with at t − 1
        records: list[PerfRecord] = []
        errs: dict[str, tuple[list[float], list[float]]] = {k: ([], []) for k in ERROR_OBJECTIVES}
        deps = {d.rank_id: d for d in snap.deployments}
        for w in windows:
            pred = self.last_preds.get(w.rank_id)
            d = deps.get(w.rank_id)
            if pred is None or d is None or w.n_samples == 0:
                continue  # not predicted, or left during the window: validated by S2, not learned from
            ov, oy = window_means(w)
            drop = NOT_COMPARABLE.get(self.jobs[w.job_id].job_class, frozenset())
            ov = {k: v for k, v in ov.items() if k not in drop}
            oy = {k: v for k, v in oy.items() if k not in drop}
            base = {k: float(v) for k, v in pred.base_values.items()
                    if k in _VY and k not in drop and math.isfinite(v)}
            rank = d.rank.model_copy(update={"n_replicas": pred.n_replicas})
            records.append(PerfRecord.of(cid, t, self.jobs[w.job_id], rank, observed_v=ov, observed_y=oy,
                                         predicted=base, n_samples=w.n_samples))
            for k in ERROR_OBJECTIVES:
                b, a = _ape(pred.base_values.get(k), oy.get(k)), _ape(pred.values.get(k), oy.get(k))
                if b is not None and a is not None:
                    errs[k][0].append(b)
                    errs[k][1].append(a)
        if records:
            with session_scope(self.engine) as s:
                save_perf_records(s, records)
        c3 = time.perf_counter()
        self.timings["perfdb"] += c3 - c2

        # S2 (in memory, persisted), S3 (store-backed: what the Temporal activity calls)
        rows = self.s2(t, snap, windows)
        c4 = time.perf_counter()
        self.timings["s2"] += c4 - c3
        with session_scope(self.engine) as s:
            _, beliefs = run_beliefs(s, cid, t)
        with session_scope(self.engine) as s:
            slow = run_slow(s, cid, t, config=cfg.slow)
        self.cusum_table = slow.cusum
        c5 = time.perf_counter()
        self.timings["s3"] += c5 - c4

        report = self._metrics(t, rows, beliefs, slow, windows, errs)
        c6 = time.perf_counter()
        self.timings["metrics"] += c6 - c5

        # learn, then predict the next window
        n_rec = None
        if cfg.refit_every and t % cfg.refit_every == 0:
            wt = cfg.window_ticks
            with session_scope(self.engine) as s:
                recs = query_perf(s, cluster_id=cid, since_tick=0 if wt is None else max(0, t - wt + 1))
            self.surrogate = learned_surrogate(recs)
            n_rec = len(recs)
        c7 = time.perf_counter()
        self.timings["refit"] += c7 - c6
        self._store_predictions(t, self.predict(snap))
        c8 = time.perf_counter()
        self.timings["predict"] += c8 - c7
        report.perf_records = n_rec
        report.refit_s = round(c7 - c6, 4)
        report.tick_wall_s = round(c8 - t_wall, 4)
        log.info("learn.tick", cluster=cid, tick=t, ranks=report.ranks, decided=report.decided,
                 q1=report.q1_rate, mean_u=report.mean_u_edges, eps=report.epsilon, refit_s=report.refit_s)
        return report

    def start(self) -> None:
        """Tick 0: store the jobs and the snapshot, and predict whatever already serves (usually nothing)."""
        from koi.store import Stage, save_job_state, save_stage_output, session_scope

        snap = self.snapshot(0)
        with session_scope(self.engine) as s:
            for js in snap.jobs:
                save_job_state(s, self.cfg.cluster_id, js)
            save_stage_output(s, self.cfg.cluster_id, 0, Stage.S0_SNAPSHOT, snap, input_digest="")
        self._store_predictions(0, self.predict(snap))

    # ---- metrics ----------------------------------------------------------------------------------------
    def _metrics(self, t: int, rows: list[EvidenceRow], beliefs: BeliefState, slow: Any,
                 windows: list[TelemetryWindow], errs: dict[str, tuple[list[float], list[float]]]) -> TickReport:
        m = learning_metrics(rows)
        for r in rows:
            for me in r.mechanisms:
                self.exercised_mechs.add(me.mechanism_id)
                self.exercised_edges.update(me.edges)
        ue = [beliefs.edges[e].u for e in sorted(self.exercised_edges) if e in beliefs.edges]
        um = [beliefs.mechanisms[k].u for k in sorted(self.exercised_mechs) if k in beliefs.mechanisms]
        acc = sum(1 for r in rows for v in r.icp.values() if v.value == "accept")
        rej = sum(1 for r in rows for v in r.icp.values() if v.value == "reject")
        und = sum(1 for r in rows for v in r.icp.values() if v.value == "undecided")
        cov = slow.coverage_history[-1].coverage if slow.coverage_history and slow.coverage_history[-1].tick == t else None
        return TickReport(
            tick=t, t_s=self.world.now(), ranks=len(windows), predicted=sum(1 for r in rows if r.cusum),
            decided=m.n_decided, q1=m.quadrants.get("Q1", 0), q1_rate=m.q1_rate, q1_rate_rolling=slow.q,
            decisive=m.decisive_tests, supporting=round((m.decisive_support_share or 0.0) * m.decisive_tests),
            support_share=m.decisive_support_share, icp_accept=acc, icp_reject=rej, icp_undecided=und,
            icp_accept_rate=acc / (acc + rej) if acc + rej else None,
            exercised_edges=len(ue), mean_u_edges=float(np.mean(ue)) if ue else None, median_u_edges=_median(ue),
            exercised_mechanisms=len(um), mean_u_mechanisms=float(np.mean(um)) if um else None,
            median_u_mechanisms=_median(um), epsilon=slow.epsilon, coverage=cov, beta=slow.beta,
            errors={k: ErrorFigure(before=_median(b), after=_median(a), n=len(a)) for k, (b, a) in errs.items()},
        )


def default_db_url(scenario_name: str, seed: int) -> str:
    """A fresh SQLite file under ``KOI_DATA_DIR/learn/`` (a new name per run)."""
    from koi.config import get_settings

    root = Path(get_settings().data_dir) / "learn"
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = root / f"{scenario_name}-seed{seed}-{stamp}.db"
    k = 1
    while path.exists():
        path = root / f"{scenario_name}-seed{seed}-{stamp}-{k}.db"
        k += 1
    return f"sqlite:///{path.resolve()}"


def run_learn(
    scenario: Any,
    config: LearnConfig | None = None,
    *,
    engine: Engine,
    on_tick: Callable[[TickReport], None] | None = None,
) -> LearnReport:
    """Run the learning loop on ``scenario`` for ``config.hours`` and report (module docstring).

    ``engine`` is a store engine whose schema is initialised (``koi.store.init_db``); the
    cluster ``config.cluster_id`` must have no ticks stored yet (a fresh run).
    """
    from koi.store import list_stage_outputs, session_scope

    cfg = config or LearnConfig()
    with session_scope(engine) as s:
        if list_stage_outputs(s, cfg.cluster_id, 0) or list_stage_outputs(s, cfg.cluster_id, 1):
            raise ValueError(f"cluster {cfg.cluster_id!r} already has ticks in this store: use a fresh database "
                             "or another cluster id")
    t0, cpu0 = time.perf_counter(), time.process_time()
    loop = LearnLoop(scenario, cfg, engine)
    loop.start()
    ticks: list[TickReport] = []
    for t in range(1, cfg.n_ticks + 1):
        rep = loop.tick(t)
        ticks.append(rep)
        if on_tick is not None:
            on_tick(rep)
    prior = _prior_u(loop.exercised_edges)
    summary = summarize(ticks, cfg.tick_s, prior)
    timings = {k: round(v, 3) for k, v in loop.timings.items()} | {
        "total": round(time.perf_counter() - t0, 3), "cpu": round(time.process_time() - cpu0, 3)}
    hourly = blocks(ticks, max(1, int(round(3600.0 / cfg.tick_s))))
    return LearnReport(scenario=scenario.name, seed=loop.world.seed, cluster_id=cfg.cluster_id,
                       database=engine.url.render_as_string(hide_password=True), config=cfg, ticks=ticks,
                       hourly=hourly, summary=summary, timings=timings)


def _prior_u(edges: set[str]) -> tuple[float | None, float | None]:
    from koi.causal.graph import default_graph

    g = default_graph()
    u = [g.edge(e).prior.u for e in sorted(edges) if e in g]
    return (float(np.mean(u)), float(np.median(u))) if u else (None, None)
