"""Where a chain runs: environments, GPU specs and instance shapes with prices.

An environment e = (cloud, region, zone, market, gpu_type) is the unit of capacity
and the unit across which ICP tests invariance (whitepaper, "Problem Formulation").
The spec's plan JSON writes it as a 5-tuple in the order
``[market, cloud, region, zone, gpu_type]``; both that list and a mapping parse.
"""

from __future__ import annotations

from datetime import date
from typing import Any

from pydantic import Field, field_validator, model_validator

from koi.domain.common import FrozenModel, Interconnect, KoiModel, Market, normalise_market


def _canonical_gpu(name: str) -> str:
    # Imported lazily: the catalog imports these models.
    from koi.catalog import canonical_gpu

    return canonical_gpu(name)


class Environment(FrozenModel):
    cloud: str = Field(min_length=1, description="cloud provider, e.g. aws, gcp, azure")
    region: str = Field(min_length=1)
    zone: str = Field(min_length=1, description="availability zone")
    market: Market
    gpu_type: str = Field(min_length=1)

    @model_validator(mode="before")
    @classmethod
    def _from_tuple(cls, v: Any) -> Any:
        if isinstance(v, list | tuple):
            if len(v) != 5:
                raise ValueError(
                    f"env must be a 5-tuple [market, cloud, region, zone, gpu_type], got {len(v)} items"
                )
            market, cloud, region, zone, gpu = v
            return {"market": market, "cloud": cloud, "region": region, "zone": zone, "gpu_type": gpu}
        if isinstance(v, str):
            return cls._parse_id(v)
        return v

    @field_validator("market", mode="before")
    @classmethod
    def _market(cls, v: Any) -> Any:
        return normalise_market(v)

    @field_validator("cloud", "region", "zone", mode="after")
    @classmethod
    def _lower(cls, v: str) -> str:
        return v.lower()

    @field_validator("gpu_type", mode="after")
    @classmethod
    def _gpu(cls, v: str) -> str:
        return _canonical_gpu(v)

    @property
    def env_id(self) -> str:
        """Stable string key: ``cloud:region:zone:market:gpu_type``."""
        return f"{self.cloud}:{self.region}:{self.zone}:{self.market.value}:{self.gpu_type}"

    def as_tuple(self) -> list[str]:
        """The spec's 5-tuple order."""
        return [self.market.value, self.cloud, self.region, self.zone, self.gpu_type]

    @staticmethod
    def _parse_id(s: str) -> dict[str, str]:
        parts = s.split(":")
        if len(parts) != 5:
            raise ValueError(f"env id {s!r} must be 'cloud:region:zone:market:gpu_type'")
        cloud, region, zone, market, gpu = parts
        return {"cloud": cloud, "region": region, "zone": zone, "market": market, "gpu_type": gpu}

    @classmethod
    def from_id(cls, env_id: str) -> Environment:
        return cls.model_validate(cls._parse_id(env_id))

    def __str__(self) -> str:
        return self.env_id


class GpuSpec(KoiModel):
    """One accelerator's data-sheet figures (per GPU)."""

    name: str = Field(min_length=1)
    vendor: str = Field(min_length=1)
    memory_gb: float = Field(gt=0, description="HBM/GDDR capacity, GB (10^9 bytes)")
    mem_bw_gbs: float = Field(gt=0, description="memory bandwidth, GB/s")
    bf16_tflops: float = Field(gt=0, description="dense BF16 tensor TFLOPS")
    fp8_tflops: float | None = Field(default=None, gt=0, description="dense FP8 TFLOPS; None if unsupported")
    int8_tops: float | None = Field(default=None, gt=0)
    interconnect: Interconnect
    intra_node_bw_gbs: float = Field(gt=0, description="per-GPU unidirectional bandwidth to peers in a node")
    pcie_bw_gbs: float = Field(gt=0, description="host PCIe bandwidth per GPU, unidirectional")
    inter_node_bw_gbs: float = Field(gt=0, description="per-GPU network bandwidth across nodes")
    tdp_w: float = Field(gt=0)
    aic_system: str | None = Field(
        default=None, description="aiconfigurator-core system whose measured operator tables describe this GPU"
    )
    aliases: list[str] = Field(default_factory=list)
    sources: list[str] = Field(min_length=1, description="where each figure comes from")

    @property
    def supports_fp8(self) -> bool:
        return self.fp8_tflops is not None


class RegionPrice(KoiModel):
    region: str = Field(min_length=1)
    on_demand_hourly: float = Field(gt=0, description="$/hour for the whole instance")
    spot_hourly: float | None = Field(default=None, gt=0)
    reserved_hourly: float | None = Field(default=None, gt=0, description="1-year commitment, effective $/hour")


class InstanceType(KoiModel):
    cloud: str = Field(min_length=1)
    name: str = Field(min_length=1)
    gpu_type: str = Field(min_length=1)
    gpu_count: int = Field(ge=1, le=16)
    vcpus: int = Field(ge=1)
    memory_gb: float = Field(gt=0)
    interconnect: Interconnect
    prices: list[RegionPrice] = Field(min_length=1)
    price_date: date = Field(description="the day the prices were read")
    source: str = Field(min_length=1)

    @field_validator("gpu_type", mode="after")
    @classmethod
    def _gpu(cls, v: str) -> str:
        return _canonical_gpu(v)

    @property
    def regions(self) -> list[str]:
        return [p.region for p in self.prices]

    def hourly_price(self, region: str, market: Market | str) -> float:
        """$/hour of the whole instance in ``region`` under ``market``.

        Reserved prices not listed take 60% of on-demand (a typical 1-year commitment
        discount across AWS, GCP and Azure); spot prices not listed are an error, since
        an environment without a spot market cannot be offered.
        """
        market = Market(normalise_market(market))
        for p in self.prices:
            if p.region == region:
                if market is Market.ON_DEMAND:
                    return p.on_demand_hourly
                if market is Market.SPOT:
                    if p.spot_hourly is None:
                        raise ValueError(f"{self.cloud}/{self.name} has no spot price in {region}")
                    return p.spot_hourly
                return p.reserved_hourly if p.reserved_hourly is not None else round(0.6 * p.on_demand_hourly, 4)
        raise ValueError(f"{self.cloud}/{self.name} is not offered in region {region!r}")
