"""Model architectures, from their published configs.

Only the quantities the physics needs: parameter count, the transformer shape that
sets GEMM, attention and KV sizes, and the MoE routing shape.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from koi.domain.common import DType, KoiModel, normalise_dtype


class ModelArch(KoiModel):
    name: str = Field(min_length=1, description="catalog name, e.g. llama-3.1-70b")
    family: str = Field(min_length=1, description="architecture family, e.g. llama3, qwen3, mixtral")
    hf_id: str = Field(default="", description="Hugging Face repository the config comes from")
    params_b: float = Field(gt=0, description="total parameters, billions")
    num_layers: int = Field(ge=1)
    hidden_size: int = Field(ge=1)
    num_heads: int = Field(ge=1)
    num_kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    intermediate_size: int = Field(ge=1, description="dense FFN width (per layer)")
    vocab_size: int = Field(ge=1)
    num_experts: int = Field(default=0, ge=0, description="routed experts; 0 for dense")
    num_experts_active: int = Field(default=0, ge=0, description="experts per token (top-k)")
    moe_intermediate_size: int = Field(default=0, ge=0, description="FFN width of one expert")
    num_shared_experts: int = Field(default=0, ge=0)
    native_dtype: DType = DType.BF16
    max_context: int = Field(default=32768, ge=512)
    source: str = Field(default="", description="where the config was read")

    @field_validator("native_dtype", mode="before")
    @classmethod
    def _dtype(cls, v: Any) -> Any:
        return normalise_dtype(v)

    @model_validator(mode="after")
    def _shape(self) -> ModelArch:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.num_experts:
            if not 1 <= self.num_experts_active <= self.num_experts:
                raise ValueError(
                    f"num_experts_active ({self.num_experts_active}) must be in 1..num_experts ({self.num_experts})"
                )
            if self.moe_intermediate_size <= 0:
                raise ValueError("an MoE model needs moe_intermediate_size > 0")
        elif self.num_experts_active:
            raise ValueError("num_experts_active is set but num_experts is 0 (a dense model)")
        return self

    # ---- derived quantities ---------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def active_params_b(self) -> float:
        """Parameters touched per token: all of a dense model; attention + shared + top-k experts of an MoE."""
        if not self.is_moe:
            return self.params_b
        expert = 3 * self.hidden_size * self.moe_intermediate_size * self.num_layers
        inactive = (self.num_experts - self.num_experts_active) * expert
        return max(self.params_b - inactive / 1e9, self.params_b * 0.02)

    def weight_bytes(self, dtype: DType | None = None) -> float:
        """Bytes of all weights at ``dtype`` (embeddings counted at the same precision)."""
        return self.params_b * 1e9 * (dtype or self.native_dtype).bytes

    def kv_bytes_per_token(self, kv_dtype: DType | None = None) -> float:
        """K and V for every layer: 2 · layers · kv_heads · head_dim · bytes."""
        return 2.0 * self.num_layers * self.num_kv_heads * self.head_dim * (kv_dtype or self.native_dtype).bytes

    @property
    def gqa_ratio(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def model_type(self) -> str:
        """Coarse scope class used by mechanism scopes: ``moe``, ``dense_large`` (≥ 30B), ``dense_small``."""
        if self.is_moe:
            return "moe"
        return "dense_large" if self.params_b >= 30 else "dense_small"
