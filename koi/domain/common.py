"""Shared base model, enums and helpers of the domain.

Validation policy: every model forbids unknown fields and checks ranges, so a
malformed job, plan or telemetry sample fails at the boundary with a message that
names the field. We do not use pydantic's ``strict=True``: YAML and JSON give
strings for enums and ints for floats, and rejecting those would only push
coercion into every caller.
"""

from __future__ import annotations

import hashlib
import json
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict


class KoiModel(BaseModel):
    """Base of every domain model: unknown fields are errors, assignments are validated."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, str_strip_whitespace=True)


class FrozenModel(BaseModel):
    """Immutable, hashable value objects (environments, chain configs)."""

    model_config = ConfigDict(extra="forbid", frozen=True, str_strip_whitespace=True)


class Market(StrEnum):
    RESERVED = "reserved"
    ON_DEMAND = "on_demand"
    SPOT = "spot"


class JobClass(StrEnum):
    ONLINE = "online"
    BATCH = "batch"


class Interconnect(StrEnum):
    NVLINK = "nvlink"
    PCIE = "pcie"
    INFINITY_FABRIC = "infinity_fabric"


class DType(StrEnum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    INT8 = "int8"
    INT4 = "int4"
    FP4 = "fp4"

    @property
    def bytes(self) -> float:
        return _DTYPE_BYTES[self]

    @property
    def bits(self) -> int:
        return int(_DTYPE_BYTES[self] * 8)


_DTYPE_BYTES = {
    DType.BF16: 2.0,
    DType.FP16: 2.0,
    DType.FP8: 1.0,
    DType.INT8: 1.0,
    DType.INT4: 0.5,
    DType.FP4: 0.5,
}

#: Spellings seen in HF configs and engine flags, folded onto one name.
DTYPE_ALIASES = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float8": "fp8",
    "fp8_e4m3": "fp8",
    "e4m3": "fp8",
    "w4a16": "int4",
    "awq": "int4",
    "gptq": "int4",
    "nvfp4": "fp4",
    "mxfp4": "fp4",
}

MARKET_ALIASES = {"on-demand": "on_demand", "ondemand": "on_demand", "od": "on_demand", "reserved_instance": "reserved"}


def normalise_dtype(v: Any) -> Any:
    if isinstance(v, str):
        s = v.strip().lower()
        return DTYPE_ALIASES.get(s, s)
    return v


def normalise_market(v: Any) -> Any:
    if isinstance(v, str):
        s = v.strip().lower()
        return MARKET_ALIASES.get(s, s)
    return v


def stable_hash(obj: Any, n: int = 12) -> str:
    """A short deterministic digest of a JSON-able object (ids, idempotency keys)."""
    if isinstance(obj, BaseModel):
        obj = obj.model_dump(mode="json")
    raw = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(raw.encode()).hexdigest()[:n]
