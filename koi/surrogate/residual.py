"""Learned residual corrections from the performance database (whitepaper, "The Surrogate Stack":
"a mixture of predictors whose outputs are learnable over time"; "Risk: DRO" for the residuals).

:meth:`ResidualModel.fit` is a pure function of a list of :class:`koi.store.PerfRecord`
(observed V/Y of a rank and the surrogate's *base* prediction for it, ``PerfRecord.predicted``
= ``RankPrediction.base_values``). Nothing is read from a database here; callers query the
store (``koi.store.query_perf``) and pass the list. The only other input is the deterministic
base physics, used to ask "what would this rank have done if every iteration were f× slower".

Two stages, both over the scope keys of :mod:`koi.surrogate.scope` (GPU, environment, the
spec's scope GPU × family × TP/PP × shape, and the fine scope):

1. **Speed (physics level).** The commonest way a deployment differs from the operator
   tables is that its iterations run at another speed (a slower part, virtualization, a
   driver, noisy neighbours). For each record we find the factor f by which every
   iteration time must be multiplied so that the physics reproduces the observed p99 TPOT:
   the base model is re-run at the record's served rate on a grid of f and inverted
   *relative to the stored base prediction* (``obs/base = TPOT(f)/TPOT(1)``), so workload
   details the record does not carry cancel. ``log f`` is then explained as a sum of
   effects over the scope keys, each a ridge (shrinkage) estimate — a level seen on n
   records moves by about ``n/(n + k)`` of its mean, prior strength k per effect
   (``PRIOR_STRENGTH``: coarse effects need more evidence) — fitted jointly by
   backfitting. The surrogate applies the learned f *inside* the physics, so the queueing
   model carries it consistently to any load: a 15% slower GPU saturates 15% earlier and
   its p99 TTFT near saturation grows accordingly, instead of a ratio learned at one load
   being multiplied onto another.
2. **Outputs.** What speed does not explain — per quantity, ``log(observed / speed-corrected
   prediction)`` — is learned the same way with twice the prior strength (clipped to
   ±log 3), and applied multiplicatively to the outputs.

**Regime changes.** The fleet is not stationary (a driver rollout slows every H100 mid-run):
after the first fit, each GPU type's and environment's speed residuals are tested for a step
(:mod:`koi.surrogate.drift`, an offline CUSUM change point at the spec's 4σ); where one is
found, that level's records before it are forgotten and the model is refitted, so the new
speed is learned from the new regime alone instead of being averaged with an hour of the old.

Levels never observed contribute 0 (factor 1), so a correction is not applied outside the
GPU, environment or scope it was learned on (a new GPU gets none). Derived outcomes are not
learned on their own: cost per token follows throughput, SLO margin is recomputed from the
corrected p99s (koi.outcomes).

Residual history for the DRO band (whitepaper, "Risk"): :meth:`residuals` returns
**relative** residuals ``r = observed / predicted − 1`` of the *corrected* predictor,
computed prequentially (each block of records is predicted by the model fitted on the
records before it, in the order given), so the band reflects errors the planner actually
made, not in-sample fits. Multiply by ŷ to get objective units (:meth:`residuals_in_units`).
``slo_margin`` is the exception: it can be negative, so its residuals are absolute
(observed − stored base prediction). Records without a base prediction are re-predicted by
the optional ``predictor`` or skipped.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING, Any

import numpy as np

from koi import variables
from koi.logging import get_logger
from koi.surrogate import drift
from koi.surrogate.scope import EFFECTS, PRIOR_STRENGTH, Scope, effect_keys

if TYPE_CHECKING:
    from koi.store import PerfRecord

log = get_logger(__name__)

#: Quantities corrected multiplicatively at the output (positive when meaningful).
CORRECTED: tuple[str, ...] = (
    "p99_ttft_ms",
    "p99_tpot_ms",
    "throughput_tokens_per_sec",
    "kv_cache_util",
    "kv_pressure_score",
    "gpu_mem_used_fraction",
    "vram_headroom_gb",
    "pipeline_bubble_fraction",
    "comm_overhead_pct",
    "per_tok_comm_bytes",
    "kvcache_hit_rate",
    "live_batch_size",
    "queue_depth",
    "preemption_rate",
    "input_length_observed",
    "output_length_observed",
)
#: Grid of iteration-time multipliers on which each record's physics is probed (1/3 … 3).
SPEED_GRID = np.exp(np.linspace(-math.log(3.0), math.log(3.0), 25))
_LOG_SPEED_GRID = np.log(SPEED_GRID)
SPEED_CLIP = math.log(3.0)
OUTPUT_CLIP = math.log(3.0)
OUTPUT_PRIOR_SCALE = 2.0
BACKFIT_ITERS = 25
#: Fewest residuals a scope level must hold before :meth:`residuals` stops backing off.
MIN_RESIDUALS = 5
_EPS = 1e-9

#: curves(records) -> one dict per record: quantity -> values on SPEED_GRID (rank level).
Curves = Callable[[Sequence["PerfRecord"]], list[dict[str, np.ndarray]]]


@dataclass(frozen=True, slots=True)
class _Row:
    engine: str
    scope: Scope
    predicted: dict[str, float]
    observed: dict[str, float]
    curve: dict[str, np.ndarray]  # quantity -> value(f)/value(1) on SPEED_GRID
    tick: int = 0


@dataclass(frozen=True)
class _Effects:
    """Fitted effects of one quantity: effect name -> {level key -> log correction}."""

    theta: dict[str, dict[str, float]]
    counts: dict[str, dict[str, int]]
    def log_factor(self, scope: Scope, skip: tuple[str, ...] = ()) -> float:
        th = self.theta
        return float(sum(th[e].get(k, 0.0) for e, k in zip(EFFECTS, effect_keys(scope), strict=True)
                         if e not in skip))

    def support(self, scope: Scope) -> int:
        return int(self.counts["fine"].get(scope.key("fine"), 0))


def _backfit(idx: dict[str, np.ndarray], levels: dict[str, list[str]], Y: np.ndarray, prior_scale: float
             ) -> list[_Effects]:  # fmt: skip
    """Ridge backfitting of each column of ``Y`` (n × Q) on the same one-hot effects.

    The columns share the records, so the partial residuals of all of them are formed at once; each
    column's arithmetic is exactly the single-column fit's (same terms, same order, one bincount each).
    """
    Q = Y.shape[1]
    n_per = {e: np.bincount(idx[e], minlength=len(levels[e])).astype(float) for e in EFFECTS}
    theta = {e: np.zeros((len(levels[e]), Q)) for e in EFFECTS}
    for _ in range(BACKFIT_ITERS):
        for e in EFFECTS:
            partial = Y - sum(theta[o][idx[o]] for o in EFFECTS if o != e)
            den = n_per[e] + PRIOR_STRENGTH[e] * prior_scale
            t = np.empty((len(levels[e]), Q))
            for c in range(Q):
                t[:, c] = np.bincount(idx[e], weights=partial[:, c], minlength=len(levels[e])) / den
            theta[e] = t
    counts = {e: dict(zip(levels[e], n_per[e].astype(int).tolist(), strict=True)) for e in EFFECTS}
    return [_Effects(theta={e: dict(zip(levels[e], theta[e][:, c].tolist(), strict=True)) for e in EFFECTS},
                     counts=counts) for c in range(Q)]


@dataclass(frozen=True)
class _Coded:
    """Every row's level of every effect as an index into that effect's sorted levels (built once per fit
    stage: the speed and the output fits of one stage select subsets of the same rows)."""

    levels: dict[str, np.ndarray]  # effect -> sorted unique keys (object array)
    codes: dict[str, np.ndarray]  # effect -> (n_rows,) index into levels

    @classmethod
    def of(cls, rows: Sequence[_Row]) -> _Coded:
        ks = [effect_keys(r.scope) for r in rows]
        levels, codes = {}, {}
        for j, e in enumerate(EFFECTS):
            uniq, inv = np.unique(np.asarray([k[j] for k in ks], dtype=object), return_inverse=True)
            levels[e], codes[e] = uniq, inv.astype(np.intp).ravel()
        return cls(levels, codes)

    def subset(self, rows: np.ndarray) -> tuple[dict[str, np.ndarray], dict[str, list[str]]]:
        """The one-hot encoding of the rows at ``rows``: the same sorted levels and inverse indices
        ``np.unique`` gives on their keys (the subset's codes are ranks in the same sorted order)."""
        idx, levels = {}, {}
        for e in EFFECTS:
            u, inv = np.unique(self.codes[e][rows], return_inverse=True)
            idx[e], levels[e] = inv.astype(np.intp).ravel(), [str(x) for x in self.levels[e][u]]
        return idx, levels


def _empty_effects() -> _Effects:
    return _Effects(theta={e: {} for e in EFFECTS}, counts={e: {} for e in EFFECTS})


def scope_of_record(record: PerfRecord) -> Scope:
    """The scope of a PerfDB record (model family from the catalog)."""
    from koi import catalog

    arch = catalog.model(record.model)
    return Scope.of(
        env_id=record.env.env_id,
        gpu_type=record.env.gpu_type,
        model=arch.name,
        family=arch.family,
        tp=record.config.tp,
        pp=record.config.pp,
        weight_dtype=record.config.weight_dtype.value,
        engine=record.config.engine_name,
        isl=record.isl,
        osl=record.osl,
        job_id=record.job_id,
    )


def physics_curves(records: Sequence[PerfRecord]) -> list[dict[str, np.ndarray]]:
    """The base surrogate's rank-level outputs of each record on ``SPEED_GRID`` (default probe).

    The record carries mean lengths, the job's rate and the rank's observed throughput, not the
    full workload: we rebuild a lognormal workload (CV 0.3, max 4× the mean) served at the rank's
    observed rate (``throughput / osl``, else the job's rate). Only ratios to the f = 1 point are
    used, so the reconstruction's bias cancels to first order. Cached per record physics, so
    refitting each tick on a growing PerfDB only probes the new records.
    """
    out = []
    for r in records:
        thr = r.observed_y.get("throughput_tokens_per_sec", 0.0)
        lam = thr / max(r.osl, 1.0) if thr > 0 else r.rate_rps
        key = (r.model, r.env, r.config, round(float(r.isl), 1), round(float(r.osl), 1),
               float(f"{max(lam, 1e-3):.4g}"), int(r.n_replicas))  # fmt: skip
        try:
            out.append(_record_curve(*key))
        except Exception as exc:  # a record the physics cannot replay contributes no speed evidence
            log.warning("residual_probe_failed", rank_id=r.rank_id, error=str(exc))
            out.append({})
    return out


@lru_cache(maxsize=8192)
def _record_curve(model: str, env, config, isl: float, osl: float, lam: float, n_replicas: int  # noqa: ANN001
                  ) -> dict[str, np.ndarray]:  # fmt: skip
    from koi.domain import Chain, Job
    from koi.surrogate.core import Surrogate

    job = Job(
        job_id="probe",
        model=model,
        job_class="online",
        slo={"p99_ttft_ms": 1e6, "p99_tpot_ms": 1e6},
        workload={
            "input_len": {"kind": "lognormal", "mean": max(isl, 1.0), "std": 0.3 * max(isl, 1.0), "min": 1,
                          "max": int(4 * max(isl, 1.0)) + 1},
            "output_len": {"kind": "lognormal", "mean": max(osl, 1.0), "std": 0.3 * max(osl, 1.0), "min": 1,
                           "max": int(4 * max(osl, 1.0)) + 1},
            "arrival": {"process": "poisson", "rate_rps": lam},
        },
    )  # fmt: skip
    b = Surrogate().predict_many(job, [Chain(env=env, config=config)] * len(SPEED_GRID), offered_rps=lam,
                                 n_replicas=n_replicas, speed=SPEED_GRID, with_capacity=False)  # fmt: skip
    if not b.feasible.all():
        return {}
    out = {k: np.asarray(v, dtype=float) for k, v in b.values.items()}
    for v in out.values():
        v.setflags(write=False)
    return out


_RATIO_CURVES: OrderedDict[int, tuple[dict[str, np.ndarray], dict[str, np.ndarray]]] = OrderedDict()


def _ratio_curves(cv: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Each quantity's curve over its f = 1 value. :func:`physics_curves` returns the same cached
    dict for a record on every refit, so the ratios are kept by that dict's identity (checked)."""
    hit = _RATIO_CURVES.get(id(cv))
    if hit is not None and hit[0] is cv:
        return hit[1]
    out = {q: c for q, c in ((q, _ratio_curve(v)) for q, v in cv.items()) if c is not None}
    _RATIO_CURVES[id(cv)] = (cv, out)
    if len(_RATIO_CURVES) > 8192:
        _RATIO_CURVES.popitem(last=False)
    return out


def _ratio_curve(vals: np.ndarray) -> np.ndarray | None:
    mid = len(SPEED_GRID) // 2
    if vals is None or not np.all(np.isfinite(vals)) or vals[mid] <= _EPS:
        return None
    return vals / vals[mid]


def _invert(curve: np.ndarray, target: float) -> float:
    """log f with curve(f) = target (curve increasing on the grid; clipped to its ends)."""
    c = np.maximum.accumulate(curve)
    lt = math.log(max(target, _EPS))
    lc = np.log(np.maximum(c, _EPS))
    return float(np.interp(lt, lc, _LOG_SPEED_GRID))


def _at(curve: np.ndarray | None, logf: float) -> float:
    if curve is None:
        return 1.0
    return float(np.interp(logf, _LOG_SPEED_GRID, curve))


@dataclass(frozen=True)
class ResidualModel:
    """Fitted speed and output corrections with prequential residual histories (module docstring)."""

    speed_effects: _Effects | None = None
    effects: dict[str, _Effects] = field(default_factory=dict)
    #: quantity -> (scopes in record order, relative prequential residuals)
    history: dict[str, tuple[list[Scope], np.ndarray]] = field(default_factory=dict)
    n_records: int = 0
    #: per record with a speed estimate: (model, GPU, engine, inverted speed) — the measured
    #: profiles of the nearest-architecture rule (``ProfileBook.from_residuals``)
    record_speeds: tuple[tuple[str, str, str, float], ...] = ()
    #: "effect=level" -> first tick of its current regime: the records before it were forgotten
    #: (:mod:`koi.surrogate.drift`)
    regimes: dict[str, int] = field(default_factory=dict)

    # ---- fitting ----------------------------------------------------------------------------------
    @classmethod
    def empty(cls) -> ResidualModel:
        return cls()

    @classmethod
    def fit(
        cls,
        records: Sequence[PerfRecord],
        *,
        predictor: Callable[[PerfRecord], Mapping[str, float]] | None = None,
        curves: Curves | None = None,
        block: int | None = None,
    ) -> ResidualModel:
        """Fit on ``records`` (oldest first). ``curves`` probes the physics (default
        :func:`physics_curves`); ``block`` sets a fixed prequential refit stride (default:
        geometric blocks, :func:`_block_bounds`)."""
        kept: list[PerfRecord] = []
        preds: list[dict[str, float]] = []
        skipped = 0
        for r in records:
            pred = dict(r.predicted)
            if not pred and predictor is not None:
                pred = dict(predictor(r))
            if not pred:
                skipped += 1
                continue
            kept.append(r)
            preds.append(pred)
        if skipped:
            log.info("residual_fit_skipped_records", skipped=skipped, reason="no base prediction")
        if not kept:
            return cls()
        raw = (curves or physics_curves)(kept)
        rows = []
        for r, pred, cv in zip(kept, preds, raw, strict=True):
            curve = _ratio_curves(cv)
            rows.append(_Row(r.config.engine_name, scope_of_record(r), pred, {**r.observed_v, **r.observed_y}, curve,
                             int(r.tick)))
        return cls._fit_rows(rows, block=block)

    @staticmethod
    def _speed_targets(rows: list[_Row]) -> tuple[np.ndarray, np.ndarray]:
        """Per-record log speed from the TPOT ratio, and which records carry one."""
        y = np.zeros(len(rows))
        ok = np.zeros(len(rows), dtype=bool)
        for i, row in enumerate(rows):
            c = row.curve.get("p99_tpot_ms")
            obs, base = row.observed.get("p99_tpot_ms", 0.0), row.predicted.get("p99_tpot_ms", 0.0)
            if c is not None and obs > _EPS and base > _EPS and math.isfinite(obs) and math.isfinite(base):
                y[i] = float(np.clip(_invert(c, obs / base), -SPEED_CLIP, SPEED_CLIP))
                ok[i] = True
        return y, ok

    @staticmethod
    def _fit_stage(rows: list[_Row], y_speed: np.ndarray, ok: np.ndarray) -> tuple[_Effects, dict[str, _Effects]]:
        """Both stages on ``rows`` (speed effects, then output effects given the fitted speeds)."""
        if not rows:
            return _empty_effects(), {}
        coded = _Coded.of(rows)
        sel = np.flatnonzero(ok)
        speed = _backfit(*coded.subset(sel), y_speed[sel][:, None], 1.0)[0] if len(sel) else _empty_effects()
        logf = np.array([speed.log_factor(r.scope) for r in rows])
        # the output targets of each quantity; quantities observed on the same records are fitted together
        by_rows: dict[tuple[int, ...], list[tuple[str, np.ndarray]]] = {}
        for q in CORRECTED:
            idx, ys = [], []
            for i, row in enumerate(rows):
                o, b = row.observed.get(q, 0.0), row.predicted.get(q, 0.0)
                if o > _EPS and b > _EPS and math.isfinite(o) and math.isfinite(b):
                    pred = b * _at(row.curve.get(q), logf[i])
                    if pred > _EPS:
                        idx.append(i)
                        ys.append(math.log(o / pred))
            if idx:
                by_rows.setdefault(tuple(idx), []).append((q, np.clip(np.array(ys), -OUTPUT_CLIP, OUTPUT_CLIP)))
        fitted: dict[str, _Effects] = {}
        for idx_t, qs in by_rows.items():
            Y = np.stack([y for _q, y in qs], axis=1)
            for (q, _y), eff in zip(qs, _backfit(*coded.subset(np.asarray(idx_t)), Y, OUTPUT_PRIOR_SCALE), strict=True):
                fitted[q] = eff
        effects = {q: fitted[q] for q in CORRECTED if q in fitted}
        return speed, effects

    @classmethod
    def _fit_rows(cls, rows: list[_Row], *, block: int | None = None) -> ResidualModel:
        y_speed, ok = cls._speed_targets(rows)
        speed, effects = cls._fit_stage(rows, y_speed, ok)
        regimes = _regimes(rows, y_speed, ok, speed)
        if regimes:
            keep = [not any(row.tick < start and row.scope.key(e) == level for (e, level), start in regimes.items())
                    for row in rows]  # fmt: skip
            log.info("residual_regime_change", forgotten=len(rows) - sum(keep),
                     regimes={f"{e}={level}": start for (e, level), start in sorted(regimes.items())})
            rows = [row for row, k in zip(rows, keep, strict=True) if k]
            y_speed, ok = y_speed[keep], ok[keep]
            speed, effects = cls._fit_stage(rows, y_speed, ok)
        history = _prequential(rows, y_speed, ok, block)
        speeds = tuple(
            (r.scope.model, r.scope.gpu_type, r.engine, float(math.exp(y)))
            for r, y, k in zip(rows, y_speed, ok, strict=True) if k
        )
        return cls(speed_effects=speed, effects=effects, history=history, n_records=len(rows), record_speeds=speeds,
                   regimes={f"{e}={level}": start for (e, level), start in sorted(regimes.items())})

    # ---- applying -----------------------------------------------------------------------------------
    def speed(self, scope: Scope, skip: tuple[str, ...] = ()) -> float:
        """Learned multiplier of every iteration time in ``scope`` (1.0 when nothing was learned).

        ``skip`` leaves effects out: a prediction already rescaled by a neighbour's measured profile
        on this GPU (nearest-architecture rule) skips the ``gpu`` effect, which that profile carries.
        """
        if self.speed_effects is None:
            return 1.0
        return float(math.exp(self.speed_effects.log_factor(scope, skip)))

    def factor(self, quantity: str, scope: Scope, skip: tuple[str, ...] = ()) -> float:
        """Output-level multiplicative correction of ``quantity`` in ``scope`` (after speed; 1.0 when
        nothing was learned). Cost per token follows throughput."""
        variables.get(quantity)
        if quantity == "cost_per_token":
            return 1.0 / self.factor("throughput_tokens_per_sec", scope, skip)
        eff = self.effects.get(quantity)
        return 1.0 if eff is None else float(math.exp(eff.log_factor(scope, skip)))

    def factors(self, scope: Scope, skip: tuple[str, ...] = ()) -> dict[str, float]:
        return {q: self.factor(q, scope, skip) for q in self.effects}

    def factor_row(self, scope: Scope, skip: tuple[str, ...] = ()) -> tuple[float, ...]:
        """:meth:`factor` of every quantity of :attr:`effects`, in that order, for one scope.

        The planner corrects every quantity of the same candidates: one call per scope instead of one
        per (quantity, scope), with the scope's effect keys looked up once. Each value is computed
        exactly as :meth:`factor` computes it (same terms, same order of summation)."""
        total = 0.0
        for e, k in zip(EFFECTS, effect_keys(scope), strict=True):
            if e not in skip:  # elementwise, in EFFECTS order: the same additions as log_factor's sum
                total = total + self._level_column(e, k)
        if isinstance(total, float):
            return tuple(1.0 for _ in self.effects)
        return tuple(math.exp(x) for x in total.tolist())

    def _level_column(self, effect: str, key: str) -> np.ndarray:
        """θ of one level of ``effect`` for every quantity of :attr:`effects` (0 where unseen), cached."""
        cache = self.__dict__.get("_level_cols")
        if cache is None:
            cache = {}
            object.__setattr__(self, "_level_cols", cache)
        col = cache.get((effect, key))
        if col is None:
            col = cache[(effect, key)] = np.array([eff.theta[effect].get(key, 0.0) for eff in self.effects.values()],
                                                  dtype=float)  # fmt: skip
        return col

    def support(self, scope: Scope) -> int:
        """Records in exactly this fine scope (any quantity)."""
        effs = list(self.effects.values()) + ([self.speed_effects] if self.speed_effects else [])
        return max((e.support(scope) for e in effs), default=0)

    def correct_values(self, values: Mapping[str, float], scope: Scope, skip: tuple[str, ...] = ()) -> dict[str, float]:
        """``values`` with every learned output factor applied; p99 TTFT/TPOT also scaled by the
        learned speed to first order (the exact path re-runs the physics: ``Surrogate``)."""
        out = dict(values)
        f = self.speed(scope, skip)
        for q in ("p99_ttft_ms", "p99_tpot_ms"):
            if q in out and math.isfinite(out[q]):
                out[q] = out[q] * f
        for q, eff in self.effects.items():
            if q in out and math.isfinite(out[q]):
                out[q] = out[q] * math.exp(eff.log_factor(scope, skip))
        return out

    def predict_record(self, record: PerfRecord, quantities: Sequence[str]) -> dict[str, float]:
        """This model's corrected prediction of ``quantities`` for a PerfDB record, as its prequential
        residuals are computed (the physics re-run at the record's served rate and the fitted speed,
        then the output factors): what the planner holding this model expected of that rank. Quantities
        the record has no base value for are left out."""
        pred = dict(record.predicted)
        if not pred:
            return {}
        curve = _ratio_curves(physics_curves([record])[0]) if self.n_records else {}
        row = _Row(record.config.engine_name, scope_of_record(record), pred, {}, curve, int(record.tick))
        speed = self.speed_effects or _empty_effects()
        out = {}
        for q in quantities:
            p = _row_prediction(row, speed, self.effects, q)
            if p is not None:
                out[q] = p
        return out

    def correct(self, prediction: Any, scope: Scope | None = None) -> Any:
        """A corrected copy of a base :class:`~koi.surrogate.types.RankPrediction` (first-order in
        speed; cost and margin re-derived). ``Surrogate(residuals=model)`` is the exact path."""
        from koi.surrogate.types import apply_correction

        return apply_correction(prediction, self, scope or prediction.scope)

    # ---- residual history for the DRO band ------------------------------------------------------------
    def residuals(self, objective: str, scope: Scope | None = None, *, min_count: int = MIN_RESIDUALS) -> np.ndarray:
        """Prequential residuals of ``objective`` (relative; absolute for slo_margin), for the finest of
        fine → scope → env → gpu → all whose level holds at least ``min_count`` of them."""
        variables.get(objective)
        if objective not in self.history:
            return np.zeros(0)
        scopes, r = self.history[objective]
        if scope is None:
            return r.copy()
        for e in ("fine", "scope", "env", "gpu"):
            key = scope.key(e)
            mask = np.fromiter((s.key(e) == key for s in scopes), dtype=bool, count=len(scopes))
            if mask.sum() >= min_count:
                return r[mask]
        return r.copy() if len(r) >= min_count else np.zeros(0)

    def residuals_in_units(self, objective: str, scope: Scope | None, y_hat: float) -> np.ndarray:
        """Residuals in the objective's own units at prediction ``y_hat`` (r · ŷ; slo_margin as is)."""
        r = self.residuals(objective, scope)
        return r if objective == "slo_margin" else r * float(y_hat)

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"n_records": self.n_records, "quantities": {}}
        if self.speed_effects is not None:
            out["speed"] = {e: {k: round(math.exp(v), 4) for k, v in self.speed_effects.theta[e].items()}
                            for e in ("gpu", "env")}  # fmt: skip
        if self.regimes:
            out["regimes"] = dict(self.regimes)
        for q, (_scopes, r) in self.history.items():
            out["quantities"][q] = {
                "n": len(r),
                "median_abs_residual": float(np.median(np.abs(r))) if len(r) else None,
            }
        return out


def _regimes(rows: list[_Row], y_speed: np.ndarray, ok: np.ndarray, speed: _Effects) -> dict[tuple[str, str], int]:
    """Levels whose speed stepped (:func:`koi.surrogate.drift.regime_starts` on the fit's speed residuals)."""
    sel = np.flatnonzero(ok)
    if len(sel) == 0:
        return {}
    resid = np.array([y_speed[i] - speed.log_factor(rows[i].scope) for i in sel])
    ticks = np.array([rows[i].tick for i in sel], dtype=np.int64)
    levels = {e: [rows[i].scope.key(e) for i in sel] for e in drift.TESTED_EFFECTS}
    return drift.regime_starts(ticks, resid, levels)


#: prequential block boundaries: the first blocks are this many records, then each grows by PREQ_GROWTH
PREQ_MIN_BLOCK = 8
PREQ_GROWTH = 1.15
#: (prefix length, prefix digest) -> the two-stage fit on that prefix; see :func:`_prequential`
_PREFIX_FITS: OrderedDict[tuple[int, int], tuple[_Effects, dict[str, _Effects]]] = OrderedDict()
_PREFIX_FITS_MAX = 512
#: (block start, block stop, digest of rows[:stop]) -> the block's residuals (they depend on nothing else)
_BLOCK_RESIDUALS: OrderedDict[tuple[int, int, int], list[tuple[int, str, float]]] = OrderedDict()


def _block_bounds(n: int, block: int | None) -> list[int]:
    """Block boundaries that do not depend on ``n`` (only where they stop): a fixed stride when
    ``block`` is given, else geometric (8, 16, … then ×1.15: 25 blocks for 700 records, 38 for 5,000),
    so the history of a PerfDB that grew by a tick shares every earlier boundary with the last fit."""
    bounds = [0]
    while bounds[-1] < n:
        b = bounds[-1]
        step = block if block else max(PREQ_MIN_BLOCK, math.ceil(b * PREQ_GROWTH) - b)
        bounds.append(min(n, b + step))
    return bounds


def _prefix_digests(rows: list[_Row]) -> list[int]:
    """A running digest of the rows up to each index: equal digests, equal prefixes (to hash collisions)."""
    out, h = [], 0
    for r in rows:
        h = hash((h, r.tick, r.engine, r.scope, tuple(sorted(r.predicted.items())),
                  tuple(sorted(r.observed.items())), tuple((q, c.tobytes()) for q, c in sorted(r.curve.items()))))
        out.append(h)
    return out


def _cached(cache: OrderedDict, key: tuple) -> Any:
    hit = cache.get(key)
    if hit is not None:
        cache.move_to_end(key)
    return hit


def _put(cache: OrderedDict, key: tuple, value: Any) -> Any:
    cache[key] = value
    if len(cache) > _PREFIX_FITS_MAX:
        cache.pop(next(iter(cache)))
    return value


def _prefix_fit(rows: list[_Row], y_speed: np.ndarray, ok: np.ndarray, start: int, prefix: list[int]
                ) -> tuple[_Effects, dict[str, _Effects]]:  # fmt: skip
    """The two-stage fit on ``rows[:start]`` (kept by the prefix's digest)."""
    if start == 0:
        return _empty_effects(), {}
    key = (start, prefix[start - 1])
    hit = _cached(_PREFIX_FITS, key)
    if hit is None:
        hit = _put(_PREFIX_FITS, key, ResidualModel._fit_stage(rows[:start], y_speed[:start], ok[:start]))
    return hit


def _row_prediction(row: _Row, speed: _Effects, effects: dict[str, _Effects], q: str) -> float | None:
    """The corrected prediction of ``q`` for one record under a fit: the base at the record's served
    rate, moved along the physics' own speed curve to the fitted speed, times the output factor.
    None where the record has no base value or the physics at that speed predicts none."""
    b = row.predicted.get(q, 0.0)
    if not (b > _EPS and math.isfinite(b)):
        return None
    logf = speed.log_factor(row.scope)
    if q == "cost_per_token":
        thr = row.curve.get("throughput_tokens_per_sec")
        g = effects.get("throughput_tokens_per_sec")
        corr = _at(thr, logf) * (math.exp(g.log_factor(row.scope)) if g else 1.0)
        pred = b / max(corr, _EPS)
    else:
        g = effects.get(q)
        pred = b * _at(row.curve.get(q), logf) * (math.exp(g.log_factor(row.scope)) if g else 1.0)
    return pred if pred > _EPS else None  # a queue that empties at that speed: no ratio


def _block_residuals(rows: list[_Row], start: int, stop: int, speed: _Effects, effects: dict[str, _Effects]
                     ) -> list[tuple[int, str, float]]:  # fmt: skip
    """(record index, quantity, obs/pred − 1) of ``rows[start:stop]`` under the fit before them."""
    out = []
    for i in range(start, stop):
        row = rows[i]
        for q in (*CORRECTED, "cost_per_token"):
            o = row.observed.get(q, 0.0)
            if not (o > _EPS and math.isfinite(o)):
                continue
            pred = _row_prediction(row, speed, effects, q)
            if pred is not None:
                out.append((i, q, o / pred - 1.0))
    return out


def _prequential(rows: list[_Row], y_speed: np.ndarray, ok: np.ndarray, block: int | None
                 ) -> dict[str, tuple[list[Scope], np.ndarray]]:  # fmt: skip
    """Relative residuals obs/pred − 1 where each block is predicted by the model fitted before it.

    The planner refits every tick on a PerfDB that only grew: the block boundaries are stable
    (:func:`_block_bounds`) and each prefix's fit is kept, keyed by a digest of the prefix's rows,
    so a tick fits only the blocks that are new (a regime change that forgot records changes the
    prefixes, and they are fitted afresh). The fit is a pure function of the prefix: a kept one
    is exactly what a refit would give, in this process or another."""
    n = len(rows)
    out: dict[str, list[tuple[int, float]]] = {}
    prefix = _prefix_digests(rows)
    bounds = _block_bounds(n, block)
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        key = (start, stop, prefix[stop - 1])  # the digest covers the fit's prefix and the block's rows
        blk = _cached(_BLOCK_RESIDUALS, key)
        if blk is None:
            speed, effects = _prefix_fit(rows, y_speed, ok, start, prefix)
            blk = _put(_BLOCK_RESIDUALS, key, _block_residuals(rows, start, stop, speed, effects))
        for i, q, v in blk:
            out.setdefault(q, []).append((i, v))
    hist = {q: ([rows[i].scope for i, _ in v], np.array([x for _, x in v])) for q, v in out.items()}
    sel = [i for i, row in enumerate(rows) if "slo_margin" in row.predicted and "slo_margin" in row.observed]
    if sel:
        hist["slo_margin"] = (
            [rows[i].scope for i in sel],
            np.array([rows[i].observed["slo_margin"] - rows[i].predicted["slo_margin"] for i in sel]),
        )
    return hist
