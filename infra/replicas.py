"""A rank's cloud instances grouped by replica — the one rule EC2 and Compute Engine share.

A replica is alive when all of its nodes (ceil(gpus / gpus_per_instance) instances) are up (starting or
running), ready when all of them run; any other replica the listing still shows is broken (a node lost to a
reclaim or a failure): ``scale`` and ``teardown`` remove its remnants. The cloud adapters say what "up",
"running" and "which replica" mean for their instances (:mod:`infra.aws`, :mod:`infra.gcp`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

from koi.domain import Deployment, Rank
from koi.domain.cluster import deployment_state

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

    def deployment(self, job_id: str, rank: Rank, launch_key: str) -> Deployment:
        """The rank as S0 sees it: ``rank`` carries the target replica count, the groups say how many are ready."""
        ready = len(self.ready())
        return Deployment(job_id=job_id, rank=rank, state=deployment_state(len(self.alive()), ready, rank.n_replicas),
                          replicas_ready=ready, idempotency_key=launch_key)
