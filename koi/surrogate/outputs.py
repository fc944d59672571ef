"""What the surrogate hands back, besides :mod:`koi.surrogate.types`' rank and ladder predictions:
the batch API's struct of arrays (:class:`BatchPrediction`), one replica's :class:`Capacity`, the
registry names every prediction carries, and :class:`SurrogateError`. Kept apart from
:mod:`koi.surrogate.core` so the output types do not live inside the code that computes them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from koi import catalog
from koi.domain.chain import Chain
from koi.domain.common import JobClass
from koi.domain.job import Job
from koi.surrogate.prep import _scope
from koi.surrogate.scope import Scope
from koi.surrogate.types import RankPrediction


class SurrogateError(ValueError):
    """The surrogate cannot predict for these inputs (unknown model or GPU, malformed request)."""


# ---- outputs of the batch API ----------------------------------------------------------------------
@dataclass
class BatchPrediction:
    """Predictions for n candidate ranks (struct of arrays; rank-level values by registry name)."""

    chains: list[Chain]
    n_replicas: np.ndarray
    offered_rps: np.ndarray
    values: dict[str, np.ndarray]
    base_values: dict[str, np.ndarray]
    feasible: np.ndarray
    reasons: list[tuple[str, ...]]
    flags: list[tuple[str, ...]]
    uncertainty: np.ndarray
    capacity_rps: np.ndarray  # per replica
    saturation_rps: np.ndarray  # per replica
    hourly_cost: np.ndarray  # rank $/h
    aux: dict[str, np.ndarray]
    scopes: list[Scope | None]
    job: Job
    sigma_rel: dict[str, float] = field(default_factory=dict)
    support: np.ndarray | None = None  # PerfDB records in each candidate's exact scope

    def __len__(self) -> int:
        return len(self.chains)

    def rank(self, i: int) -> RankPrediction:
        """Candidate ``i`` as a RankPrediction."""
        c = self.chains[i]
        j = self.job
        vals = {k: float(v[i]) for k, v in self.values.items()}
        base = {k: float(v[i]) for k, v in self.base_values.items()}
        u = float(self.uncertainty[i])
        scope = self.scopes[i] or _scope(j, c, catalog.model(j.model))
        return RankPrediction(
            job_id=j.job_id,
            model=j.model,
            env_id=c.env.env_id,
            gpu_type=c.env.gpu_type,
            config=c.config,
            n_replicas=int(self.n_replicas[i]),
            offered_rps=float(self.offered_rps[i]),
            per_replica_rps=float(self.offered_rps[i] / max(self.n_replicas[i], 1)),
            values=vals,
            base_values=base,
            flags=list(self.flags[i]),
            uncertainty=u,
            sigma_rel={k: s * u for k, s in self.sigma_rel.items()},
            feasible=bool(self.feasible[i]),
            reasons=list(self.reasons[i]),
            capacity_rps=float(self.capacity_rps[i]),
            saturation_rps=float(self.saturation_rps[i]),
            hourly_cost=float(self.hourly_cost[i]),
            target_ttft_ms=j.slo.p99_ttft_ms if j.job_class is JobClass.ONLINE else None,
            target_tpot_ms=j.slo.p99_tpot_ms if j.job_class is JobClass.ONLINE else None,
            residual_support=int(self.support[i]) if self.support is not None else 0,
            scope=scope,
        )


@dataclass(frozen=True)
class Capacity:
    """What one replica of a chain sustains for a job."""

    rps: float  # under the utilisation cap and the p99 targets (online); saturation (batch)
    tokens_per_sec: float
    saturation_rps: float
    limited_by: str  # utilization | p99_ttft_ms | p99_tpot_ms | saturation | infeasible
    feasible: bool
    reasons: tuple[str, ...] = ()
    flags: tuple[str, ...] = ()


_ALL_NAMES: tuple[str, ...] = (
    "throughput_tokens_per_sec", "p99_ttft_ms", "p99_tpot_ms", "cost_per_token", "slo_margin",
    "kv_cache_util", "kv_pressure_score", "gpu_mem_used_fraction", "vram_headroom_gb", "pipeline_bubble_fraction",
    "comm_overhead_pct", "per_tok_comm_bytes", "kvcache_hit_rate", "live_batch_size", "queue_depth",
    "preemption_rate", "input_length_observed", "output_length_observed",
)  # fmt: skip
