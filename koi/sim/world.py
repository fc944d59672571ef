"""The world: a fleet simulator with the Executor/Observer surface of :mod:`koi.ports`.

:class:`World` owns the fleet (pools, instances, prices, capacity events), the jobs'
request streams, every replica engine (:mod:`koi.sim.engine`), the lifecycle of
ranks (cold start, warm-up, drain, A/B overlap, replicas that fail to materialize or
come up degraded), the hidden effects of the scenario, per-request records and
sub-tick telemetry. Its action and observation methods carry the names and
semantics of :class:`koi.ports.Executor` and :class:`koi.ports.Observer`, so
``infra/`` wraps it by delegation.

The world's parts live in small modules: the runtime state in :mod:`koi.sim.runtime`, and
three mixins :class:`World` inherits — the request flow (:mod:`koi.sim.routing`), the
lifecycle of replicas and instances (:mod:`koi.sim.lifecycle`) and the event queue with its
handlers (:mod:`koi.sim.events`). The semantics below hold for the whole world.

Semantics chosen where the issue is vague (each also in SCENARIO.md):
- **launch** places the rank in the first pool of its environment (of its
  ``instance_type`` when given) and checks it against koi/perf's memory model; an
  impossible chain is refused with the engine's reason (``FAILED``), never served.
  When the pool has capacity for only some replicas, those are launched (``LAUNCHED``
  with ``replicas_launched < replicas_requested`` and a reason); none → ``FAILED``.
  A repeated idempotency key returns the first result with status ``DUPLICATE``.
- **cold start** = provision + weight load (weight bytes per GPU / load bandwidth) +
  warm-up; cost accrues from allocation. A replica that fails to materialize is
  detected at its would-be ready time and its instances released then.
- **front end**: every request reaches its engine's scheduler koi/perf's fitted
  ``request_s`` after it arrives (HTTP, tokenisation); TTFT counts from arrival.
- **routing**: online requests go to serving replicas of the job's non-draining ranks
  by smooth weighted round-robin, weights ∝ the planner's per-replica weight
  (``Rank.route_weight``, its SLO capacity) when every serving rank of the job carries
  one, else ∝ a replica's nominal decode capacity (its rank's 64-sequence iteration
  rate); a slowed replica's weight is divided by its slowdown; no serving replica → they wait at the
  gateway up to ``gateway_timeout_s`` (then ``DROPPED``). Batch requests stay in the
  job's queue and are handed to replicas as their queues run short (load-aware).
- **failure of a replica** (spot reclaim, node failure, end of drain): requests that
  have not produced a token are retried through the router (a connection reset
  before the first byte is safe to retry); online requests mid-stream fail
  (``FAILED``); batch requests mid-stream are retried from scratch (a batch client
  retries).
- **teardown** stops new dispatches at once, hands queued requests back to the
  router, lets in-flight ones finish for ``drain_s`` (released early once empty),
  then cuts them as above and releases the instances. The old rank of a swap keeps
  serving its in-flight requests while the new one warms up: that is the A/B overlap.
- **scale** adds replicas (free slots on the rank's instances first) or drains the
  newest ones.
- **time** advances in macro-steps of ``step_s``; events (ready, reclaim, ...) take
  effect at the start of the step they fall in. Results are a deterministic function
  of the scenario, the seed and the sequence of calls.
"""

from __future__ import annotations

import math
import pickle
import zlib
from typing import Any

import numpy as np
from pydantic import Field

from koi import catalog
from koi.domain import Deployment, DeploymentState, Job, JobClass, Rank, ResourceMap, TelemetryWindow
from koi.domain.common import KoiModel
from koi.logging import get_logger
from koi.ports import LaunchResult, LaunchStatus
from koi.sim.arrivals import JobStream
from koi.sim.engine import DONE, Engine
from koi.sim.events import EventQueue
from koi.sim.fleet import Fleet
from koi.sim.lifecycle import ReplicaLifecycle
from koi.sim.physics import (
    chain_spec,
    check_chain,
    instances_per_replica,
    max_model_len,
    rank_tables,
)
from koi.sim.records import RECORD_DTYPE, RecordStore, Status, blank
from koi.sim.routing import RequestFlow

