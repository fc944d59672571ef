"""A rank's cloud instances grouped by replica — the rules EC2, Compute Engine and Azure share: the grouping, a
scale's plan, and what every executor does the same way (:class:`RankReads`: the reads, ``launch``, ``scale``,
``teardown`` and the drain ``sweep``), each cloud supplying its SDK calls as small hooks.

A replica is alive when all of its nodes (ceil(gpus / gpus_per_instance) instances) are up (starting or
running), ready when all of them run; any other replica the listing still shows is broken (a node lost to a
reclaim or a failure): ``scale`` and ``teardown`` remove its remnants. The cloud adapters say what "up",
"running" and "which replica" mean for their instances (:mod:`infra.aws`, :mod:`infra.gcp`, :mod:`infra.azure`).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from infra import backstop, drain
from koi.domain import Deployment, DeploymentState, Job, Pool, Rank, ResourceMap, TelemetryWindow
from koi.domain.cluster import deployment_state
from koi.ports import LaunchResult, LaunchStatus

I = TypeVar("I")  # noqa: E741 - an instance, as the cloud's SDK returns it


class ReplicaGroups(Generic[I]):
    def __init__(self, insts: Iterable[I], *, nodes: int, replica_of: Callable[[I], int], up: Callable[[I], bool],
                 running: Callable[[I], bool]) -> None:
        self.nodes, self._up, self._running = nodes, up, running
        self.replicas: dict[int, list[I]] = defaultdict(list)
        for i in insts:
            self.replicas[replica_of(i)].append(i)

    def alive(self) -> list[int]:
        return sorted(r for r, xs in self.replicas.items() if sum(self._up(i) for i in xs) >= self.nodes)

    def ready(self) -> list[int]:
        return [r for r in self.alive() if all(self._running(i) for i in self.replicas[r])]

    def broken(self) -> list[int]:
        return sorted(set(self.replicas) - set(self.alive()))

    def deployment(self, job_id: str, rank: Rank, launch_key: str, ready: int | None = None,
                   lost: int = 0) -> Deployment:
        """The rank as S0 sees it: ``rank`` carries the target replica count, the groups say how many are ready
        (``ready``: how many serve, when the engines are probed, :mod:`infra.health`; ``lost``: replicas whose
        engine served and stopped, counted as broken)."""
        ready = len(self.ready()) if ready is None else ready
        alive = len(self.alive()) - lost
        return Deployment(job_id=job_id, rank=rank, state=deployment_state(alive, ready, rank.n_replicas),
                          replicas_ready=ready, idempotency_key=launch_key)


@dataclass(frozen=True, slots=True)
class ScalePlan:
    """What a scale to ``n`` replicas does to a rank (the same on every cloud): the replicas it retires (drained
    when ``wait`` > 0, :mod:`infra.drain`), those it deletes at once (broken remnants, and the retired when there
    is no drain) and how many it adds."""

    retire: list[int]
    drop: list[int]
    add: int
    wait: float


def scale_plan(r: ReplicaGroups[Any], n: int, drain_s: float | None, failed: Iterable[int] = ()) -> ScalePlan:
    """``failed``: replicas whose instances run but whose engine is lost (:mod:`infra.health`): removed at once, as
    broken ones are, and replaced."""
    failed = sorted(set(failed))
    alive, wait = [k for k in r.alive() if k not in failed], drain.scale_drain(drain_s)
    retire = alive[n:]
    return ScalePlan(retire, r.broken() + failed + ([] if wait else retire), max(0, n - len(alive)), wait)


@dataclass(frozen=True, slots=True)
class Check:
    """One answer of a fleet's preflight (``koi fleet check``): what was asked of the cloud, whether it would work,
    and the cloud's own words when not."""

    what: str
    ok: bool
    detail: str


