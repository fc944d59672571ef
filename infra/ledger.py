"""A ledger world: capacity and deployments bookkeeping without serving physics.

It implements the Executor and Observer ports (``koi.ports``) over a list of pools:
a launch takes whole instances from a pool and records the rank, a teardown gives
them back, the clock moves when told. It produces no telemetry. It serves as a dry-run
executor (what would this plan launch?) and as the world of the pipeline's
mechanics tests; benchmarks and the demo use the simulator (``infra.sim``).

Idempotency: every applied key is remembered (inside the checkpoint); a key seen
before returns ``DUPLICATE`` and changes nothing. ``launches`` counts what each
(job, rank) was really launched, so a test can assert nothing was launched twice.
"""

from __future__ import annotations

import json
import math
from typing import Any

from koi.domain import Deployment, DeploymentState, Job, Rank, ResourceMap, TelemetryWindow
from koi.ports import LaunchResult, LaunchStatus


class LedgerWorld:
    def __init__(self, resources: ResourceMap, now: float = 0.0) -> None:
        self.resources = resources
        self._now = float(now)
        self.ranks: dict[str, dict[str, Any]] = {}  # rank_id -> {job_id, rank, pool_id, instances}
        self.keys: dict[str, dict[str, Any]] = {}  # idempotency key -> result
        self.launches: dict[str, int] = {}  # rank_id -> times actually launched
        self.fail_launches: set[str] = set()  # job ids or key fragments whose launches are refused (tests)

    # ---- Observer -------------------------------------------------------------------------------
    def now(self) -> float:
        return self._now

    def capacity(self) -> ResourceMap:
        return self.resources.model_copy(deep=True)

    def telemetry(self, t_start: float, t_end: float, *, cluster_id: str, tick: int) -> list[TelemetryWindow]:
        return []

    def deployments(self) -> list[Deployment]:
        out = []
        for _rid, r in sorted(self.ranks.items()):
            rank = Rank.model_validate(r["rank"])
            out.append(
                Deployment(
                    job_id=r["job_id"], rank=rank, state=DeploymentState.SERVING, since_tick=r.get("since_tick", 0),
                    replicas_ready=rank.n_replicas, idempotency_key=r["key"],
                )
            )
        return out

    def advance(self, t: float) -> None:
        self._now = max(self._now, float(t))

    # ---- Executor -------------------------------------------------------------------------------
    def _instances(self, rank: Rank, pool: Any, n: int) -> int:
        return n * math.ceil(rank.config.gpus / pool.gpus_per_instance)

    def _take(self, pool: Any, n: int) -> bool:
        if pool.free_instances < n:
            return False
        pool.free_instances -= n
        return True

    def launch(self, job: Job, rank: Rank, idempotency_key: str) -> LaunchResult:
        rid = rank.rank_id(job.job_id)
        if idempotency_key in self.keys:
            prev = self.keys[idempotency_key]
            return LaunchResult(job_id=job.job_id, rank_id=rid, idempotency_key=idempotency_key,
                                status=LaunchStatus.DUPLICATE, replicas_requested=rank.n_replicas,
                                replicas_launched=prev.get("replicas", 0), reason="already applied")
        pool = self.resources.pool_for(rank)
        need = self._instances(rank, pool, rank.n_replicas) if pool is not None else 0
        refused = any(p == job.job_id or p in idempotency_key for p in self.fail_launches)
        if refused or pool is None or rid in self.ranks or not self._take(pool, need):
            reason = ("refused (fail_launches)" if refused else
                      "no such pool" if pool is None else "rank already runs" if rid in self.ranks else "no capacity")
            self.keys[idempotency_key] = {"status": "failed", "replicas": 0}
            return LaunchResult(job_id=job.job_id, rank_id=rid, idempotency_key=idempotency_key,
                                status=LaunchStatus.FAILED, replicas_requested=rank.n_replicas,
                                replicas_launched=0, reason=reason)
        self.ranks[rid] = {"job_id": job.job_id, "rank": rank.model_dump(mode="json"), "pool_id": pool.pool_id,
                           "instances": need, "key": idempotency_key}
        self.launches[rid] = self.launches.get(rid, 0) + 1
        self.keys[idempotency_key] = {"status": "launched", "replicas": rank.n_replicas}
        return LaunchResult(job_id=job.job_id, rank_id=rid, idempotency_key=idempotency_key,
                            status=LaunchStatus.LAUNCHED, replicas_requested=rank.n_replicas,
                            replicas_launched=rank.n_replicas, ready_at=self._now)

    def teardown(self, job_id: str, rank_id: str, idempotency_key: str, *, drain_s: float = 0.0,
                 handover: bool = False) -> bool:
        # bookkeeping only: nothing serves here, so a handover has nothing to hand over
        if idempotency_key in self.keys:
            return False
        self.keys[idempotency_key] = {"status": "torn_down"}
        r = self.ranks.pop(rank_id, None)
        if r is None:
            return False
        self.resources.pool(r["pool_id"]).free_instances += r["instances"]
        return True

    def scale(self, job_id: str, rank_id: str, n_replicas: int, idempotency_key: str, *,
              drain_s: float | None = None) -> LaunchResult:
        r = self.ranks.get(rank_id)
        if idempotency_key in self.keys or r is None:
            status = LaunchStatus.DUPLICATE if idempotency_key in self.keys else LaunchStatus.FAILED
            return LaunchResult(job_id=job_id, rank_id=rank_id, idempotency_key=idempotency_key, status=status,
                                replicas_requested=n_replicas, replicas_launched=0,
                                reason="already applied" if status is LaunchStatus.DUPLICATE else "no such rank")
        rank = Rank.model_validate(r["rank"])
        pool = self.resources.pool(r["pool_id"])
        need = self._instances(rank, pool, n_replicas)
        delta = need - r["instances"]
        if delta > 0 and not self._take(pool, delta):
            self.keys[idempotency_key] = {"status": "failed"}
            return LaunchResult(job_id=job_id, rank_id=rank_id, idempotency_key=idempotency_key,
                                status=LaunchStatus.FAILED, replicas_requested=n_replicas, replicas_launched=0,
                                reason="no capacity")
        if delta < 0:
            pool.free_instances -= delta
        r["instances"] = need
        r["rank"] = rank.model_copy(update={"n_replicas": n_replicas}).model_dump(mode="json")
        self.keys[idempotency_key] = {"status": "scaled", "replicas": n_replicas}
        return LaunchResult(job_id=job_id, rank_id=rank_id, idempotency_key=idempotency_key,
                            status=LaunchStatus.LAUNCHED, replicas_requested=n_replicas, replicas_launched=n_replicas)

    def reweight(self, job_id: str, rank_id: str, route_weight: float, idempotency_key: str) -> bool:
        r = self.ranks.get(rank_id)
        if idempotency_key in self.keys or r is None or r["job_id"] != job_id:
            return False
        r["rank"] = {**r["rank"], "route_weight": float(route_weight)}
        self.keys[idempotency_key] = {"status": "reweighted", "route_weight": float(route_weight)}
        return True

    # ---- checkpoint -----------------------------------------------------------------------------
    def checkpoint(self) -> bytes:
        return json.dumps(
            {
                "now": self._now,
                "resources": self.resources.model_dump(mode="json"),
                "ranks": self.ranks,
                "keys": self.keys,
                "launches": self.launches,
                "fail_launches": sorted(self.fail_launches),
            },
            sort_keys=True,
        ).encode()

    @classmethod
    def restore(cls, blob: bytes) -> LedgerWorld:
        d = json.loads(blob)
        w = cls(ResourceMap.model_validate(d["resources"]), now=d["now"])
        w.ranks, w.keys, w.launches = d["ranks"], d["keys"], d["launches"]
        w.fail_launches = set(d.get("fail_launches", []))
        return w


def ledger_provider(resources: ResourceMap, now: float = 0.0):  # noqa: ANN201 - CheckpointWorldProvider
    """A checkpointed ledger world: every cluster starts with a copy of ``resources``."""
    from koi.pipeline.world import CheckpointWorldProvider

    return CheckpointWorldProvider(
        create=lambda cluster_id, scenario, seed: LedgerWorld(resources.model_copy(deep=True), now=now),
        restore=LedgerWorld.restore,
    )
