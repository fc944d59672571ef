"""The gateway's weights of a kept ladder: re-weigh the router when learned capacities move.

A ladder's ranks carry the gateway weight the planner assumed when it placed them
(``Rank.route_weight``: one replica's SLO capacity, :meth:`RankSpec.to_rank`), and
:func:`koi.planning.ladder_eval.evaluate_ladders` scores every ladder — the running one
included — as if its load were shared in proportion to the *current* estimate of those
capacities. When the learned model moves (the residual learner finds a driver update that
made one GPU type 20% slower, :mod:`koi.surrogate.drift`), a kept split ladder still routes
by the old estimate: the slowed rank is overloaded while the other has headroom, and its
breaches look like a reason to swap. A keep therefore carries the fresh weights whenever
they move a rank's share of the job's traffic by more than :data:`REWEIGHT_TOL`; S6 applies
them to the router without touching a replica (no cold start, no switching cost).

Choices the spec leaves open: the tolerance compares *shares* (weight × replicas over the
job's total), not raw weights, since only the ratio between ranks changes where requests go;
10% is about the learned model's noise on one rank after a few ticks (the drift detector's
floor is 2% per record, its smallest step 8%), so noise does not re-weigh a router every
tick. A single-rank ladder is never re-weighed (its share is 1 whatever its weight).
"""

from __future__ import annotations

from collections.abc import Iterable

from koi.domain.cluster import ClusterSnapshot
from koi.planning.candidates import RankSpec

#: the largest move of one rank's traffic share that a keep tolerates without re-weighing
REWEIGHT_TOL = 0.10


def _shares(weights: dict[str, tuple[float, int]]) -> dict[str, float]:
    total = sum(w * n for w, n in weights.values())
    return {k: w * n / total for k, (w, n) in weights.items()} if total > 0 else {}


def keep_route_weights(snapshot: ClusterSnapshot, job_id: str, ranks: Iterable[RankSpec],
                       tol: float = REWEIGHT_TOL) -> dict[str, float] | None:
    """The fresh per-replica weights of a kept ladder's ranks (rank id → weight), or None when the
    running weights are close enough, a rank has no weight, or the ladder is not the one running."""
    fresh: dict[str, tuple[float, int]] = {}
    for r in ranks:
        rank = r.to_rank()
        if rank.route_weight is None:
            return None
        fresh[rank.rank_id(job_id)] = (rank.route_weight, r.n)
    if len(fresh) < 2:
        return None
    running = {d.rank_id: d for d in snapshot.deployments if d.job_id == job_id and d.is_live}
    if set(fresh) != set(running):
        return None
    old: dict[str, tuple[float, int]] = {}
    for rid, d in running.items():
        if d.rank.route_weight is None:  # the gateway weighs by nominal speed: fresh weights are a change
            old = {}
            break
        old[rid] = (d.rank.route_weight, fresh[rid][1])
    new_s, old_s = _shares(fresh), _shares(old)
    if old_s and all(abs(new_s[k] - old_s[k]) <= tol * old_s[k] for k in new_s):
        return None
    return {k: round(w, 6) for k, (w, _) in sorted(fresh.items())}
