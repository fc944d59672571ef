"""Catalogs shipped as data files: GPUs, instance shapes with prices, model architectures.

Each file lives in ``koi/catalog/data`` with its sources beside the figures. The
loaders validate every entry through the domain models and cache the result, so a
bad catalog fails at first use with the entry and field named.
"""

from __future__ import annotations

from functools import cache, lru_cache
from importlib import resources
from typing import Any

import yaml

from koi.domain.hardware import GpuSpec, InstanceType
from koi.domain.model import ModelArch


class CatalogError(ValueError):
    """A catalog file is malformed, or a lookup names something the catalog lacks."""


def _load(name: str) -> Any:
    text = resources.files("koi.catalog").joinpath("data", name).read_text(encoding="utf-8")
    return yaml.safe_load(text)


@lru_cache(maxsize=4096)
def _norm(s: str) -> str:
    """Lower-case alphanumerics only (alias matching); cached: every model and GPU lookup goes through it."""
    return "".join(ch for ch in s.lower() if ch.isalnum())


def _validated(kind: type, rows: list[dict[str, Any]], file: str) -> list[Any]:
    out = []
    for i, row in enumerate(rows):
        try:
            out.append(kind.model_validate(row))
        except Exception as exc:  # re-raised with the entry named
            label = row.get("name", f"#{i}") if isinstance(row, dict) else f"#{i}"
            raise CatalogError(f"{file}: entry {label!r} is invalid: {exc}") from exc
    return out


def _alias_table(rows: list[dict[str, Any]], keys: tuple[str, ...], file: str) -> dict[str, str]:
    """Normalised alias -> canonical name; an alias naming two entries is a catalog error."""
    table: dict[str, str] = {}
    for row in rows:
        for alias in [*(row.get(k, "") for k in keys), *row.get("aliases", [])]:
            if not alias:
                continue
            prev = table.setdefault(_norm(alias), row["name"])
            if prev != row["name"]:
                raise CatalogError(f"{file}: alias {alias!r} names both {prev!r} and {row['name']!r}")
    return table


# ---- GPUs -----------------------------------------------------------------------------
@cache
def _gpu_rows() -> list[dict[str, Any]]:
    return _load("gpus.yaml")["gpus"]


@cache
def _gpu_aliases() -> dict[str, str]:
    return _alias_table(_gpu_rows(), ("name",), "gpus.yaml")


def canonical_gpu(name: str) -> str:
    """The catalog's name for a GPU, accepting aliases ("H100-SXM", "h100_80gb" ...)."""
    try:
        return _gpu_aliases()[_norm(name)]
    except KeyError:
        known = ", ".join(sorted(r["name"] for r in _gpu_rows()))
        raise CatalogError(f"unknown GPU {name!r}; the catalog has: {known}") from None


@cache
def gpus() -> dict[str, GpuSpec]:
    specs = _validated(GpuSpec, _gpu_rows(), "gpus.yaml")
    return {g.name: g for g in specs}


def gpu(name: str) -> GpuSpec:
    return gpus()[canonical_gpu(name)]


# ---- instances --------------------------------------------------------------------------
@cache
def instances() -> dict[tuple[str, str], InstanceType]:
    """(cloud, instance name) -> InstanceType."""
    data = _load("instances.yaml")
    rows = []
    for provider in data["providers"]:
        for inst in provider["instances"]:
            rows.append(
                {
                    "cloud": provider["cloud"],
                    "price_date": provider["price_date"],
                    "source": provider["source"],
                    **inst,
                }
            )
    items = _validated(InstanceType, rows, "instances.yaml")
    return {(i.cloud, i.name): i for i in items}


def instance(cloud: str, name: str) -> InstanceType:
    try:
        return instances()[(cloud.lower(), name)]
    except KeyError:
        raise CatalogError(f"unknown instance type {name!r} on cloud {cloud!r}") from None


def instance_by_name(name: str) -> InstanceType:
    """An instance type by its name alone (names are unique across providers in the catalog)."""
    hits = [i for (c, n), i in instances().items() if n == name]
    if not hits:
        raise CatalogError(f"unknown instance type {name!r}")
    if len(hits) > 1:
        raise CatalogError(f"instance type {name!r} is ambiguous across clouds {[h.cloud for h in hits]}")
    return hits[0]


def instances_for_gpu(gpu_type: str, cloud: str | None = None) -> list[InstanceType]:
    g = canonical_gpu(gpu_type)
    return sorted(
        (i for i in instances().values() if i.gpu_type == g and (cloud is None or i.cloud == cloud)),
        key=lambda i: (i.cloud, i.gpu_count, i.name),
    )


# ---- models -------------------------------------------------------------------------------
@cache
def _model_rows() -> list[dict[str, Any]]:
    return _load("models.yaml")["models"]


@cache
def _model_aliases() -> dict[str, str]:
    return _alias_table(_model_rows(), ("name", "hf_id"), "models.yaml")


def canonical_model(name: str) -> str:
    try:
        return _model_aliases()[_norm(name)]
    except KeyError:
        known = ", ".join(sorted(r["name"] for r in _model_rows()))
        raise CatalogError(f"unknown model {name!r}; the catalog has: {known}") from None


@cache
def models() -> dict[str, ModelArch]:
    rows = [{k: v for k, v in r.items() if k != "aliases"} for r in _model_rows()]
    return {m.name: m for m in _validated(ModelArch, rows, "models.yaml")}


def model(name: str) -> ModelArch:
    return models()[canonical_model(name)]


__all__ = [
    "CatalogError",
    "canonical_gpu",
    "canonical_model",
    "gpu",
    "gpus",
    "instance",
    "instance_by_name",
    "instances",
    "instances_for_gpu",
    "model",
    "models",
]
