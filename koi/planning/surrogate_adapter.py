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

Memo (performance; results unchanged): a surrogate never changes once built (its residual
model is fitted before, its caches are pure), and its vectorised predictions are computed
per chain (the value for one chain does not depend on the other chains of the call), so
``estimate``, ``latency`` and ``rank_values_many`` remember their per-chain results *per
surrogate object*, keyed by everything of the job and the chain they read (the job's JSON;
the chain's environment id and config; the load and replicas). The default surrogate lives
for the process, so the fresh-surrogate policies reuse every estimate across ticks and runs;
a fitted one is shared by S4 and S5 of a tick (``koi.planning.tick``), so S5's re-derivation
of candidates and predictions costs almost nothing. :class:`MemoResiduals` does the same for
a fitted residual model's lookups. ``MEMO = False`` turns both off (the equality tests).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from koi import catalog
from koi.domain.chain import Chain
from koi.domain.common import JobClass
from koi.domain.job import Job
from koi.planning.predictor import ChainEstimate

_FEAS_CACHE: dict[tuple, tuple[bool, tuple[str, ...]]] = {}
_FEAS_CACHE_MAX = 200_000

#: Per-surrogate memo of per-chain predictions (see the module docstring); False: always compute.
MEMO = True
_MEMO_MAX = 400_000
_MEMOS: weakref.WeakKeyDictionary[Any, dict[tuple, Any]] = weakref.WeakKeyDictionary()


def _memo_of(surrogate: Any) -> dict[tuple, Any] | None:
    if not MEMO:
        return None
    try:
        m = _MEMOS.get(surrogate)
        if m is None:
            m = _MEMOS[surrogate] = {}
    except TypeError:  # not weak-referenceable: no memo
        return None
    if len(m) >= _MEMO_MAX:
        m.clear()
    return m


def _job_key(job: Job) -> str:
    return job.model_dump_json()


def _chain_key(chain: Chain) -> tuple:
    return chain.env.env_id, chain.config


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
        memo = _memo_of(self.surrogate)
        if memo is None:
            return self._estimate(job, chains)
        jk = _job_key(job)
        keys = [("est", jk, *_chain_key(c)) for c in chains]
        out: list[ChainEstimate | None] = [memo.get(k) for k in keys]
        miss = [i for i, e in enumerate(out) if e is None]
        if miss:
            for i, e in zip(miss, self._estimate(job, [chains[i] for i in miss]), strict=True):
                memo[keys[i]] = out[i] = e
        return out  # type: ignore[return-value]

    def _estimate(self, job: Job, chains: list[Chain]) -> list[ChainEstimate]:
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
        memo = _memo_of(self.surrogate)
        if memo is None:
            return self._latency(job, chains, rps)
        jk = _job_key(job)
        keys = [("lat", jk, *_chain_key(c), float(r)) for c, r in zip(chains, rps, strict=True)]
        got = [memo.get(k) for k in keys]
        miss = [i for i, v in enumerate(got) if v is None]
        if miss:
            t1, t2 = self._latency(job, [chains[i] for i in miss], rps[miss])
            for j, i in enumerate(miss):
                memo[keys[i]] = got[i] = (float(t1[j]), float(t2[j]))
        return np.array([g[0] for g in got]), np.array([g[1] for g in got])  # type: ignore[index]

    def _latency(self, job: Job, chains: list[Chain], rps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = len(chains)
        finite = np.isfinite(rps)
        ttft = np.full(n, np.inf)
        tpot = np.full(n, np.inf)
        idx = np.flatnonzero(finite)
        if len(idx):
            b = self.surrogate.predict_many(job, [chains[i] for i in idx], offered_rps=np.maximum(rps[idx], 1e-9),  # type: ignore[attr-defined]
                                            n_replicas=1, with_capacity=False, with_base=False)
            t1 = np.where(b.feasible, b.values["p99_ttft_ms"], np.inf)
            t2 = np.where(b.feasible, b.values["p99_tpot_ms"], np.inf)
            ttft[idx] = np.nan_to_num(t1, nan=np.inf)
            tpot[idx] = np.nan_to_num(t2, nan=np.inf)
        return ttft, tpot

    def rank_values(self, job: Job, chain: Chain, n_replicas: int, rank_rps: float) -> dict[str, float]:
        b = self.surrogate.predict_many(job, [chain], offered_rps=max(rank_rps, 1e-9), n_replicas=n_replicas,  # type: ignore[attr-defined]
                                        with_capacity=False, with_base=False)
        return {k: float(v[0]) for k, v in b.values.items() if np.isfinite(v[0])}

    def rank_values_many(self, job: Job, chains: Sequence[Chain], n_replicas: Sequence[int],
                         rank_rps: Sequence[float]) -> list[dict[str, float]]:
        """:meth:`rank_values` for all ranks of one job in one surrogate call."""
        chains = list(chains)
        memo = _memo_of(self.surrogate)
        if memo is None or not chains:
            return self._rank_values_many(job, chains, n_replicas, rank_rps)
        jk = _job_key(job)
        rr = [max(float(r), 1e-9) for r in rank_rps]
        keys = [("rv", jk, *_chain_key(c), int(n), r) for c, n, r in zip(chains, n_replicas, rr, strict=True)]
        got = [memo.get(k) for k in keys]
        miss = [i for i, v in enumerate(got) if v is None]
        if miss:
            vals = self._rank_values_many(job, [chains[i] for i in miss], [n_replicas[i] for i in miss],
                                          [rank_rps[i] for i in miss])
            for i, v in zip(miss, vals, strict=True):
                memo[keys[i]] = got[i] = v
        return [dict(v) for v in got]  # type: ignore[arg-type]

    def _rank_values_many(self, job: Job, chains: Sequence[Chain], n_replicas: Sequence[int],
                          rank_rps: Sequence[float]) -> list[dict[str, float]]:
        b = self.surrogate.predict_many(job, list(chains), offered_rps=np.maximum(np.asarray(rank_rps, dtype=float), 1e-9),  # type: ignore[attr-defined]
                                        n_replicas=np.asarray(n_replicas), with_capacity=False, with_base=False)
        return [{k: float(v[i]) for k, v in b.values.items() if np.isfinite(v[i])} for i in range(len(chains))]

    def residuals(self, objective: str, job: Job, chain: Chain) -> np.ndarray | None:
        rm = self.surrogate.residuals  # type: ignore[attr-defined]
        if not getattr(rm, "n_records", 0):
            return None
        from koi.surrogate.scope import Scope

        c = chain.config
        isl, osl = float(job.workload.isl), float(job.workload.osl)
        # everything the scope is built from (its family follows from the model): no Scope on a hit
        key = (objective, chain.env.env_id, chain.env.gpu_type, job.model, c.tp, c.pp, c.weight_dtype, c.engine_name,
               isl, osl)  # fmt: skip
        r = self._res_cache.get(key)
        if r is None:
            arch = catalog.model(job.model)
            scope = Scope.of(env_id=chain.env.env_id, gpu_type=chain.env.gpu_type, model=arch.name,
                             family=arch.family, tp=c.tp, pp=c.pp, weight_dtype=c.weight_dtype.value,
                             engine=c.engine_name, isl=isl, osl=osl)  # fmt: skip
            r = self._res_cache[key] = np.asarray(rm.residuals(objective, scope), dtype=float)
        return r if r.size else None


# ---- a fitted residual model with memoized lookups --------------------------------------------------------------
class _MemoMixin:
    """Memoized ``speed``/``factor``/``support``/``residuals`` of a fitted (immutable) residual model.

    Entries are keyed by the scope object's ``id`` and hold the scope itself: a hit must be the very
    same object (``is``), and as the entry keeps it alive its id cannot be reused by another scope.
    The surrogate builds its scopes through an LRU cache, so the same chain gives the same object.
    Behind that, speed and factors are also kept by the scope's effect keys (all they read), so
    equal scopes built for different chains compute them once.

    ``residuals`` is answered from an index of the history's scope keys per grouping level
    (built once per objective) instead of a scan of the history per call; it returns exactly
    what :meth:`koi.surrogate.residual.ResidualModel.residuals` returns (same levels in the
    same order, same minimum count, the residuals in record order).
    """

    def _m(self) -> dict[tuple, Any]:
        d = self.__dict__.get("_memo")
        if d is None:
            d = {}
            object.__setattr__(self, "_memo", d)
        return d

    def _get(self, k: tuple, scope: Any) -> Any:
        """The memoized value of ``k`` if it was computed for this very scope object, else ``_MISS``."""
        hit = self._m().get(k)
        return hit[1] if hit is not None and hit[0] is scope else _MISS

    def _put(self, k: tuple, scope: Any, value: Any) -> Any:
        self._m()[k] = (scope, value)
        return value

    def _lookup(self, name: str, args: tuple, scope: Any, compute: Callable[[], Any]) -> Any:
        """The memoized ``name(scope, *args)``: by the scope object first, then by the scope's effect keys
        (speed, factors and support read a scope only through them, and many distinct scope objects —
        chains differing in settings the scope does not carry — share them); ``compute`` on a miss of both."""
        from koi.surrogate.scope import effect_keys

        k = (name, id(scope), *args)
        v = self._get(k, scope)
        if v is _MISS:
            m = self._m()
            vk = (name, *args, effect_keys(scope))
            v = m.get(vk, _MISS)
            if v is _MISS:
                v = m[vk] = compute()
            self._put(k, scope, v)
        return v

    def speed(self, scope: Any, skip: tuple[str, ...] = ()) -> float:
        return self._lookup("speed", (skip,), scope, lambda: super(_MemoMixin, self).speed(scope, skip))

    def factor(self, quantity: str, scope: Any, skip: tuple[str, ...] = ()) -> float:
        return self._lookup("factor", (quantity, skip), scope,
                            lambda: super(_MemoMixin, self).factor(quantity, scope, skip))

    def factor_row(self, scope: Any, skip: tuple[str, ...] = ()) -> tuple[float, ...]:
        return self._lookup("factor_row", (skip,), scope, lambda: super(_MemoMixin, self).factor_row(scope, skip))

    def support(self, scope: Any) -> int:
        return self._lookup("support", (), scope, lambda: super(_MemoMixin, self).support(scope))

    def _index(self, objective: str) -> dict[str, dict[str, np.ndarray]]:
        m = self._m()
        k = ("index", objective)
        if k not in m:
            scopes, _r = self.history[objective]  # type: ignore[attr-defined]
            idx: dict[str, dict[str, np.ndarray]] = {}
            for e in ("fine", "scope", "env", "gpu"):
                groups: dict[str, list[int]] = {}
                for i, s in enumerate(scopes):
                    groups.setdefault(s.key(e), []).append(i)
                idx[e] = {key: np.asarray(ix, dtype=np.intp) for key, ix in groups.items()}
            m[k] = idx
        return m[k]

    def residuals(self, objective: str, scope: Any = None, *, min_count: int | None = None) -> np.ndarray:
        from koi import variables
        from koi.surrogate.residual import MIN_RESIDUALS

        n_min = MIN_RESIDUALS if min_count is None else min_count
        if scope is None or objective not in self.history:  # type: ignore[attr-defined]
            return super().residuals(objective, scope, min_count=n_min)  # type: ignore[misc]
        k = ("residuals", objective, id(scope), n_min)
        out = self._get(k, scope)
        if out is _MISS:
            variables.get(objective)
            _scopes, r = self.history[objective]  # type: ignore[attr-defined]
            idx = self._index(objective)
            out = None
            for e in ("fine", "scope", "env", "gpu"):
                ix = idx[e].get(scope.key(e))
                if ix is not None and len(ix) >= n_min:
                    out = r[ix]
                    break
            if out is None:
                out = r.copy() if len(r) >= n_min else np.zeros(0)
            self._put(k, scope, out)
        return out.copy()


_MEMO_CLASSES: dict[type, type] = {}


_MISS = object()


def memo_residuals(model: Any) -> Any:
    """``model`` (a fitted ResidualModel) with memoized lookups; an empty one, or with MEMO off, as is."""
    if not MEMO or not getattr(model, "n_records", 0) or isinstance(model, _MemoMixin):
        return model
    import dataclasses

    base = type(model)
    cls = _MEMO_CLASSES.get(base)
    if cls is None:
        name = f"Memo{base.__name__}"
        cls = _MEMO_CLASSES[base] = type(name, (_MemoMixin, base), {"__module__": __name__, "__qualname__": name})
        globals().setdefault(name, cls)  # picklable by name
    return cls(**{f.name: getattr(model, f.name) for f in dataclasses.fields(model)})
