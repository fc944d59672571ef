"""Chains, ranks and ladders (whitepaper, "Problem Formulation"; overview §2.2).

- chain c = (e, x): one model copy sharded by TP and PP inside one environment;
- rank (c, n): n homogeneous replicas of that chain;
- ladder L_i: the ordered, possibly heterogeneous ranks of job i.

A rank serialises in the spec's plan JSON shape: ``{"role", "env": [5-tuple],
"config": {instance_type, tp, pp, dp, ep, gpu_count, engine_name, ...},
"n_replicas", "mechanism_id"}``.

Choices where the spec is vague: ``dp`` inside a chain multiplies its GPUs
(gpu_count = tp · pp · dp) and ``ep`` must divide tp · dp, as in vLLM where expert
parallelism reuses the TP × DP ranks. ``kv_dtype`` defaults to the weight dtype
when unset, as vLLM's ``kv_cache_dtype=auto`` does.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from koi.domain.common import DType, FrozenModel, KoiModel, normalise_dtype, stable_hash
from koi.domain.hardware import Environment

EngineName = Literal["vllm", "sglang", "trtllm"]


class ChainConfig(FrozenModel):
    """The knobs x of one chain (Appendix C, parallelism/engine/batching/memory/quantization)."""

    instance_type: str | None = Field(default=None, description="instance shape the chain runs on")
    tp: int = Field(default=1, ge=1, le=64)
    pp: int = Field(default=1, ge=1, le=64)
    dp: int = Field(default=1, ge=1, le=64)
    ep: int = Field(default=1, ge=1, le=64)
    gpu_count: int | None = Field(default=None, ge=1, description="tp * pp * dp; checked when given")
    engine_name: EngineName = "vllm"
    engine_version: str = Field(default="0.24.0", min_length=1)
    max_num_seqs: int = Field(default=256, ge=1, le=4096)
    max_num_batched_tokens: int = Field(default=8192, ge=16, le=1_048_576)
    gpu_mem_util: float = Field(default=0.90, gt=0.1, le=0.99)
    prefix_caching: bool = True
    chunked_prefill: bool = True
    weight_dtype: DType = DType.BF16
    kv_dtype: DType | None = None
    block_size: int = Field(default=16, ge=1, le=256)

    @field_validator("weight_dtype", "kv_dtype", mode="before")
    @classmethod
    def _dtype(cls, v: Any) -> Any:
        if isinstance(v, str) and v.strip().lower() == "auto":
            return None
        return normalise_dtype(v)

    @model_validator(mode="after")
    def _shape(self) -> ChainConfig:
        gpus = self.tp * self.pp * self.dp
        if self.gpu_count is not None and self.gpu_count != gpus:
            raise ValueError(f"gpu_count ({self.gpu_count}) must equal tp*pp*dp = {gpus}")
        if (self.tp * self.dp) % self.ep:
            raise ValueError(f"ep ({self.ep}) must divide tp*dp ({self.tp * self.dp})")
        if not self.chunked_prefill and self.max_num_batched_tokens < 16:
            raise ValueError("max_num_batched_tokens too small")
        return self

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def kv_cache_dtype(self) -> DType:
        return self.kv_dtype or self.weight_dtype

    @property
    def key(self) -> str:
        return stable_hash(self.model_dump(mode="json", exclude={"gpu_count"}))


class Chain(FrozenModel):
    """c = (e, x)."""

    env: Environment
    config: ChainConfig

    @property
    def key(self) -> str:
        return stable_hash({"env": self.env.env_id, "config": self.config.key})


class Role(StrEnum):
    AGGREGATE = "aggregate"
    PREFILL = "prefill"  # deferred: disaggregation
    DECODE = "decode"  # deferred: disaggregation


class Rank(KoiModel):
    role: Role = Role.AGGREGATE
    env: Environment
    config: ChainConfig
    n_replicas: int = Field(ge=1, le=4096)
    mechanism_id: str | None = None
    route_weight: float | None = Field(
        default=None, gt=0,
        description="the gateway's weight of one replica of this rank among the job's ranks (the planner's "
                    "per-replica SLO capacity, req/s); honoured when every serving rank of the job has one, "
                    "else the gateway weighs replicas by nominal decode capacity. Not part of the ladder's key.",
    )

    @model_validator(mode="before")
    @classmethod
    def _flatten_chain(cls, v: Any) -> Any:
        # Accept {"chain": {"env": ..., "config": ...}} as well as the spec's flat shape.
        if isinstance(v, dict) and "chain" in v:
            v = dict(v)
            chain = v.pop("chain")
            if isinstance(chain, Chain):
                chain = {"env": chain.env, "config": chain.config}
            v.update(chain)
        return v

    @property
    def chain(self) -> Chain:
        return Chain(env=self.env, config=self.config)

    @property
    def gpus(self) -> int:
        return self.config.gpus * self.n_replicas

    def rank_id(self, job_id: str) -> str:
        """Deterministic rank identity: the job and the chain (not the replica count)."""
        return f"{job_id}/{self.chain.key}"


class Ladder(KoiModel):
    ranks: list[Rank] = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _from_list(cls, v: Any) -> Any:
        return {"ranks": v} if isinstance(v, list) else v

    @property
    def total_replicas(self) -> int:
        return sum(r.n_replicas for r in self.ranks)

    @property
    def total_gpus(self) -> int:
        return sum(r.gpus for r in self.ranks)

    @property
    def env_ids(self) -> list[str]:
        return sorted({r.env.env_id for r in self.ranks})

    @property
    def key(self) -> str:
        """Identity of the ladder's shape: two ladders with equal keys are the same deployment."""
        return stable_hash(sorted((r.chain.key, r.n_replicas) for r in self.ranks))