# ReqQueue is not used here: these names stay importable from koi.sim.world so that checkpoints
# pickled before the runtime state moved to koi.sim.runtime still restore
from koi.sim.runtime import JobRT, RankRT, ReplicaRT, ReqQueue, _Ahead  # noqa: F401
from koi.sim.scenario import Scenario
from koi.sim.telemetry import TelemetryStore

log = get_logger(__name__)

_CHECKPOINT_MAGIC = b"KOISIM1\n"
#: the longest a swapped-out rank waits for its replacement before draining anyway (a cold start
#: of the largest chains is ~5-10 min; a replacement that has not served by then has failed)
HANDOVER_TIMEOUT_S = 900.0


class JobProgress(KoiModel):
    """How far a job's requests have got (the evaluator's denominators and the driver's progress)."""

    job_id: str
    job_class: JobClass
    submitted_at: float
    arrived: int = Field(description="requests generated so far")
    served: int
    dropped: int
    timed_out: int
    failed: int
    in_flight: int = Field(description="on an engine")
    queued: int = Field(description="at the gateway / in the batch queue")
    tokens_out: int
    total_requests: int | None = Field(default=None, description="batch: the job's request count")
    finished_at: float | None = None
    departed: bool = False


# ---- the world ------------------------------------------------------------------------------------
class World(EventQueue, ReplicaLifecycle, RequestFlow):
    """The simulated fleet. Construct from a validated :class:`Scenario`."""

    def __init__(self, scenario: Scenario, *, seed: int | None = None, cluster_id: str = "sim"):
        self.scenario = scenario
        self.seed = scenario.seed if seed is None else int(seed)
        self.cluster_id = cluster_id
        self.t = 0.0
        self.step_s = scenario.step_s
        self.sample_s = scenario.sample_s
        self.next_sample = scenario.sample_s
        self.rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, 0x51ED])))
        self.fleet = Fleet(scenario)
        self.engine = Engine()
        self.store = RecordStore()
        self.tele = TelemetryStore()
        self.jobs: list[JobRT] = []
        self.job_index: dict[str, int] = {}
        self.ranks: list[RankRT] = []
        self.live_rank: dict[str, int] = {}  # rank_id -> rank idx (live or draining)
        self.replicas: list[ReplicaRT] = []
        self.eng_replica: list[int] = []
        self.keys: dict[str, Any] = {}
        self._noise: dict[tuple[int, int], float] = {}
        self.heap: list[tuple] = []
        self._hseq = 0
        self.log: list[dict[str, Any]] = []
        self._routing_dirty = True
        self._online_job = np.zeros(0, bool)
        # per-job counters: arrived, served, dropped, timed out, failed, tokens out
        self.jcount = np.zeros((6, 0), dtype=np.int64)
        # online arrivals generated ahead of time for every job (columnar, sorted by time)
        self._ahead = _Ahead()
        # vectorised round-robin routing: every job's wheel concatenated
        self._wheel_all = np.zeros(0, np.int64)
        self._wstart = np.zeros(0, np.int64)
        self._wlen = np.zeros(0, np.int64)
        self._wptr = np.zeros(0, np.int64)
        for spec in scenario.jobs:
            self.submit(spec.job)
        for i, ev in enumerate(scenario.events):
            self._push(ev.at_s, "scenario", i)
        for i, eff in enumerate(scenario.hidden):
            self._push(eff.start_s, "effect", i)
            if eff.end_s is not None:
                self._push(eff.end_s, "effect", i)

    # ================================================================== jobs
    def submit(self, job: Job) -> None:
        """Register a job: its requests start arriving at ``job.submitted_at`` (now, if that has passed)."""
        if job.job_id in self.job_index:
            raise ValueError(f"job {job.job_id!r} is already in the world")
        jr = JobRT(idx=len(self.jobs), job=job, stream=JobStream(job, self.seed, start=self.t))
        self.jobs.append(jr)
        self.job_index[job.job_id] = jr.idx
        self._online_job = np.array([j.online for j in self.jobs], bool)
        self.jcount = np.concatenate([self.jcount, np.zeros((6, 1), np.int64)], axis=1)
        for name in ("_wstart", "_wlen", "_wptr"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(1, np.int64)]))
        self._ahead.horizon = min(self._ahead.horizon, max(job.submitted_at, self.t))  # regenerate from here
        if job.lifetime_s is not None:
            self._push(job.submitted_at + job.lifetime_s, "job_leave", jr.idx)

    def job_arrivals(self) -> list[tuple[float, Job]]:
        """Every job the world will generate traffic for, with its submission time (sorted)."""
        return sorted(((j.job.submitted_at, j.job) for j in self.jobs), key=lambda x: (x[0], x[1].job_id))

    def jobs_submitted(self, t0: float, t1: float) -> list[Job]:
        """Jobs submitted in ``[t0, t1)``: what a driver signals to the planner."""
        return [j for t, j in self.job_arrivals() if t0 <= t < t1]

    @property
    def job_ids(self) -> list[str]:
        return [j.job.job_id for j in self.jobs]

    @property
    def rank_ids(self) -> list[str]:
        return [r.rank_id for r in self.ranks]

    # ================================================================== observer
    def now(self) -> float:
        return self.t

    def capacity(self) -> ResourceMap:
        return self.fleet.resource_map()

    def telemetry(
        self, t_start: float, t_end: float, *, cluster_id: str | None = None, tick: int = 0
    ) -> list[TelemetryWindow]:
        """One window per rank with samples in ``(t_start, t_end]``."""
        return self.tele.windows(self, t_start, t_end, cluster_id or self.cluster_id, tick)

    def telemetry_columns(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """All samples as columns: (times, rank indices, values[n, len(TELEMETRY_SERIES)])."""
        return self.tele.columns()

    def deployments(self) -> list[Deployment]:
        out = []
        for idx in self.live_rank.values():
            rk = self.ranks[idx]
            reps = [self.replicas[i] for i in rk.replicas]
            ready = sum(r.state == "serving" for r in reps)
            booting = sum(r.state == "booting" for r in reps)
            if rk.state in ("draining", "handover"):
                state = DeploymentState.DRAINING
            elif booting:
                state = DeploymentState.LAUNCHING
            elif ready == 0:
                state = DeploymentState.FAILED
            elif ready < rk.requested:
                state = DeploymentState.DEGRADED
            else:
                state = DeploymentState.SERVING
            out.append(
                Deployment(
                    job_id=rk.job_id,
                    rank=rk.rank.model_copy(update={"n_replicas": rk.requested}),
                    state=state,
                    replicas_ready=ready,
                    idempotency_key=rk.key,
                )
            )
        return out

    def events(self, t0: float = 0.0, t1: float = math.inf) -> list[dict[str, Any]]:
        """The lifecycle log (launches, ready, failures, reclaims, drains ...) in ``[t0, t1)``."""
        return [e for e in self.log if t0 <= e["t"] < t1]

    def progress(self, job_id: str) -> JobProgress:
        jr = self.jobs[self.job_index[job_id]]
        n = self.engine.n
        st = self.engine.req["state"][:n]
        inflight = int(np.sum((st != DONE) & (self.engine.req["job"][:n] == jr.idx)))
        return JobProgress(
            job_id=job_id,
            job_class=jr.job.job_class,
            submitted_at=jr.job.submitted_at,
            arrived=int(self.jcount[0, jr.idx]),
            served=int(self.jcount[1, jr.idx]),
            dropped=int(self.jcount[2, jr.idx]),
            timed_out=int(self.jcount[3, jr.idx]),
            failed=int(self.jcount[4, jr.idx]),
            in_flight=inflight,
            queued=len(jr.queue),
            tokens_out=int(self.jcount[5, jr.idx]),
            total_requests=jr.job.slo.num_requests if not jr.online else None,
            finished_at=jr.finished_at,
            departed=jr.departed,
        )

    def records(self, *, include_unfinished: bool = True) -> np.ndarray:
        """Per-request records (structured array, :data:`koi.sim.records.RECORD_DTYPE`)."""
        done = self.store.all()
        if not include_unfinished:
            return done.copy()
        parts = [done]
        eng = self.engine
        n = eng.n
        rows = np.flatnonzero(eng.req["state"][:n] != DONE)
        if len(rows):
            rec = eng._records(rows, np.full(len(rows), np.nan), Status.UNFINISHED)
            parts.append(rec)
        for jr in self.jobs:
            if len(jr.queue):
                rec = blank(len(jr.queue))
                rec["rid"] = jr.queue.rid
                rec["job"] = jr.idx
                rec["arrival"] = jr.queue.arr
                rec["tokens_in"] = jr.queue.prompt
                rec["status"] = Status.UNFINISHED
                parts.append(rec)
        return np.concatenate(parts)

    def cost(self) -> dict[str, Any]:
        """$ so far: the fleet's (allocated instances + idle reserved commitment), per job (the instances
        its ranks held, every rank it ever had) and per job and market (``per_job_market``: job →
        reserved / on-demand / spot → $, markets it never used absent)."""
        c = self.fleet.fleet_cost(self.t)
        job_of = {r.idx: self.jobs[r.job_idx].job.job_id for r in self.ranks}
        per_market: dict[str, dict[str, float]] = {jr.job.job_id: {} for jr in self.jobs}
        for (rank, market), usd in sorted(self.fleet.instance_cost_by_rank(self.t).items()):
            by = per_market[job_of[rank]]
            by[market] = by.get(market, 0.0) + usd
        per_job = {j: sum(by.values()) for j, by in per_market.items()}
        return {**c, "per_job": per_job, "per_job_market": per_market}

    def tokens_owed(self) -> np.ndarray:
        """Output tokens still owed per job (queued + in flight)."""
        eng = self.engine
        n = eng.n
        live = eng.req["state"][:n] != DONE
        owed = np.bincount(
            eng.req["job"][:n][live], weights=(eng.req["out"][:n] - eng.req["gen"][:n])[live], minlength=len(self.jobs)
        )
        for jr in self.jobs:
            owed[jr.idx] += float(jr.queue.out.sum())
            if not jr.online and jr.stream.buffer is not None:
                owed[jr.idx] += float(jr.stream.buffer.output.sum())
        return owed

    # ================================================================== executor
    def launch(self, job: Job, rank: Rank, idempotency_key: str) -> LaunchResult:
        if idempotency_key in self.keys:
            prev = self.keys[idempotency_key]
            if isinstance(prev, LaunchResult):
                return prev.model_copy(update={"status": LaunchStatus.DUPLICATE})
            return LaunchResult(job_id=job.job_id, rank_id=rank.rank_id(job.job_id), idempotency_key=idempotency_key,
                                status=LaunchStatus.DUPLICATE, replicas_requested=rank.n_replicas,
                                replicas_launched=0, reason="key used by another action")  # fmt: skip
        res = self._launch(job, rank, idempotency_key)
        self.keys[idempotency_key] = res
        self._log("launch" if res.status is LaunchStatus.LAUNCHED else "launch_failed", job_id=job.job_id,
                  rank_id=res.rank_id, replicas=res.replicas_launched, requested=res.replicas_requested,
                  reason=res.reason)  # fmt: skip
        return res

    def _launch(self, job: Job, rank: Rank, key: str) -> LaunchResult:
        rank_id = rank.rank_id(job.job_id)
        n = rank.n_replicas

        def failed(reason: str) -> LaunchResult:
            return LaunchResult(job_id=job.job_id, rank_id=rank_id, idempotency_key=key, status=LaunchStatus.FAILED,
                                replicas_requested=n, replicas_launched=0, reason=reason)  # fmt: skip

        if job.job_id not in self.job_index:
            return failed(f"unknown job {job.job_id!r}: submit it to the world first")
        if rank_id in self.live_rank:
            old = self.ranks[self.live_rank[rank_id]]
            working = [i for i in old.replicas if self.replicas[i].state in ("booting", "serving")]
            if old.state == "handover" and working:
                # the plan went back to a ladder whose teardown still waits for its replacement:
                # cancel the teardown instead of re-creating a serving rank
                old.state = "live"
                old.handover_until = math.inf
                self._routing_dirty = True
                self._log("teardown_cancelled", job_id=job.job_id, rank_id=rank_id)
                if n != old.requested:
                    return self._scale(job.job_id, rank_id, n, key)
                return LaunchResult(job_id=job.job_id, rank_id=rank_id, idempotency_key=key,
                                    status=LaunchStatus.LAUNCHED, replicas_requested=n,
                                    replicas_launched=len(working))  # fmt: skip
            if old.state == "live" and working:
                return failed(f"rank {rank_id} is already live; use scale to change its replicas")
            # A rank that lost every replica (none materialised, all reclaimed or failed), or one
            # still draining from an earlier teardown: the launch replaces it, as a re-created
            # deployment replaces a terminating one. The old incarnation is released now.
            self._log("rank_replaced", job_id=job.job_id, rank_id=rank_id, previous_state=old.state)
            self._finish_rank(old)
        cfg = rank.config
        pools = self.fleet.find(rank.env, cfg.instance_type, cfg.gpus)
        if not pools:
            it = f" with instance type {cfg.instance_type}" if cfg.instance_type else ""
            return failed(f"no pool in environment {rank.env.env_id}{it}")
        model = catalog.model(job.model)
        mlen = max_model_len(model, job)
        # the first pool of the environment whose shape can run the chain and that has room
        reasons, chosen = [], None
        for p in pools:
            why = check_chain(model, p.itype, cfg, min_kv_tokens=mlen)
            if why:
                reasons.append(why)
                continue
            ipr, rpi = instances_per_replica(cfg, p.itype)
            fit = p.free // ipr if ipr > 1 else p.free * rpi
            if chosen is None or fit > chosen[1]:
                chosen = (p, fit, ipr, rpi)
            if fit >= n:
                break
        if chosen is None:
            return failed(f"{job.model} {_shape(cfg)} cannot run on {rank.env.gpu_type}: {reasons[0]}")
        pool, fit, ipr, rpi = chosen
        k = min(fit, n)
        if k == 0:
            need = ipr if ipr > 1 else 1
            return failed(f"no free capacity in pool {pool.pool_id}: a replica needs {need} instance(s), "
                          f"{pool.free} free of {pool.capacity}")  # fmt: skip
        spec = chain_spec(job.model, pool.itype, cfg, mlen)
        tables = rank_tables(spec)
        idx = len(self.ranks)
        stack_idx = self.engine.stack.add(tables)
        assert stack_idx == idx
        rk = RankRT(idx=idx, rank_id=rank_id, job_id=job.job_id, job_idx=self.job_index[job.job_id],
                    rank=rank, pool=pool.idx, spec=spec, requested=n, launched_at=self.t, key=key,
                    inst_per_rep=ipr, reps_per_inst=rpi)  # fmt: skip
        self._rank_meta(rk, tables)
        self.ranks.append(rk)
        self.live_rank[rank_id] = idx
        self._add_replicas(rk, k)
        ready = max((self.replicas[i].ready_at for i in rk.replicas), default=self.t)
        reason = "" if k == n else f"capacity for {k} of {n} replicas in pool {pool.pool_id}"
        return LaunchResult(job_id=job.job_id, rank_id=rank_id, idempotency_key=key, status=LaunchStatus.LAUNCHED,
                            replicas_requested=n, replicas_launched=k, reason=reason, ready_at=ready)  # fmt: skip

    def teardown(self, job_id: str, rank_id: str, idempotency_key: str, *, drain_s: float | None = None,
                 handover: bool = False) -> bool:
        """Drain then release a rank; True when something was torn down (False: already gone, or a repeated key).

        ``handover`` (a swap's make-before-break): until its replacement serves, the rank stays in
        the router's rotation (and on the bill) and is reported as draining; the drain starts once
        a replacement serves, or after ``HANDOVER_TIMEOUT_S`` (a replacement that never materialises
        must not keep the old rank forever). The replacement is what the swap launched: the job's
        replicas booting when the teardown comes (S6 launches before it hands over); when none is
        booting, any other live rank of the job with a serving replica. Without it the rank leaves
        the rotation at once — right for a preemption, a release or a scale-in.

        Why the booting replicas, not any serving rank: a swap that keeps some of the job's ranks
        and replaces one (a partial rebuild, a rank moved to another pool) has serving ranks from
        the start, so "another rank serves" drained the replaced rank at once and the kept ranks
        carried its traffic through the new rank's cold start. On hetero-3h (Koi, seed 0) agent-235b's
        kept H200 ranks reached a p99 TPOT of 87–154 ms against 60 in the ticks after such swaps.
        """
        rk = self._claim_live_rank(job_id, rank_id, idempotency_key)
        if rk is None:
            return False
        drain = self.scenario.drain_s if drain_s is None else max(float(drain_s), 0.0)
        rk.awaited = tuple(i for idx in self.live_rank.values() if (other := self.ranks[idx]) is not rk
                           and other.job_idx == rk.job_idx and other.state == "live"
                           for i in other.replicas if self.replicas[i].state == "booting")
        if handover and rk.state == "live" and not self._replacement_serves(rk):
            rk.state = "handover"
            rk.handover_drain_s = drain
            rk.handover_until = self.t + HANDOVER_TIMEOUT_S
            self._log("teardown_deferred", job_id=job_id, rank_id=rank_id, drain_s=drain,
                      until=rk.handover_until)  # fmt: skip
            return True
        self._begin_teardown(rk, drain)
        return True

    def _replacement_serves(self, rk: RankRT) -> bool:
        """Does ``rk``'s replacement serve: one of the replicas it awaits, or — when it awaits none, or
        none of them boots any more — another live rank of its job (:meth:`teardown`)?"""
        states = [self.replicas[i].state for i in rk.awaited]
        if "serving" in states:
            return True
        if "booting" in states:
            return False
        for idx in self.live_rank.values():
            other = self.ranks[idx]
            if other is rk or other.job_idx != rk.job_idx or other.state != "live":
                continue
            if any(self.replicas[i].state == "serving" for i in other.replicas):
                return True
        return False

    def _handover_check(self, t: float) -> None:
        """Start the drain of every rank in handover whose replacement now serves (or whose wait ran out)."""
        for idx in list(self.live_rank.values()):
            rk = self.ranks[idx]
            if rk.state == "handover" and (t >= rk.handover_until - 1e-9 or self._replacement_serves(rk)):
                self._begin_teardown(rk, rk.handover_drain_s)

    def _begin_teardown(self, rk: RankRT, drain: float) -> None:
        rk.state = "draining"
        for i in list(rk.replicas):
            rep = self.replicas[i]
            if rep.state == "booting":
                self._end_replica(rep, "cancelled")
            elif rep.state == "serving":
                self._start_drain(rep)
        self._routing_dirty = True
        self._log("teardown", job_id=rk.job_id, rank_id=rk.rank_id, drain_s=drain)
        if drain <= 0:
            self._finish_rank(rk)
        else:
            self._push(self.t + drain, "rank_drained", self.live_rank[rk.rank_id])

    def _claim_live_rank(self, job_id: str, rank_id: str, idempotency_key: str) -> RankRT | None:
        """Record ``idempotency_key`` and return the job's live (or handed-over) rank; None when the
        key was applied before or no such rank runs."""
        if idempotency_key in self.keys:
            return None
        self.keys[idempotency_key] = True
        idx = self.live_rank.get(rank_id)
        if idx is None or self.ranks[idx].job_id != job_id or self.ranks[idx].state not in ("live", "handover"):
            return None
        return self.ranks[idx]

    def reweight(self, job_id: str, rank_id: str, route_weight: float, idempotency_key: str) -> bool:
        """Set a live rank's gateway weight (``Rank.route_weight``): the router's wheel is rebuilt
        at the next dispatch; no replica starts, stops or drains."""
        if not (math.isfinite(route_weight) and route_weight > 0):
            raise ValueError(f"route_weight of {rank_id} must be finite and positive, got {route_weight}")
        rk = self._claim_live_rank(job_id, rank_id, idempotency_key)
        if rk is None:
            return False
        rk.rank = rk.rank.model_copy(update={"route_weight": float(route_weight)})
        self._routing_dirty = True
        self._log("reweight", job_id=job_id, rank_id=rank_id, route_weight=float(route_weight))
        return True

    def scale(self, job_id: str, rank_id: str, n_replicas: int, idempotency_key: str, *,
              drain_s: float | None = None) -> LaunchResult:
        """Resize a rank. Scale-up launches replicas (cold start); scale-down drains the newest
        replicas for ``drain_s`` (the scenario's ``drain_s`` when None) — their in-flight requests
        finish, new ones go elsewhere — and 0 stops them at once (their requests are retried, or
        fail when already streaming), so the instances are free for the next launch."""
        if idempotency_key in self.keys:
            prev = self.keys[idempotency_key]
            if isinstance(prev, LaunchResult):
                return prev.model_copy(update={"status": LaunchStatus.DUPLICATE})
            return LaunchResult(job_id=job_id, rank_id=rank_id, idempotency_key=idempotency_key,
                                status=LaunchStatus.DUPLICATE, replicas_requested=n_replicas, replicas_launched=0)  # fmt: skip
        res = self._scale(job_id, rank_id, n_replicas, idempotency_key, drain_s)
        self.keys[idempotency_key] = res
        self._log("scale", job_id=job_id, rank_id=rank_id, replicas=n_replicas, status=res.status.value,
                  reason=res.reason)  # fmt: skip
        return res

    def _scale(self, job_id: str, rank_id: str, n: int, key: str, drain_s: float | None = None) -> LaunchResult:
        idx = self.live_rank.get(rank_id)

        def result(status: LaunchStatus, launched: int, reason: str = "") -> LaunchResult:
            return LaunchResult(job_id=job_id, rank_id=rank_id, idempotency_key=key, status=status,
                                replicas_requested=n, replicas_launched=launched, reason=reason)  # fmt: skip

        if idx is None or self.ranks[idx].state != "live" or self.ranks[idx].job_id != job_id:
            return result(LaunchStatus.FAILED, 0, f"rank {rank_id} of job {job_id} is not live")
        if n < 1:
            return result(LaunchStatus.FAILED, 0, "scale to 0 replicas: tear the rank down instead")
        rk = self.ranks[idx]
        active = [i for i in rk.replicas if self.replicas[i].state in ("booting", "serving")]
        cur = len(active)
        rk.requested = n
        if n > cur:
            added = self._add_replicas(rk, n - cur)
            reason = "" if added == n - cur else f"capacity for {added} of {n - cur} new replicas"
            status = LaunchStatus.LAUNCHED if added or cur else LaunchStatus.FAILED
            return result(status, cur + added, reason)
        victims = self._scale_in_victims(rk, active, cur - n)
        drain = self.scenario.drain_s if drain_s is None else max(float(drain_s), 0.0)
        for i in victims:
            rep = self.replicas[i]
            if rep.state == "booting":
                self._end_replica(rep, "cancelled")
            else:
                self._start_drain(rep)
                if drain <= 0:
                    self._end_replica(rep, "scaled_down")
                else:
                    self._push(self.t + drain, "replica_drained", i)
        self._routing_dirty = True
        return result(LaunchStatus.LAUNCHED, n)

    def _scale_in_victims(self, rk: RankRT, active: list[int], k: int) -> list[int]:
        """The ``k`` replicas a scale-in stops: booting ones first (they serve nobody yet), then
        whole instances — those hosting the fewest active replicas, newest first — so the rank
        gives back the instances the planner's capacity model (C1, ``instances_for``) counted as
        freed. Taking merely the newest replicas could leave every instance half used and free
        none (hetero-3h: a 6→4 scale-in of TP2PP2 replicas, two per node, freed no node, and the
        launch C1 had placed on the returned node was refused)."""
        booting = sorted((i for i in active if self.replicas[i].state == "booting"), reverse=True)
        victims = booting[:k]
        if len(victims) == k:
            return victims
        chosen = set(victims)
        by_inst: dict[int, list[int]] = {}
        for i in (i for i in active if i not in chosen):
            for iid in self.replicas[i].instances:
                by_inst.setdefault(iid, []).append(i)
        order = sorted(by_inst, key=lambda iid: (len(rk.hosted.get(iid, by_inst[iid])), -max(by_inst[iid])))
        for iid in order:
            for i in sorted(by_inst[iid], reverse=True):
                if len(victims) < k and i not in chosen:
                    victims.append(i)
                    chosen.add(i)
        return victims

    # ================================================================== time
    def advance(self, t: float) -> None:
        """Run the world until time ``t`` (no-op when ``t`` is not in the future).

        Steps end on the grid of multiples of ``step_s``; advancing to an off-grid time splits
        one step, and the next step ends on the grid again.
        """
        while self.t < t - 1e-9:
            k = math.floor(self.t / self.step_s + 1e-9) + 1
            t1 = min(k * self.step_s, t)
            if t - t1 < 1e-6:
                t1 = t
            self._step(self.t, t1)
            self.t = t1

    def _step(self, t0: float, t1: float) -> None:
        self._process_events(t1)
        if self._routing_dirty:
            self._rebuild_routing()
        self._arrivals(t0, t1)
        self._gateway(t0, t1)
        self._batch_topup(t0)
        out = self.engine.step(t0, t1)
        if len(out.records):
            self._terminal(out.records)
        self.tele.add_latencies(out.ttft_rep, out.ttft, out.tpot_rep, out.tpot)
        if t1 >= self.next_sample - 1e-9:
            self._timeouts(t1)
            self._handover_check(t1)
            self._drain_check(t1)
            self.tele.sample(self, t1)
            while self.next_sample <= t1 + 1e-9:
                self.next_sample += self.sample_s
            self._refresh_effects(t1, redraw=True)

    # ---- log ----------------------------------------------------------------------------------------
    def _log(self, kind: str, **detail: Any) -> None:
        self.log.append({"t": self.t, "kind": kind, **detail})

    # ================================================================== checkpoint
    def checkpoint(self) -> bytes:
        """The whole state as bytes; :meth:`restore` continues identically. Trusted input only (pickle)."""
        payload = pickle.dumps(self, protocol=pickle.HIGHEST_PROTOCOL)
        return _CHECKPOINT_MAGIC + zlib.compress(payload, 1)

    @classmethod
    def restore(cls, data: bytes) -> World:
        if not data.startswith(_CHECKPOINT_MAGIC):
            raise ValueError("not a koi.sim world checkpoint")
        world = pickle.loads(zlib.decompress(data[len(_CHECKPOINT_MAGIC):]))  # noqa: S301 - our own checkpoint
        if not isinstance(world, cls):
            raise ValueError("checkpoint does not hold a World")
        return world


def _shape(cfg) -> str:  # noqa: ANN001
    return f"tp={cfg.tp} pp={cfg.pp} dp={cfg.dp} {cfg.weight_dtype.value}"


__all__ = ["JobProgress", "World", "RECORD_DTYPE"]
