"""What the surrogate returns: per-rank and per-ladder predictions, keyed by registry names.

``values`` always holds the corrected prediction (residual learning applied);
``base_values`` the physics alone. Store ``base_values`` in ``PerfRecord.predicted``
so the residual learner sees the base model's error (koi.surrogate.residual), and
``to_prediction()`` (the corrected values) for S2's CUSUM.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from pydantic import Field

from koi import outcomes, variables
from koi.domain.chain import ChainConfig
from koi.domain.common import KoiModel
from koi.domain.telemetry import Prediction
from koi.surrogate.scope import Scope

if TYPE_CHECKING:
    from koi.surrogate.residual import ResidualModel


class RankPrediction(KoiModel):
    """S(x, e, W) for one rank at an offered load (whitepaper, "The Surrogate Stack")."""

    job_id: str
    model: str
    env_id: str
    gpu_type: str
    config: ChainConfig
    n_replicas: int = Field(ge=1)
    offered_rps: float = Field(ge=0, description="arrival rate offered to the whole rank")
    per_replica_rps: float = Field(ge=0)
    values: dict[str, float] = Field(description="registry name -> corrected prediction (rank level)")
    base_values: dict[str, float] = Field(default_factory=dict, description="before residual correction")
    flags: list[str] = Field(default_factory=list)
    uncertainty: float = Field(default=1.0, ge=1.0, description="σ multiplier for the DRO band")
    sigma_rel: dict[str, float] = Field(default_factory=dict, description="prior relative σ per objective")
    feasible: bool = True
    reasons: list[str] = Field(default_factory=list)
    capacity_rps: float = Field(default=0.0, ge=0, description="sustainable req/s of one replica (cap and p99 targets)")
    saturation_rps: float = Field(default=0.0, ge=0, description="req/s at which one replica saturates")
    hourly_cost: float = Field(default=0.0, ge=0, description="$/h of the whole rank")
    target_ttft_ms: float | None = None
    target_tpot_ms: float | None = None
    residual_support: int = Field(default=0, ge=0, description="PerfDB records in this exact scope")
    scope: Scope

    def to_prediction(self, cluster_id: str, tick: int, rank_id: str | None = None) -> Prediction:
        """The domain Prediction stored at plan time (observable names only; S2 reads it back)."""
        allowed = set(variables.TELEMETRY_SERIES)
        vals = {k: float(v) for k, v in self.values.items() if k in allowed and math.isfinite(v)}
        return Prediction(
            cluster_id=cluster_id,
            tick=tick,
            job_id=self.job_id,
            rank_id=rank_id or f"{self.job_id}/{_chain_key(self)}",
            env_id=self.env_id,
            values=vals,
            flags=list(self.flags),
        )

    def get(self, name: str) -> float:
        variables.get(name)
        return self.values[name]


def _chain_key(p: RankPrediction) -> str:
    from koi.domain.chain import Chain
    from koi.domain.hardware import Environment

    return Chain(env=Environment.from_id(p.env_id), config=p.config).key


class LadderPrediction(KoiModel):
    """Ladder-level outcomes and the per-rank predictions they combine."""

    job_id: str
    offered_rps: float = Field(ge=0)
    values: dict[str, float]
    ranks: list[RankPrediction]
    load_split: list[float] = Field(description="share of the offered load routed to each rank")
    flags: list[str] = Field(default_factory=list)
    uncertainty: float = Field(default=1.0, ge=1.0)
    feasible: bool = True
    reasons: list[str] = Field(default_factory=list)
    capacity_rps: float = Field(default=0.0, ge=0, description="sustainable req/s of the whole ladder")
    hourly_cost: float = Field(default=0.0, ge=0)
    total_gpus: int = Field(default=0, ge=0)


def derive_outcomes(values: dict[str, float], hourly_cost: float, target_ttft_ms: float | None,
                    target_tpot_ms: float | None, batch_margin: float | None = None) -> dict[str, float]:
    """Recompute cost per token and SLO margin (koi.outcomes) from the other outcomes."""
    out = dict(values)
    out["cost_per_token"] = float(outcomes.cost_per_token(hourly_cost, out["throughput_tokens_per_sec"]))
    if target_ttft_ms is not None and target_tpot_ms is not None:
        out["slo_margin"] = float(
            outcomes.online_slo_margin(out["p99_ttft_ms"], out["p99_tpot_ms"], target_ttft_ms, target_tpot_ms)
        )
    elif batch_margin is not None:
        out["slo_margin"] = batch_margin
    return out


def apply_correction(pred: RankPrediction, model: ResidualModel, scope: Scope) -> RankPrediction:
    """``pred`` with the residual model's factors applied to its base values; derived outcomes re-derived."""
    base = pred.base_values or pred.values
    skip = ("gpu", "env") if any(f.startswith("nearest_arch:") for f in pred.flags) else ()
    vals = model.correct_values(base, scope, skip)
    batch_margin = None
    if pred.target_ttft_ms is None and "slo_margin" in base:
        # batch margin 1 - required/achieved scales with the throughput correction
        f = vals["throughput_tokens_per_sec"] / max(base["throughput_tokens_per_sec"], 1e-12)
        req = 1.0 - base["slo_margin"]
        batch_margin = float(max(outcomes.MARGIN_FLOOR, min(1.0, 1.0 - req / f)))
    vals = derive_outcomes(vals, pred.hourly_cost, pred.target_ttft_ms, pred.target_tpot_ms, batch_margin)
    support = model.support(scope)
    return pred.model_copy(update={"values": vals, "base_values": dict(base), "residual_support": support})
