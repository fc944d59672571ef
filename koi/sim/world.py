"""The world: a fleet simulator with the Executor/Observer surface of :mod:`koi.ports`.

:class:`World` owns the fleet (pools, instances, prices, capacity events), the jobs'
request streams, every replica engine (:mod:`koi.sim.engine`), the lifecycle of
ranks (cold start, warm-up, drain, A/B overlap, replicas that fail to materialize or
come up degraded), the hidden effects of the scenario, per-request records and
sub-tick telemetry. Its action and observation methods carry the names and
semantics of :class:`koi.ports.Executor` and :class:`koi.ports.Observer`, so
``infra/`` wraps it by delegation.

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

import heapq
import math
import pickle
import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import Field

from koi import catalog
from koi.domain import Deployment, DeploymentState, Job, JobClass, Rank, ResourceMap, TelemetryWindow
from koi.domain.common import KoiModel
from koi.logging import get_logger
from koi.ports import LaunchResult, LaunchStatus
from koi.sim.arrivals import JobStream
from koi.sim.engine import DONE, WAITING, Engine
from koi.sim.fleet import Fleet
from koi.sim.physics import (
    ChainSpec,
    chain_spec,
    check_chain,
    instances_per_replica,
    max_model_len,
    rank_tables,
    weight_load_s,
)
from koi.sim.records import RECORD_DTYPE, RecordStore, Status, blank
from koi.sim.scenario import HiddenEffect, Match, Scenario
from koi.sim.tables import B_AXIS, C_AXIS, RankTables
from koi.sim.telemetry import TelemetryStore

log = get_logger(__name__)

_CHECKPOINT_MAGIC = b"KOISIM1\n"
_RID_SHIFT = 40
_AHEAD_S = 60.0  # online arrivals are generated this far ahead, for all jobs at once
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


# ---- runtime state -----------------------------------------------------------------------------
class ReqQueue:
    """Requests not on any engine yet, FIFO, columnar."""

    __slots__ = ("rid", "arr", "prompt", "out", "prefix")

    def __init__(self) -> None:
        self.rid = np.zeros(0, np.int64)
        self.arr = np.zeros(0)
        self.prompt = np.zeros(0, np.int32)
        self.out = np.zeros(0, np.int32)
        self.prefix = np.zeros(0, np.int32)

    def __len__(self) -> int:
        return len(self.rid)

    def push(self, rid, arr, prompt, out, prefix, front: bool = False) -> None:  # noqa: ANN001
        if len(rid) == 0:
            return
        for name, new in (("rid", rid), ("arr", arr), ("prompt", prompt), ("out", out), ("prefix", prefix)):
            cur = getattr(self, name)
            setattr(self, name, np.concatenate([new, cur] if front else [cur, new]).astype(cur.dtype))

    def pop(self, k: int) -> tuple[np.ndarray, ...]:
        k = min(k, len(self))
        out = (self.rid[:k], self.arr[:k], self.prompt[:k], self.out[:k], self.prefix[:k])
        self.rid, self.arr, self.prompt, self.out, self.prefix = (
            self.rid[k:], self.arr[k:], self.prompt[k:], self.out[k:], self.prefix[k:],
        )  # fmt: skip
        return out

    def drop_older(self, t_cut: float) -> tuple[np.ndarray, ...]:
        """Remove and return entries that arrived before ``t_cut``."""
        m = self.arr < t_cut
        out = (self.rid[m], self.arr[m], self.prompt[m], self.out[m], self.prefix[m])
        if len(out[0]):
            keep = ~m
            self.rid, self.arr, self.prompt, self.out, self.prefix = (
                self.rid[keep], self.arr[keep], self.prompt[keep], self.out[keep], self.prefix[keep],
            )  # fmt: skip
        return out


@dataclass
class JobRT:
    idx: int
    job: Job
    stream: JobStream
    queue: ReqQueue = field(default_factory=ReqQueue)
    next_seq: int = 0
    wheel: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    wptr: int = 0
    departed: bool = False
    finished_at: float | None = None
    online: bool = field(init=False)

    def __post_init__(self) -> None:
        self.online = self.job.job_class is JobClass.ONLINE


@dataclass
class ReplicaRT:
    idx: int
    rank: int
    engines: list[int]
    instances: list[int]
    launched_at: float
    ready_at: float
    state: str = "booting"  # booting | serving | draining | failed | dead
    degraded: bool = False
    static_speed: float = 1.0
    effects: list[int] = field(default_factory=list)
    ended_at: float = math.inf


@dataclass
class RankRT:
    idx: int
    rank_id: str
    job_id: str
    job_idx: int
    rank: Rank
    pool: int
    spec: ChainSpec
    requested: int
    launched_at: float
    key: str
    inst_per_rep: int
    reps_per_inst: int
    state: str = "live"  # live | handover | draining | gone
    replicas: list[int] = field(default_factory=list)
    instances: list[int] = field(default_factory=list)
    hosted: dict[int, list[int]] = field(default_factory=dict)  # instance -> replicas on it
    ended_at: float = math.inf
    hourly_cost: float = 0.0
    handover_drain_s: float = 0.0  # state "handover": the drain to start once the job's other ranks serve
    handover_until: float = math.inf  # ... or at this time, whichever comes first
    nominal: float = 1.0
    idle_bubble: float = 0.0
    idle_comm_pct: float = 0.0
    idle_comm_bytes: float = 0.0
    idle_mem_fraction: float = 0.0
    vram_gb: float = 0.0

    def reports(self, t0: float, t1: float) -> bool:
        return self.launched_at < t1 and self.ended_at > t0


class _Ahead:
    """Online arrivals of every job generated ahead of the clock, sorted by time (columnar)."""

    def __init__(self) -> None:
        self.horizon = 0.0
        self.cols: tuple[np.ndarray, ...] = (
            np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0), np.zeros(0, np.int32),
            np.zeros(0, np.int32), np.zeros(0, np.int32),
        )  # fmt: skip
        self.pos = 0

    def take_rest(self) -> tuple[np.ndarray, ...]:
        return tuple(c[self.pos :] for c in self.cols)

    def set(self, parts: list[tuple[np.ndarray, ...]]) -> None:
        cols = tuple(np.concatenate([p[i] for p in parts]) for i in range(6))
        o = np.lexsort((cols[0], cols[2]))  # by time, then request id (deterministic ties)
        self.cols = tuple(c[o] for c in cols)
        self.pos = 0

    def pop_until(self, t: float) -> tuple[np.ndarray, ...]:
        k = int(self.cols[2].searchsorted(t, side="left"))
        out = tuple(c[self.pos : k] for c in self.cols)
        self.pos = max(k, self.pos)
        return out


# ---- the world ------------------------------------------------------------------------------------
class World:
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
        """$ so far: the fleet's (allocated instances + idle reserved commitment) and per job."""
        c = self.fleet.fleet_cost(self.t)
        per_job: dict[str, float] = {}
        for jr in self.jobs:
            ranks = {r.idx for r in self.ranks if r.job_idx == jr.idx}
            per_job[jr.job.job_id] = self.fleet.instance_cost(self.t, ranks) if ranks else 0.0
        return {**c, "per_job": per_job}

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

        ``handover`` (a swap's make-before-break): while no *other* live rank of the job has a
        serving replica, the rank stays in the router's rotation (and on the bill) and is reported
        as draining; the drain starts once a replacement serves, or after ``HANDOVER_TIMEOUT_S``
        (a replacement that never materialises must not keep the old rank forever). Without it the
        rank leaves the rotation at once — right for a preemption, a release or a scale-in.
        """
        rk = self._claim_live_rank(job_id, rank_id, idempotency_key)
        if rk is None:
            return False
        drain = self.scenario.drain_s if drain_s is None else max(float(drain_s), 0.0)
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
        """Does another live rank of ``rk``'s job have a serving replica?"""
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

    # ---- events ------------------------------------------------------------------------------------
    def _push(self, t: float, kind: str, *payload: Any) -> None:
        heapq.heappush(self.heap, (float(t), self._hseq, kind, payload))
        self._hseq += 1

    def _process_events(self, t1: float) -> None:
        t0 = self.t
        while self.heap and self.heap[0][0] < t1:
            t, _, kind, payload = heapq.heappop(self.heap)
            self.t = max(t, t0)  # handlers log and bill at the event's own time
            getattr(self, f"_ev_{kind}")(self.t, *payload)
        self.t = t0

    def _ev_ready(self, t: float, rep_idx: int) -> None:
        rep = self.replicas[rep_idx]
        if rep.state != "booting":
            return
        rep.state = "serving"
        for e in rep.engines:
            self.engine.start_replica(e)
        self._refresh_effects(t, redraw=False, only=[rep])
        self._routing_dirty = True
        rk = self.ranks[rep.rank]
        self._log("replica_ready", job_id=rk.job_id, rank_id=rk.rank_id, replica=rep.idx, degraded=rep.degraded)
        self._handover_check(t)

    def _ev_matfail(self, t: float, rep_idx: int) -> None:
        rep = self.replicas[rep_idx]
        if rep.state != "booting":
            return
        rk = self.ranks[rep.rank]
        self._end_replica(rep, "failed")
        self._log("replica_failed_to_materialize", job_id=rk.job_id, rank_id=rk.rank_id, replica=rep.idx)

    def _ev_instance_lost(self, t: float, iid: int, epoch: int, why: str) -> None:
        inst = self.fleet.instances[iid]
        if not inst.live or inst.epoch != epoch:
            return
        pool = self.fleet.pools[inst.pool]
        self.fleet.set_capacity(pool, pool.capacity - 1, t)
        delay = pool.spec.return_after_s if why == "spot_reclaim" else pool.spec.repair_s
        self._push(t + self.rng.exponential(delay), "capacity_return", pool.idx, 1)
        self._log(why, pool=pool.pool_id, instances=1, capacity=pool.capacity)
        self._kill_instance(iid, why)

    def _ev_capacity_return(self, t: float, pool_idx: int, k: int) -> None:
        pool = self.fleet.pools[pool_idx]
        self.fleet.set_capacity(pool, pool.capacity + k, t)
        self._log("capacity_return", pool=pool.pool_id, instances=k, capacity=pool.capacity)

    def _ev_scenario(self, t: float, i: int) -> None:
        ev = self.scenario.events[i]
        pool = self.fleet.pools[self.scenario.pool_index(ev.pool)]
        if ev.kind == "capacity_return":
            self._ev_capacity_return(t, pool.idx, ev.instances)
            return
        if ev.kind == "set_capacity":
            self.fleet.set_capacity(pool, ev.instances, t)
            self._log("set_capacity", pool=pool.pool_id, capacity=ev.instances)
        else:
            k = min(ev.instances, pool.capacity)
            self.fleet.set_capacity(pool, pool.capacity - k, t)
            if ev.kind == "spot_reclaim":
                delay = ev.return_after_s or pool.spec.return_after_s
            else:
                delay = ev.return_after_s or pool.spec.repair_s
            if k:
                self._push(t + delay, "capacity_return", pool.idx, k)
            self._log(ev.kind, pool=pool.pool_id, instances=k, capacity=pool.capacity)
        live = self.fleet.live_instances(pool)
        excess = len(live) - pool.capacity
        if excess > 0:
            victims = sorted(self.rng.choice(live, size=excess, replace=False).tolist())
            for iid in victims:
                self._kill_instance(iid, ev.kind)

    def _ev_effect(self, t: float, i: int) -> None:
        self._refresh_effects(t, redraw=False)

    def _ev_job_leave(self, t: float, job_idx: int) -> None:
        jr = self.jobs[job_idx]
        jr.departed = True
        self._log("job_left", job_id=jr.job.job_id)

    def _ev_rank_drained(self, t: float, rank_idx: int) -> None:
        rk = self.ranks[rank_idx]
        if rk.state == "draining":
            self._finish_rank(rk)

    def _ev_replica_drained(self, t: float, rep_idx: int) -> None:
        rep = self.replicas[rep_idx]
        if rep.state == "draining":
            self._end_replica(rep, "drained")

    # ---- replicas and instances -----------------------------------------------------------------
    def _rank_meta(self, rk: RankRT, tables: RankTables) -> None:
        ib = int(np.searchsorted(B_AXIS, 64.0))
        ic = int(np.searchsorted(C_AXIS, 1024.0))
        rk.nominal = 64.0 / float(tables.dec_time[ib, ic])
        rk.idle_bubble = float(tables.dec_bubble[1, ic])
        t1 = float(tables.dec_time[1, ic])
        rk.idle_comm_pct = 100.0 * float(tables.dec_comm[1, ic]) / t1 if t1 > 0 else 0.0
        rk.idle_comm_bytes = float(tables.dec_comm_bytes[1])
        rk.idle_mem_fraction = tables.static_bytes / tables.vram_bytes
        rk.vram_gb = tables.vram_bytes / 1e9

    def _add_replicas(self, rk: RankRT, k: int) -> int:
        """Start ``k`` more replicas of ``rk``: free slots on its instances first, then new instances."""
        pool = self.fleet.pools[rk.pool]
        added = 0
        while added < k:
            iids: list[int] | None = None
            if rk.inst_per_rep == 1:
                for iid in rk.instances:
                    if self.fleet.instances[iid].live and len(rk.hosted.get(iid, [])) < rk.reps_per_inst:
                        iids = [iid]
                        break
            if iids is None:
                if pool.free < rk.inst_per_rep:
                    break
                iids = self.fleet.allocate(pool, rk.inst_per_rep, rk.idx, self.t)
                rk.instances.extend(iids)
                for iid in iids:
                    rk.hosted[iid] = []
                    self._hazards(iid)
            self._spawn(rk, iids)
            added += 1
        rk.hourly_cost = self.fleet.hourly(rk.instances)
        return added

    def _hazards(self, iid: int) -> None:
        inst = self.fleet.instances[iid]
        spec = self.fleet.pools[inst.pool].spec
        if spec.reclaim_rate_per_hour > 0:
            self._push(self.t + self.rng.exponential(3600.0 / spec.reclaim_rate_per_hour), "instance_lost", iid,
                       inst.epoch, "spot_reclaim")  # fmt: skip
        if spec.failure_rate_per_hour > 0:
            self._push(self.t + self.rng.exponential(3600.0 / spec.failure_rate_per_hour), "instance_lost", iid,
                       inst.epoch, "node_failure")  # fmt: skip

    def _spawn(self, rk: RankRT, iids: list[int]) -> None:
        pool = self.fleet.pools[rk.pool]
        lc = self.scenario.lifecycle_of(pool.spec)
        tables = self.engine.stack.tables[rk.idx]
        ready = self.t + lc.provision_s + weight_load_s(tables, lc.load_gbps) + lc.warmup_s
        u = self.rng.random(2)
        fails = bool(u[0] < lc.materialize_fail_prob)
        degraded = bool(u[1] < lc.degraded_prob)
        effects = [i for i, e in enumerate(self.scenario.hidden) if self._matches(e.match, rk)]
        static = 1.0 / lc.degraded_factor if degraded else 1.0
        for i in effects:
            e = self.scenario.hidden[i]
            if e.kind == "engine_change" and e.applies_to == "new" and e.start_s <= self.t and (
                e.end_s is None or self.t < e.end_s
            ):
                static /= e.throughput_factor
        rep = ReplicaRT(idx=len(self.replicas), rank=rk.idx, engines=[], instances=list(iids), launched_at=self.t,
                        ready_at=ready, degraded=degraded, static_speed=static, effects=effects)  # fmt: skip
        for _ in range(rk.rank.config.dp):
            e = self.engine.add_replica(rk.idx, rk.job_idx, static)
            rep.engines.append(e)
            self.eng_replica.append(rep.idx)
        self.replicas.append(rep)
        rk.replicas.append(rep.idx)
        for iid in iids:
            rk.hosted.setdefault(iid, []).append(rep.idx)
        self._push(ready, "matfail" if fails else "ready", rep.idx)

    def _matches(self, m: Match, rk: RankRT) -> bool:
        env = rk.rank.env
        pool = self.fleet.pools[rk.pool]
        checks = {
            "cloud": env.cloud, "region": env.region, "zone": env.zone, "market": env.market,
            "gpu_type": env.gpu_type, "instance_type": pool.itype.name, "model": catalog.canonical_model(
                self.jobs[rk.job_idx].job.model), "engine_name": rk.rank.config.engine_name, "job_id": rk.job_id,
        }  # fmt: skip
        for k, v in checks.items():
            want = getattr(m, k)
            if want is not None and (want.lower() if isinstance(want, str) else want) != (
                v.lower() if isinstance(v, str) else v
            ):
                return False
        return True

    def _refresh_effects(self, t: float, *, redraw: bool, only: list[ReplicaRT] | None = None) -> None:
        """Time-varying hidden effects: recompute each live replica's step-time and comm multipliers."""
        if not self.scenario.hidden:
            return
        eff = self.scenario.hidden
        reps = only if only is not None else [r for r in self.replicas if r.state in ("booting", "serving", "draining")]
        for rep in reps:
            if not rep.effects:
                continue
            dyn, commf = 1.0, 1.0
            for i in rep.effects:
                e: HiddenEffect = eff[i]
                if t < e.start_s or (e.end_s is not None and t >= e.end_s):
                    continue
                if e.kind == "efficiency":
                    dyn *= e.step_time_factor
                elif e.kind == "engine_change" and e.applies_to == "all":
                    dyn /= e.throughput_factor
                elif e.kind == "interconnect":
                    commf *= e.comm_factor
                elif e.kind == "noisy_neighbours":
                    if e.jitter_cv > 0:
                        key = (rep.idx, i)
                        if redraw or key not in self._noise:
                            s2 = math.log1p(e.jitter_cv**2)
                            self._noise[key] = float(
                                self.rng.lognormal(math.log(e.step_time_factor) - s2 / 2, math.sqrt(s2))
                            )
                        dyn *= self._noise[key]
                    else:
                        dyn *= e.step_time_factor
            for en in rep.engines:
                self.engine.rep["dyn"][en] = dyn
                self.engine.rep["commf"][en] = commf

    def _start_drain(self, rep: ReplicaRT) -> None:
        rep.state = "draining"
        for e in rep.engines:
            self.engine.stop_accepting(e)
        # queued requests that have not started go back to the router
        eng = self.engine
        mask = np.zeros(eng.R, bool)
        mask[rep.engines] = True
        rows = eng.rows_of(mask)
        rows = rows[(eng.req["state"][rows] == WAITING) & np.isnan(eng.req["ftok"][rows])]
        self._requeue(rows)
        self._routing_dirty = True

    def _end_replica(self, rep: ReplicaRT, why: str) -> None:
        """A replica stops for good: its requests are retried or failed, its instances released when empty."""
        eng = self.engine
        mask = np.zeros(eng.R, bool)
        mask[rep.engines] = True
        rows = eng.rows_of(mask)
        if len(rows):
            started = ~np.isnan(eng.req["ftok"][rows])
            online = self._online_job[eng.req["job"][rows]]
            fail = rows[started & online]
            if len(fail):
                self._terminal(eng.take_records(fail, self.t, Status.FAILED))
            self._requeue(rows[~(started & online)])
        for e in rep.engines:
            eng.rep["alive"][e] = False
            eng.rep["accept"][e] = False
        rep.state = "failed" if why == "failed" else "dead"
        rep.ended_at = self.t
        rk = self.ranks[rep.rank]
        for iid in rep.instances:
            hosted = rk.hosted.get(iid, [])
            if rep.idx in hosted:
                hosted.remove(rep.idx)
            if not hosted and self.fleet.instances[iid].live:
                self.fleet.release(iid, self.t)
        rk.hourly_cost = self.fleet.hourly(rk.instances)
        self._routing_dirty = True

    def _kill_instance(self, iid: int, why: str) -> None:
        inst = self.fleet.instances[iid]
        rk = self.ranks[inst.rank]
        victims = [self.replicas[i] for i in list(rk.hosted.get(iid, []))]
        for rep in victims:
            if rep.state in ("booting", "serving", "draining"):
                self._end_replica(rep, "dead")
                self._log("replica_lost", job_id=rk.job_id, rank_id=rk.rank_id, replica=rep.idx, cause=why)
        if inst.live:
            self.fleet.release(iid, self.t)
        rk.hourly_cost = self.fleet.hourly(rk.instances)
        self._log("instance_lost", job_id=rk.job_id, rank_id=rk.rank_id, instance=iid, cause=why,
                  pool=self.fleet.pools[inst.pool].pool_id)  # fmt: skip

    def _finish_rank(self, rk: RankRT) -> None:
        for i in list(rk.replicas):
            rep = self.replicas[i]
            if rep.state in ("booting", "serving", "draining"):
                self._end_replica(rep, "drained")
        for iid in rk.instances:
            if self.fleet.instances[iid].live:
                self.fleet.release(iid, self.t)
        rk.hourly_cost = 0.0
        rk.state = "gone"
        rk.ended_at = self.t
        self.live_rank.pop(rk.rank_id, None)
        self._routing_dirty = True
        self._log("rank_released", job_id=rk.job_id, rank_id=rk.rank_id)

    def _drain_check(self, t: float) -> None:
        """Release draining replicas and ranks that have nothing left in flight."""
        eng = self.engine
        out = eng.outstanding()
        for rk in self.ranks:
            if rk.state == "gone":
                continue
            for i in rk.replicas:
                rep = self.replicas[i]
                if rep.state == "draining" and not any(out[e] for e in rep.engines if e < len(out)):
                    self._end_replica(rep, "drained")
            if rk.state == "draining" and all(self.replicas[i].state not in ("draining", "serving", "booting")
                                              for i in rk.replicas):  # fmt: skip
                self._finish_rank(rk)

    # ---- requests -------------------------------------------------------------------------------------
    def _rebuild_routing(self) -> None:
        caps: dict[int, list[tuple[int, float]]] = {}
        for rk in self.ranks:
            if rk.state not in ("live", "handover"):
                continue
            for i in rk.replicas:
                rep = self.replicas[i]
                if rep.state == "serving":
                    for e in rep.engines:
                        caps.setdefault(rk.job_idx, []).append(
                            (e, rk.nominal / rep.static_speed, rk.rank.route_weight, rep.static_speed))
        for jr in self.jobs:
            slots: list[tuple[float, int]] = []
            raw = caps.get(jr.idx, [])
            # the planner's weights when every serving rank carries one (one unit system), else nominal
            planned = bool(raw) and all(w is not None for _, _, w, _ in raw)
            entries = [(e, (w / sp) if planned else c) for e, c, w, sp in raw]
            if entries:
                lo = min(c for _, c in entries)
                for e, c in entries:
                    w = max(1, min(16, round(4.0 * c / lo)))
                    slots.extend(((j + 0.5) / w, e) for j in range(w))
            slots.sort()
            jr.wheel = np.array([e for _, e in slots], dtype=np.int64)
        lens = np.array([len(jr.wheel) for jr in self.jobs], dtype=np.int64)
        self._wstart = np.cumsum(lens) - lens
        self._wlen = lens
        self._wptr = np.where(lens > 0, self._wptr % np.maximum(lens, 1), 0)
        self._wheel_all = np.concatenate([jr.wheel for jr in self.jobs]) if self.jobs else np.zeros(0, np.int64)
        self._routing_dirty = False

    def _new_ids(self, jr: JobRT, k: int) -> np.ndarray:
        ids = (np.int64(jr.idx) << _RID_SHIFT) + jr.next_seq + np.arange(k, dtype=np.int64)
        jr.next_seq += k
        return ids

    def _refill(self, until: float) -> None:
        """Generate every online job's arrivals up to ``until`` (ids and clipped lengths included)."""
        ah = self._ahead
        parts = [ah.take_rest()]
        for jr in self.jobs:
            if not jr.online or jr.stream.exhausted and not len(jr.stream.buffer):
                continue
            b = jr.stream.until(until)
            k = len(b)
            if not k:
                continue
            mx = catalog.model(jr.job.model).max_context
            prompt = np.minimum(b.prompt, mx - 1).astype(np.int32)
            out = np.minimum(b.output, mx - prompt).astype(np.int32)
            prefix = np.minimum(b.prefix, prompt).astype(np.int32)
            parts.append((self._new_ids(jr, k), np.full(k, jr.idx, np.int32), b.arrival, prompt, out, prefix))
        ah.set(parts)
        ah.horizon = until

    def _arrivals(self, t0: float, t1: float) -> None:
        # batch jobs: the whole request set arrives at submission, into the job's queue
        for jr in self.jobs:
            if not jr.online and jr.job.submitted_at < t1 and not jr.stream.exhausted_taken:
                b = jr.stream.until(t1)
                jr.stream.exhausted_taken = True
                k = len(b)
                if k:
                    self.jcount[0, jr.idx] += k
                    jr.queue.push(self._new_ids(jr, k), b.arrival, b.prompt, b.output, np.minimum(b.prefix, b.prompt))
        ah = self._ahead
        if t1 > ah.horizon:
            self._refill(max(t1, ah.horizon) + _AHEAD_S)
        rid, job, arr, prompt, out, prefix = ah.pop_until(t1)
        k = len(rid)
        if not k:
            return
        nj = len(self.jobs)
        self.jcount[0] += np.bincount(job, minlength=nj)
        o = np.argsort(job, kind="stable")
        js = job[o]
        pos = np.arange(k) - np.searchsorted(js, js, side="left")
        wl = self._wlen[js]
        routed = wl > 0
        eng = np.full(k, -1, np.int64)
        if routed.any():
            jr_ = js[routed]
            eng_r = self._wheel_all[self._wstart[jr_] + (self._wptr[jr_] + pos[routed]) % wl[routed]]
            eng[o[routed]] = eng_r
            cnt = np.bincount(js[routed], minlength=nj)
            self._wptr = np.where(self._wlen > 0, (self._wptr + cnt) % np.maximum(self._wlen, 1), 0)
        ok = eng >= 0
        if ok.all():
            self.engine.dispatch(rid, job, eng, arr, arr, prompt, out, prefix)
            return
        if ok.any():
            self.engine.dispatch(rid[ok], job[ok], eng[ok], arr[ok], arr[ok], prompt[ok], out[ok], prefix[ok])
        miss = ~ok
        for j in np.unique(job[miss]):
            m = miss & (job == j)
            self.jobs[int(j)].queue.push(rid[m], arr[m], prompt[m], out[m], prefix[m])

    def _gateway(self, t0: float, t1: float) -> None:
        for jr in self.jobs:
            if not jr.online or not len(jr.queue):
                continue
            if len(jr.wheel):
                rid, arr, prompt, out, prefix = jr.queue.pop(len(jr.queue))
                k = len(rid)
                ptr = int(self._wptr[jr.idx])
                eng = jr.wheel[(ptr + np.arange(k)) % len(jr.wheel)]
                self._wptr[jr.idx] = (ptr + k) % len(jr.wheel)
                self.engine.dispatch(rid, np.full(k, jr.idx, np.int32), eng, arr, np.maximum(arr, t0), prompt, out,
                                     prefix)  # fmt: skip
            else:
                rid, arr, prompt, out, prefix = jr.queue.drop_older(t1 - self.scenario.gateway_timeout_s)
                if len(rid):
                    rec = blank(len(rid))
                    rec["rid"], rec["job"], rec["arrival"], rec["tokens_in"] = rid, jr.idx, arr, prompt
                    rec["finish"] = np.maximum(arr + self.scenario.gateway_timeout_s, t0)
                    rec["status"] = Status.DROPPED
                    self._terminal(rec)

    def _batch_topup(self, t0: float) -> None:
        need = [jr for jr in self.jobs if not jr.online and len(jr.queue) and len(jr.wheel)]
        if not need:
            return
        eng = self.engine
        waiting = eng.waiting_count()
        outstanding = eng.outstanding()
        maxs = eng.rep["maxs"][: eng.R]
        nfin = eng.rep["nfin"][: eng.R]
        for jr in need:
            es = np.unique(jr.wheel)
            admitted = outstanding[es] - waiting[es]
            # enough queued to cover a step's admissions, never more than the free slots can take
            target = np.minimum(np.clip(np.ceil(3 * nfin[es]) + 8, 16, 128), np.maximum(maxs[es] - admitted, 0) + 16)
            deficit = np.maximum(target - waiting[es], 0).astype(np.int64)
            total = int(deficit.sum())
            if total <= 0:
                continue
            rid, arr, prompt, out, prefix = jr.queue.pop(total)
            k = len(rid)
            target_e = np.repeat(es, deficit)[:k]
            eng.dispatch(rid, np.full(k, jr.idx, np.int32), target_e, arr, np.full(k, t0), prompt, out, prefix)

    def _requeue(self, rows: np.ndarray) -> None:
        """Take requests off their engine and hand them back to their job's router (front of the queue)."""
        if not len(rows):
            return
        eng = self.engine
        q = eng.req
        jobs = q["job"][rows]
        for j in np.unique(jobs):
            r = rows[jobs == j]
            r = r[np.argsort(q["arr"][r], kind="stable")]
            self.jobs[int(j)].queue.push(q["rid"][r], q["arr"][r], q["prompt"][r], q["out"][r], q["prefix"][r],
                                         front=True)  # fmt: skip
        eng.remove_rows(rows)

    def _timeouts(self, t: float) -> None:
        eng = self.engine
        n = eng.n
        q = eng.req
        st = q["state"][:n]
        late = (st == WAITING) & np.isnan(q["ftok"][:n]) & (t - q["arr"][:n] > self.scenario.client_timeout_s)
        if np.any(late):
            late &= self._online_job[q["job"][:n]]
            rows = np.flatnonzero(late)
            if len(rows):
                self._terminal(eng.take_records(rows, t, Status.TIMEOUT))

    def _terminal(self, rec: np.ndarray) -> None:
        self.store.add(rec)
        nj = len(self.jobs)
        j = rec["job"]
        st = rec["status"].astype(np.int64)
        # counters 1..4 are statuses SERVED, DROPPED, TIMEOUT, FAILED (0..3)
        self.jcount[1:5] += np.bincount(st * nj + j, minlength=4 * nj).reshape(4, nj)
        self.jcount[5] += np.bincount(j, weights=rec["tokens_out"], minlength=nj).astype(np.int64)
        if self._online_job[j].all():
            return
        for i in np.unique(j[~self._online_job[j]]):
            jr = self.jobs[int(i)]
            if jr.finished_at is not None:
                continue
            total = jr.job.slo.num_requests or 0
            if self.jcount[1:5, jr.idx].sum() >= total:
                jr.finished_at = float(np.nanmax(rec["finish"][j == i]))
                self._log("job_finished", job_id=jr.job.job_id, served=int(self.jcount[1, jr.idx]))

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
