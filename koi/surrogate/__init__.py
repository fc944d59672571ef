"""The surrogate S(x, e, W) → (V̂, Ŷ) (whitepaper, "The Surrogate Stack"; overview §2.3).

What the planner calls (a :class:`Surrogate` holds the learned state; the module-level
functions use a default one with nothing learned)::

    s = Surrogate.from_records(perf_records)          # residual corrections learned from PerfDB
    s.predict_rank(job, rank, offered_rps=None, price_per_gpu_hour=None) -> RankPrediction
    s.predict_ladder(job, ladder, prices=None, offered_rps=None)        -> LadderPrediction
    s.rank_capacity(job, chain)                        -> Capacity  (one replica: req/s, tok/s)
    s.capacity_many(job, chains)                       -> list[Capacity]
    s.predict_many(job, chains, offered_rps=None, n_replicas=1, price_per_gpu_hour=None)
                                                       -> BatchPrediction (arrays; the hot path)
    s.closed_loop(model, chains, isl, osl, concurrency) -> mean TTFT/TPOT (silicon benchmark mode)
    feasibility(model, chain, workload=None)           -> (ok, reasons)        # C2
    RankPrediction.to_prediction(cluster_id, tick)     -> koi.domain.Prediction (stored for S2)
    ResidualModel.fit(records) / .correct(prediction, scope) / .residuals(objective, scope)

Predictions are keyed by :mod:`koi.variables` names; ``values`` are corrected,
``base_values`` are the physics alone (store those in ``PerfRecord.predicted``).
Flags: ``rescaled_gpu:<from>`` (GPU without measured tables), ``nearest_arch:<from>``
(model without a measured profile on that GPU), ``multi_node``, ``tp_across_nodes``,
``saturated``, ``kv_preemption``; ``uncertainty`` ≥ 1 multiplies the DRO σ.

Modules: ``core`` (composition, ladder), ``capacity_mixin`` (capacity search),
``closed_loop_mixin`` (the silicon benchmark's closed-loop mode), ``outputs`` (BatchPrediction, Capacity,
SurrogateError), ``prep`` (per-candidate tables and scalars, cached), ``pricing`` (catalog
prices), ``ladder_mix`` (ladder outcomes from its ranks'), ``queueing`` (latency under load),
``physics`` (koi.perf step tables, cached), ``feasibility`` (C2), ``profiles``
(nearest architecture), ``residual`` + ``scope`` (learning), ``roofline`` (the anchor),
``silicon`` and ``evaluate`` (``koi surrogate eval``).
"""

from __future__ import annotations

from koi.surrogate.core import SIGMA_PRIOR, UTILIZATION_CAP, Surrogate, default_surrogate
from koi.surrogate.feasibility import Feasibility, check, feasibility
from koi.surrogate.outputs import BatchPrediction, Capacity, SurrogateError
from koi.surrogate.pricing import catalog_gpu_hour_price
from koi.surrogate.profiles import ProfileBook
from koi.surrogate.residual import ResidualModel
from koi.surrogate.scope import Scope
from koi.surrogate.types import LadderPrediction, RankPrediction


def predict_rank(job, rank, offered_rps=None, price_per_gpu_hour=None, **kw) -> RankPrediction:  # noqa: ANN001
    """:meth:`Surrogate.predict_rank` on the default surrogate (nothing learned)."""
    return default_surrogate().predict_rank(job, rank, offered_rps, price_per_gpu_hour, **kw)


def predict_ladder(job, ladder, prices=None, **kw) -> LadderPrediction:  # noqa: ANN001
    """:meth:`Surrogate.predict_ladder` on the default surrogate."""
    return default_surrogate().predict_ladder(job, ladder, prices, **kw)


def rank_capacity(job, chain) -> Capacity:  # noqa: ANN001
    """:meth:`Surrogate.rank_capacity` on the default surrogate."""
    return default_surrogate().rank_capacity(job, chain)


def predict_many(job, chains, **kw) -> BatchPrediction:  # noqa: ANN001
    """:meth:`Surrogate.predict_many` on the default surrogate."""
    return default_surrogate().predict_many(job, chains, **kw)


__all__ = [
    "SIGMA_PRIOR", "UTILIZATION_CAP", "BatchPrediction", "Capacity", "Feasibility", "LadderPrediction",
    "ProfileBook", "RankPrediction", "ResidualModel", "Scope", "Surrogate", "SurrogateError",
    "catalog_gpu_hour_price", "check", "default_surrogate", "feasibility", "predict_ladder", "predict_many",
    "predict_rank", "rank_capacity",
]
