"""Everything one planning pass reads besides the snapshot: predictor, knobs, beliefs, history."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from pydantic import Field

from koi.domain.common import KoiModel
from koi.planning.predictor import AnalyticPredictor, Predictor
from koi.scoring.exploration import ExplorationModel
from koi.scoring.params import PlanningKnobs
from koi.scoring.switching import SwitchParams

#: Engine knob presets (Appendix C batching knobs): latency keeps batches small so decode
#: steps stay short; throughput lets the batch and the prefill budget grow.
PRESETS: dict[str, dict[str, int]] = {
    "latency": {"max_num_seqs": 64, "max_num_batched_tokens": 4096},
    "balanced": {"max_num_seqs": 256, "max_num_batched_tokens": 8192},
    "throughput": {"max_num_seqs": 512, "max_num_batched_tokens": 16384},
}


class EnumerationParams(KoiModel):
    """Bounds of the candidate enumeration (deterministic; every bound is a choice).

    Per hardware class (GPU type × instance shape) we try TP ∈ ``tp`` within one instance,
    PP ∈ ``pp`` across instances, chains of at most ``max_chain_gpus`` GPUs, weight/KV
    dtypes (native weights and KV; fp8 weights and KV where the GPU has fp8; fp8 weights over a
    bf16 KV cache only with ``fp8_mixed_kv`` — by default off: under the surrogate it costs the same
    weights traffic as fp8/fp8 with half the KV room, so it is almost never the better chain, and it
    would add a third of the predictions) and two knob
    presets per class of job (online: latency, balanced; batch: balanced, throughput).
    Of the physically feasible shapes per (dtype, preset) we keep the ``shapes_per_dtype``
    smallest GPU counts: a larger chain than 2× the minimum rarely pays for its GPUs and
    replicas scale out instead. After sizing and scoring, dominated candidates are pruned
    per pool and at most ``max_candidates`` per job survive (the best of every pool
    first, then by σ).
    """

    tp: tuple[int, ...] = (1, 2, 4, 8)
    pp: tuple[int, ...] = (1, 2, 4)
    max_chain_gpus: int = Field(default=16, ge=1)
    presets_online: tuple[str, ...] = ("latency", "balanced")
    presets_batch: tuple[str, ...] = ("balanced", "throughput")
    fp8: bool = True
    fp8_mixed_kv: bool = False
    shapes_per_dtype: int = Field(default=2, ge=1)
    max_candidates: int = Field(default=30, ge=1)
    prune_dominated: bool = Field(default=True, description="drop per-pool dominated candidates before the top-K")
    batch_slack: float = Field(default=0.15, ge=0, description="the deadline point: rate × (1 + slack)")
    batch_fast_factor: float = Field(default=2.0, ge=1, description="the fast point: × this rate")
    online_max_headroom: float = Field(default=2.0, ge=1, description="replicas up to this × n_min for risk")
    hetero_top: int = Field(default=3, ge=0, description="best chains tried as the first rank of a split ladder")
    max_ranks: int = Field(default=3, ge=1)
    scale_out_share: float = Field(default=0.5, ge=0,
                                   description="capacity a scale-out rank adds to a breaching running ladder, "
                                               "as a share of that ladder's (0: no scale-out ladders)")
    scale_in: bool = Field(default=True, description="offer a running online ladder with a rank shrunk to the "
                                                     "n_min and headroom points when it holds more (split.scale_in_ladders)")
    rehome: bool = Field(default=True, description="offer a running rank moved onto free reserved instances of its "
                                                   "GPU type that plan cheaper (split.rehome_ladders)")
    settle_ticks: int = Field(default=1, ge=0, description="ticks after its launch a new rank is held while its "
                                                           "ladder is healthy (split.sheds_settling; 0: no window)")


@dataclass
class PlanningContext:
    """The inputs of S4/S5 other than the snapshot (all deterministic)."""

    predictor: Predictor = field(default_factory=AnalyticPredictor)
    knobs: PlanningKnobs = field(default_factory=PlanningKnobs)
    exploration: ExplorationModel = field(default_factory=ExplorationModel.empty)
    switch: SwitchParams = field(default_factory=SwitchParams)
    enum: EnumerationParams = field(default_factory=EnumerationParams)
    #: job id → best observed value per objective (z* from the job's history H_i)
    history: Mapping[str, Mapping[str, float]] = field(default_factory=dict)
    #: job id → the running ladder's observed breach share in its last settled window, its ranks'
    #: shares weighted by their traffic (:mod:`koi.evidence.observed`); the keep option's p_brk is
    #: at least this
    observed_risk: Mapping[str, float] = field(default_factory=dict)
    cluster_id: str = ""
    tick: int = 0