class RankReads:
    """The reads every cloud fleet makes the same way from its ranks — :class:`ReplicaGroups` whose ``head`` is the
    newest instance's record (tags or metadata): the cloud names its keys and supplies ``_ranks``, ``_hosts`` and
    ``_rank_of``."""

    CLOUD: ClassVar[str]  # the log events' prefix
    JOB_KEY: ClassVar[str]
    LAUNCH_KEY: ClassVar[str]
    DRAIN_KEY: ClassVar[str]
    # the record's other keys :meth:`scale` reads and writes
    POOL_KEY: ClassVar[str]
    KEY_KEY: ClassVar[str]
    LAST_KEY: ClassVar[str]
    GEN_KEY: ClassVar[str]
    REPLICAS_KEY: ClassVar[str]
    RDRAIN_KEY: ClassVar[str]
    RELEASE_KEY: ClassVar[str]  # the release backstop's time (:mod:`infra.backstop`)
    WEIGHT_KEY: ClassVar[str]
    MODEL_KEY: ClassVar[str]
    TEARDOWN_KEY: ClassVar[str]
    RANK_KEY: ClassVar[str]
    REPLICA_KEY: ClassVar[str]
    cluster_id: str
    pools: ResourceMap
    _clock: Callable[[], float]
    _log: Any
    #: :class:`infra.health.EngineHealth`: a replica is ready once its engine answers; None: once its instances run
    health: Any = None

    def now(self) -> float:
        return float(self._clock())

    def telemetry(self, t_start: float, t_end: float, *, cluster_id: str, tick: int) -> list[TelemetryWindow]:
        """Empty: a cloud knows instances, not requests (engine metrics: :mod:`infra.vllm_metrics`)."""
        return []

    def _capacity(self, used: Mapping[str | None, int]) -> ResourceMap:
        """The pools with what the cluster's instances (``used`` by pool id) leave free."""
        return ResourceMap(pools=[p.model_copy(update={"free_instances": max(0, p.total_instances - used.get(
            p.pool_id, 0))}) for p in self.pools.pools])

    def _answer(self, op: str, job_id: str, rank_id: str, key: str, requested: int) -> Callable[..., LaunchResult]:
        """The :class:`LaunchResult` maker of one launch or scale; a FAILED one is logged with its reason."""
        log = self._log.bind(job=job_id, rank=rank_id, key=key)

        def result(status: LaunchStatus, launched: int = 0, reason: str = "") -> LaunchResult:
            if status is LaunchStatus.FAILED:
                log.warning(f"{self.CLOUD}.{op}.failed", reason=reason)
            return LaunchResult(job_id=job_id, rank_id=rank_id, idempotency_key=key, status=status,
                                replicas_requested=requested, replicas_launched=launched, reason=reason)

        return result

    def _scale_target(self, present: list[Any], rank_id: str, n: int, pool_key: str,
                      groups: Callable[[list[Any]], Any]) -> tuple[Any, Pool] | str:
        """A scale's rank (``groups`` of its ``present`` instances) and pool, or why the scale fails."""
        if not present:
            return f"no such rank {rank_id}"
        if n < 1:
            return "a rank keeps at least one replica; teardown releases it"
        r = groups(present)
        pool = next((p for p in self.pools.pools if p.pool_id == r.head[pool_key]), None)
        return (r, pool) if pool is not None else f"pool {r.head[pool_key]} is not configured any more"

    # ---- the cloud's side of :meth:`scale` ----------------------------------------------------------------------
    def _fleet_listing(self) -> list[Any]:
        """The cluster's instances not on their way out."""
        raise NotImplementedError

    def _ranks(self, listed: list[Any] | None = None) -> Mapping[str, Any]:
        raise NotImplementedError

    def sweep(self) -> int:
        """Move torn-down ranks on (:mod:`infra.drain`): start the drain of those whose replacement serves, release
        those whose drain is over and the replicas a scale-in drained whose time is up. Returns how many drains
        started and ranks and replicas were released (the gateway re-reads its routes when it is not 0)."""
        listed = self._fleet_listing()
        ranks, now = self._ranks(listed), self.now()
        start, done = drain.sweep(self._views(ranks), now)
        due = [i for i in listed if self._staying(i) and self.RDRAIN_KEY in (m := self._meta(i))
               and drain.replica_due(m[self.RDRAIN_KEY], now)]
        replicas = {(self._meta(i).get(self.RANK_KEY), self._meta(i).get(self.REPLICA_KEY)) for i in due}
        self._release(due)
        if replicas:
            self._log.info(f"{self.CLOUD}.replicas_released", replicas=len(replicas))
        for rid, d in start.items():
            self._mark(ranks[rid].insts, {self.DRAIN_KEY: d.encode()})
            self._log.info(f"{self.CLOUD}.drain", rank=rid, job=ranks[rid].head[self.JOB_KEY], drain_s=d.drain_s)
        for rid in done:
            self._release(ranks[rid].insts)
            self._log.info(f"{self.CLOUD}.released", rank=rid, job=ranks[rid].head[self.JOB_KEY])
        return len(start) + len(done) + len(replicas)

    def _rank_listing(self, rank_id: str) -> list[Any]:
        """Every instance the cloud lists for the rank, in any state (keys outlive the instances they made)."""
        raise NotImplementedError

    def _meta(self, inst: Any) -> Mapping[str, str]:
        """An instance's record (tags, metadata)."""
        raise NotImplementedError

    def _staying(self, inst: Any) -> bool:
        """Not on its way out."""
        raise NotImplementedError

    def _groups(self, insts: list[Any]) -> Any:
        """A rank's instances as :class:`ReplicaGroups` with a ``head`` record."""
        raise NotImplementedError

    def _ident(self, inst: Any) -> str:
        raise NotImplementedError

    def _stored(self, key: str) -> str:
        """How the record holds an idempotency key."""
        return key

    def _free_in(self, pool: Pool) -> int:
        raise NotImplementedError

    def _release(self, insts: list[Any]) -> None:
        """Terminate/delete the instances now (nothing to do for none)."""
        raise NotImplementedError

    def _mark(self, insts: list[Any], updates: Mapping[str, str]) -> None:
        """Merge ``updates`` into the instances' records (nothing to do for none)."""
        raise NotImplementedError

    def _create_replicas(self, pool: Pool, job_id: str, rid: str, rank: Rank, *, key: str, launch_key: str,
                         base: int, count: int, target: int, gen: int, weight: float | None,
                         last_key: str | None = None, model: str | None = None) -> Any:
        raise NotImplementedError

    def _reason(self, e: Exception) -> str | None:
        """``Code: message`` of the cloud's refusal, or None when ``e`` is not one (it is raised)."""
        raise NotImplementedError

    def _unplaceable(self, pool: Pool) -> str | None:
        """Why nothing can be launched in the pool (a region or zone the cloud needs and the pool lacks), or None."""
        return None

    def _keyed(self, pool: Pool, stored: str) -> list[Any]:
        """The instances (any state) of the pool's region/zone that carry the launch key ``stored``."""
        raise NotImplementedError

    def _rank_in(self, pool: Pool, rank_id: str) -> list[Any]:
        """The rank's instances (any state) in the pool's region/zone."""
        raise NotImplementedError

    def preflight(self) -> list[Check]:
        """What a tick will ask of the cloud, asked before the first one (``koi fleet check``): listing the
        cluster's instances (the credentials, the API, the read permissions), then each pool as the cloud can check
        it without launching (:meth:`_preflight_pool`). Nothing is created; a cloud error is an answer, not a raise."""
        try:
            listed = self._fleet_listing()
            checks = [Check("list the cluster's instances", True, f"{len(listed)} instance(s) now")]
        except Exception as e:  # noqa: BLE001 - credentials, network, permissions: the answer
            return [Check("list the cluster's instances", False, self._why(e))]
        asks: list[tuple[str, Callable[[], list[Check]]]] = [("the fleet", self._preflight_fleet)]
        asks += [(f"pool {p.pool_id}", lambda p=p: self._preflight_pool(p)) for p in self.pools.pools]
        for what, ask in asks:
            try:
                checks.extend(ask())
            except Exception as e:  # noqa: BLE001
                checks.append(Check(what, False, self._why(e)))
        return checks

    def _why(self, e: Exception) -> str:
        return self._reason(e) or f"{type(e).__name__}: {e}"

    def _preflight_fleet(self) -> list[Check]:
        """What the cloud can check once for every pool (the image), without launching."""
        return []

    def _preflight_pool(self, pool: Pool) -> list[Check]:
        """The pool's launch as the cloud checks it without launching (EC2: a dry run; GCE and Azure: the machine
        type offered in the zone, the image)."""
        raise NotImplementedError

    @staticmethod
    def _probe_rank(pool: Pool) -> Rank:
        """A one-instance rank in the pool, for checks that need one."""
        from koi.domain import ChainConfig

        return Rank(env=pool.env, config=ChainConfig(instance_type=pool.instance_type), n_replicas=1)

    def _launch_reads(self, pool: Pool, stored: str, rank_id: str) -> tuple[list[Any], list[Any], Callable[[], int]]:
        """What a launch reads before it creates anything: the instances carrying its key, the rank's instances and
        (only asked when those allow the launch) the pool's free instances. A cloud whose one listing answers all
        three overrides this (Azure lists the resource group once)."""
        return self._keyed(pool, stored), self._rank_in(pool, rank_id), lambda: self._free_in(pool)

    def _replica_index(self, inst: Any) -> str:
        return self._meta(inst)[self.REPLICA_KEY]

    @staticmethod
    def _nodes(rank: Rank, pool: Pool) -> int:
        """Instances per replica: the rank's GPUs over the pool's GPUs per instance."""
        return math.ceil(rank.config.gpus / pool.gpus_per_instance)

    def launch(self, job: Job, rank: Rank, idempotency_key: str) -> LaunchResult:
        """Whole replicas in the rank's pool, all or nothing. DUPLICATE when an instance carries the key; FAILED (with
        the reason, nothing launched) for no pool, a rank already running, a pool without room, or the cloud's
        refusal; other errors raise."""
        rid, key = rank.rank_id(job.job_id), idempotency_key
        result = self._answer("launch", job.job_id, rid, key, rank.n_replicas)
        pool = self.pools.pool_for(rank)
        if pool is None:
            return result(LaunchStatus.FAILED, reason=self._no_pool(rank))
        if reason := self._unplaceable(pool):
            return result(LaunchStatus.FAILED, reason=reason)
        try:
            prior, present, free = self._launch_reads(pool, self._stored(key), rid)
            if prior:
                return result(LaunchStatus.DUPLICATE, len({self._replica_index(i) for i in prior}), "already applied")
            if any(self._staying(i) for i in present):
                return result(LaunchStatus.FAILED, reason=f"rank {rid} already runs")
            need = self._nodes(rank, pool) * rank.n_replicas
            if reason := self._shortfall(pool, need, free(), f"{rank.n_replicas} replica(s)"):
                return result(LaunchStatus.FAILED, reason=reason)
            self._create_replicas(pool, job.job_id, rid, rank, key=key, launch_key=key, base=0, count=rank.n_replicas,
                                  target=rank.n_replicas, gen=1, weight=rank.route_weight, model=job.model)
        except Exception as e:
            if (reason := self._reason(e)) is None:
                raise
            return result(LaunchStatus.FAILED, reason=reason)
        self._log.info(f"{self.CLOUD}.launch", job=job.job_id, rank=rid, key=key, pool=pool.pool_id,
                       replicas=rank.n_replicas, instances=need)
        return result(LaunchStatus.LAUNCHED, rank.n_replicas)

    def scale(self, job_id: str, rank_id: str, n_replicas: int, idempotency_key: str, *,
              drain_s: float | None = None) -> LaunchResult:
        """Remove the highest-index replicas (drained, :mod:`infra.drain`; remnants of broken ones at once) or
        launch missing ones; the rank's target and generation go on every instance that stays."""
        key, stored = idempotency_key, self._stored(idempotency_key)
        result = self._answer("scale", job_id, rank_id, key, n_replicas)
        try:
            seen = self._rank_listing(rank_id)
            if any(stored in (m.get(self.KEY_KEY), m.get(self.LAST_KEY)) for m in map(self._meta, seen)):
                return result(LaunchStatus.DUPLICATE, reason="already applied")
            present = [i for i in seen if self._staying(i) and self._meta(i).get(self.JOB_KEY) == job_id
                       and self.RDRAIN_KEY not in self._meta(i)]
            target = self._scale_target(present, rank_id, n_replicas, self.POOL_KEY, self._groups)
            if isinstance(target, str):
                return result(LaunchStatus.FAILED, reason=target)
            r, pool = target
            plan = scale_plan(r, n_replicas, drain_s, self._failed(r))
            if plan.add and (reason := self._shortfall(pool, plan.add * r.nodes, self._free_in(pool),
                                                       f"{plan.add} more replica(s)")):
                return result(LaunchStatus.FAILED, reason=reason)
            killed = [i for x in plan.drop for i in r.replicas[x]]
            draining = [i for x in plan.retire for i in r.replicas[x]] if plan.wait else []
            gen = int(r.head.get(self.GEN_KEY, "0")) + 1
            self._release(killed)
            until = self.now() + plan.wait
            self._mark(draining, {self.RDRAIN_KEY: repr(until), self.RELEASE_KEY: backstop.replica_release_by(until),
                                  self.LAST_KEY: stored})
            if plan.add:
                weight = r.head.get(self.WEIGHT_KEY)
                self._create_replicas(pool, job_id, rank_id, self._rank_of(r.head), key=key,
                                      launch_key=r.head[self.LAUNCH_KEY], base=max(r.replicas) + 1, count=plan.add,
                                      target=n_replicas, gen=gen, weight=None if weight is None else float(weight),
                                      last_key=stored, model=r.head.get(self.MODEL_KEY))
            gone = {self._ident(i) for i in killed + draining}
            # every old replica broken: the new ones carry the target themselves
            self._mark([i for i in present if self._ident(i) not in gone],
                       {self.REPLICAS_KEY: str(n_replicas), self.GEN_KEY: str(gen), self.LAST_KEY: stored})
        except Exception as e:
            if (reason := self._reason(e)) is None:
                raise
            return result(LaunchStatus.FAILED, reason=reason)
        self._log.info(f"{self.CLOUD}.scale", job=job_id, rank=rank_id, key=key, replicas=n_replicas, added=plan.add,
                       removed=len(plan.drop) + len(plan.retire) * bool(plan.wait), drain_s=plan.wait)
        return result(LaunchStatus.LAUNCHED, n_replicas)

    def teardown(self, job_id: str, rank_id: str, idempotency_key: str, *, drain_s: float = 0.0,
                 handover: bool = False) -> bool:
        """Mark the rank's instances with the key, then hand over and drain (:mod:`infra.drain`), or release them at
        once when ``drain_s`` is 0 without a handover. False for a repeated key, a rank not running or one already
        leaving. A cloud error raises, so the activity retries rather than leaking paid instances."""
        stored = self._stored(idempotency_key)
        seen = self._rank_listing(rank_id)
        if any(self._meta(i).get(self.TEARDOWN_KEY) == stored for i in seen):
            return False
        mine = [i for i in seen if self._staying(i) and self._meta(i).get(self.JOB_KEY) == job_id]
        if not mine:
            return False
        mark, deferred = {self.TEARDOWN_KEY: stored}, handover or drain_s > 0
        if deferred:
            record, deferred = self._drain_mark(self._ranks(), rank_id, self.now(), drain_s, handover)
            if record is None:
                return False
            mark.update(record)
        self._mark(mine, mark)
        if not deferred:
            self._release(mine)
        self._log.info(f"{self.CLOUD}.teardown", job=job_id, rank=rank_id, key=idempotency_key, instances=len(mine),
                       drain_s=drain_s, handover=handover)
        return True

    def _no_pool(self, rank: Rank) -> str:
        return (f"no pool of cluster {self.cluster_id} for env {rank.env.env_id} and instance type "
                f"{rank.config.instance_type}")

    @staticmethod
    def _shortfall(pool: Pool, need: int, free: int, what: str) -> str | None:
        """Why ``need`` more instances do not fit in the pool's budget, or None when they do."""
        if free >= need:
            return None
        return f"pool {pool.pool_id}: {what} need {need} instance(s), {free} of {pool.total_instances} free"

    def _head_addr(self, r: Any, k: int) -> str | None:
        """The address of replica ``k``'s head node (where the engine's API server runs), or None when it has none
        yet."""
        raise NotImplementedError

    def _failed(self, r: Any) -> list[int]:
        """The rank's replicas whose instances run but whose engine is lost or never came up (:mod:`infra.health`;
        none when the engines are not probed)."""
        if self.health is None:
            return []
        heads = self._heads(r)
        self.health.ready(heads.values())  # current answers for the replicas a scale is about to judge
        lost = self.health.lost(heads.values())
        return [k for k, a in heads.items() if a in lost]

    def _heads(self, r: Any) -> dict[int, str]:
        """Each ready replica's head address, by replica index."""
        return {k: a for k in r.ready() if (a := self._head_addr(r, k))}

    def _hosts(self, r: Any) -> tuple[str, ...]:
        """Each ready replica's head address (the engines to scrape, and to route to when they are not probed)."""
        return tuple(self._heads(r).values())

    def _rank_of(self, head: Mapping[str, str]) -> Rank:
        raise NotImplementedError

    def deployments(self) -> list[Deployment]:
        """Each rank; one handing over or draining is DRAINING (:mod:`infra.drain`). Ready replicas are those
        whose engine answers when the engines are probed (:mod:`infra.health`)."""
        out, ranks = [], self._ranks()
        served = self._served(ranks)
        for rid, r in ranks.items():
            ready, lost = (None, 0) if served is None else served[rid]
            d = r.deployment(r.head[self.JOB_KEY], self._rank_of(r.head), r.head.get(self.LAUNCH_KEY, ""),
                             None if ready is None else len(ready), lost)
            out.append(d.model_copy(update={"state": DeploymentState.DRAINING}) if self.DRAIN_KEY in r.head else d)
        return out

    def _served(self, ranks: Mapping[str, Any]) -> dict[str, tuple[tuple[str, ...], int]] | None:
        """Each rank's (head hosts of the replicas whose engine answers, replicas whose engine served and stopped)
        (:mod:`infra.health`, all ranks probed at once), or None when the engines are not probed."""
        if self.health is None:
            return None
        hosts = {rid: self._hosts(r) for rid, r in ranks.items()}
        every = {h for hs in hosts.values() for h in hs}
        ok = self.health.ready(every)
        lost = self.health.lost(every)
        return {rid: (tuple(h for h in hs if h in ok), sum(h in lost for h in hs)) for rid, hs in hosts.items()}

    def _views(self, ranks: Mapping[str, Any]) -> dict[str, drain.RankView]:
        """The drain rule's view of the ranks, a replica ready when it serves (:meth:`_served`)."""
        served = self._served(ranks)
        return drain.views(ranks, self.JOB_KEY, self.DRAIN_KEY,
                           None if served is None else {rid: (len(hs), lost) for rid, (hs, lost) in served.items()})

    def engine_hosts(self) -> list[tuple[str, str, str, tuple[str, ...]]]:
        """(job id, rank id, env id, hosts) of every rank with a ready replica, draining ones included (the
        engines to scrape)."""
        return [(r.head[self.JOB_KEY], rid, self._rank_of(r.head).env.env_id, hosts)
                for rid, r in self._ranks().items() if (hosts := self._hosts(r))]

    def routes(self) -> list[tuple[str, Rank, tuple[str, ...]]]:
        """(job id, rank, hosts) of the ranks the gateway routes to: live and handing over, not draining."""
        ranks = self._ranks()
        served = self._served(ranks)
        return [(r.head[self.JOB_KEY], self._rank_of(r.head), hosts) for rid, r in ranks.items()
                if drain.routable(drain.Drain.decode(r.head.get(self.DRAIN_KEY)))
                and (hosts := self._hosts(r) if served is None else served[rid][0])]

    def _drain_mark(self, ranks: Mapping[str, Any], rank_id: str, now: float, drain_s: float,
                    handover: bool) -> tuple[dict[str, str] | None, bool]:
        """A deferred teardown's record: (``{DRAIN_KEY: record}``, whether the release waits), or (None, False)
        when the rank is not listed or already leaving."""
        if rank_id not in ranks or self.DRAIN_KEY in ranks[rank_id].head:
            return None, False
        d = drain.begin(rank_id, self._views(ranks), now, drain_s, handover)
        return {self.DRAIN_KEY: d.encode(), self.RELEASE_KEY: backstop.release_by(d)}, drain.phase(d, now) != "done"
