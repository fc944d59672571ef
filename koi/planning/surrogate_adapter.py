"""The real surrogate (:mod:`koi.surrogate`) behind the planner's :class:`~koi.planning.predictor.Predictor`.

Mapping:
- ``feasible`` → :func:`koi.surrogate.feasibility.feasibility` (C2);
- ``estimate`` → ``Surrogate.capacity_many`` (one replica's sustainable req/s under the 0.8
  cap and the p99 targets; saturation for batch) and, for batch jobs, one ``predict_many``
  at saturation for the p99s and the surrogate's σ multiplier (online latency is predicted
  later at the actual load, so the estimate leaves it unset);
- ``latency`` → ``predict_many`` with one replica per chain at the given per-replica load
  (``with_capacity=False``: scoring at a fixed load needs no capacity search);
- ``rank_values`` → ``predict_many`` for the whole rank at its share of the load (V̂ and Ŷ);
- ``residuals`` → ``ResidualModel.residuals(objective, scope)`` (relative, as the DRO band
  expects), cached per scope.

``env_sensitive`` is true once the surrogate has learned from records (its residual
corrections have per-environment effects); a cold surrogate predicts the same for every
pool of one GPU type and instance shape, so the candidate generator may share predictions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from koi import catalog
from koi.domain.chain import Chain
from koi.domain.common import JobClass
from koi.domain.job import Job
from koi.planning.predictor import ChainEstimate

_FEAS_CACHE: dict[tuple, tuple[bool, tuple[str, ...]]] = {}
_FEAS_CACHE_MAX = 200_000


@dataclass
class SurrogatePredictor:
    surrogate: object = None  # koi.surrogate.Surrogate; default: the default (nothing learned)
    name: str = "surrogate"
    _res_cache: dict[tuple, np.ndarray] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.surrogate is None:
            from koi.surrogate import default_surrogate

            self.surrogate = default_surrogate()

    @property
    def residual_free(self) -> bool:
        """No residual history at all (a cold surrogate): every DRO band is the cold one."""
        return not getattr(self.surrogate.residuals, "n_records", 0)  # type: ignore[attr-defined]

    @property
    def env_sensitive(self) -> bool:
        return bool(getattr(self.surrogate.residuals, "n_records", 0))  # type: ignore[attr-defined]

    def feasible(self, job: Job, chains: Sequence[Chain]) -> list[tuple[bool, tuple[str, ...]]]:
        """C2 through the surrogate's own check, cached per (model, GPU, cloud, config, request lengths):
        the check reads only those (koi.surrogate.physics.chain_physics keys it the same way). The cache
        is per process (a pure function of its key; bounded), so a long-lived worker checks a chain once."""
        from koi.surrogate.feasibility import feasibility
        from koi.surrogate.physics import WorkloadDigest

        lk = WorkloadDigest.of(job.workload).lengths_key
        out = []
        for c in chains:
            key = (job.model, c.env.gpu_type, c.env.cloud, c.config, lk)
            hit = _FEAS_CACHE.get(key)
            if hit is None:
                ok, reasons = feasibility(job.model, c, job.workload)
                hit = (bool(ok), tuple(reasons))
                if len(_FEAS_CACHE) >= _FEAS_CACHE_MAX:
                    _FEAS_CACHE.clear()
                _FEAS_CACHE[key] = hit
            out.append(hit)
        return out

    def estimate(self, job: Job, chains: Sequence[Chain]) -> list[ChainEstimate]:
        chains = list(chains)
        if not chains:
            return []
        s = self.surrogate
        caps = s.capacity_many(job, chains)  # type: ignore[attr-defined]
        osl = float(job.workload.osl)
        online = job.job_class is JobClass.ONLINE
        # the p99s at the cap are only read for batch jobs (online latency is predicted at the actual load)
        ok = [] if online else [i for i, c in enumerate(caps) if c.feasible]
        ttft = np.full(len(chains), math.inf)
        tpot = np.full(len(chains), math.inf)
        unc = np.ones(len(chains))
        if ok:
            sub = [chains[i] for i in ok]
            b = s.predict_many(job, sub, offered_rps=None, n_replicas=1, with_capacity=False)  # type: ignore[attr-defined]
            ttft[ok] = np.nan_to_num(b.values["p99_ttft_ms"], nan=np.inf)
            tpot[ok] = np.nan_to_num(b.values["p99_tpot_ms"], nan=np.inf)
            unc[ok] = np.maximum(b.uncertainty, 1.0)
        out = []
        for i, c in enumerate(caps):
            if not c.feasible:
                out.append(ChainEstimate(feasible=False, reasons=tuple(c.reasons), flags=tuple(c.flags)))
                continue
            cap_rps = c.rps if online else c.saturation_rps
            out.append(ChainEstimate(
                feasible=True, reasons=tuple(c.reasons),
                cap_rps=float(cap_rps), cap_tps=float(cap_rps * osl),
                sat_rps=float(c.saturation_rps), sat_tps=float(c.saturation_rps * osl),
                ttft_ms=float(ttft[i]), tpot_ms=float(tpot[i]), uncertainty=float(unc[i]), flags=tuple(c.flags),
            ))
        return out

    def latency(self, job: Job, chains: Sequence[Chain], per_replica_rps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        chains = list(chains)
        n = len(chains)
        if not n:
            return np.zeros(0), np.zeros(0)
        rps = np.broadcast_to(np.asarray(per_replica_rps, dtype=float), (n,)).copy()
        finite = np.isfinite(rps)
        ttft = np.full(n, np.inf)
        tpot = np.full(n, np.inf)
        idx = np.flatnonzero(finite)
        if len(idx):
            b = self.surrogate.predict_many(job, [chains[i] for i in idx], offered_rps=np.maximum(rps[idx], 1e-9),  # type: ignore[attr-defined]
                                            n_replicas=1, with_capacity=False)
            t1 = np.where(b.feasible, b.values["p99_ttft_ms"], np.inf)
            t2 = np.where(b.feasible, b.values["p99_tpot_ms"], np.inf)
            ttft[idx] = np.nan_to_num(t1, nan=np.inf)
            tpot[idx] = np.nan_to_num(t2, nan=np.inf)
        return ttft, tpot

    def rank_values(self, job: Job, chain: Chain, n_replicas: int, rank_rps: float) -> dict[str, float]:
        b = self.surrogate.predict_many(job, [chain], offered_rps=max(rank_rps, 1e-9), n_replicas=n_replicas,  # type: ignore[attr-defined]
                                        with_capacity=False)
        return {k: float(v[0]) for k, v in b.values.items() if np.isfinite(v[0])}

    def rank_values_many(self, job: Job, chains: Sequence[Chain], n_replicas: Sequence[int],
                         rank_rps: Sequence[float]) -> list[dict[str, float]]:
        """:meth:`rank_values` for all ranks of one job in one surrogate call."""
        b = self.surrogate.predict_many(job, list(chains), offered_rps=np.maximum(np.asarray(rank_rps, dtype=float), 1e-9),  # type: ignore[attr-defined]
                                        n_replicas=np.asarray(n_replicas), with_capacity=False)
        return [{k: float(v[i]) for k, v in b.values.items() if np.isfinite(v[i])} for i in range(len(chains))]

    def residuals(self, objective: str, job: Job, chain: Chain) -> np.ndarray | None:
        rm = self.surrogate.residuals  # type: ignore[attr-defined]
        if not getattr(rm, "n_records", 0):
            return None
        from koi.surrogate.scope import Scope

        arch = catalog.model(job.model)
        c = chain.config
        scope = Scope.of(env_id=chain.env.env_id, gpu_type=chain.env.gpu_type, model=arch.name, family=arch.family,
                         tp=c.tp, pp=c.pp, weight_dtype=c.weight_dtype.value, engine=c.engine_name,
                         isl=float(job.workload.isl), osl=float(job.workload.osl))
        key = (objective, scope)
        if key not in self._res_cache:
            self._res_cache[key] = np.asarray(rm.residuals(objective, scope), dtype=float)
        r = self._res_cache[key]
        return r if r.size else None
