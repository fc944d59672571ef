"""Where the measured data lives: the aiconfigurator-core wheel (Apache-2.0).

We read its *data files* only (parquet operator tables, system spec yamls,
``silicon_sample.csv``); no aiconfigurator code runs here.

Layout read (``systems/`` inside the installed package)::

    systems/<system>.yaml                                spec figures + memory reserves
    systems/data/<system>/<family>/<backend>/<version>/  one op family, one engine build
        gemm/…/gemm_perf.parquet
        attention/…/{context,generation}_attention_perf.parquet
        moe/…/moe_perf.parquet
        comm/<backend>/<version>/custom_allreduce_perf.parquet
        comm/nccl/<nccl_version>/nccl_perf.parquet
    systems/silicon_sample.csv                           measured end-to-end TTFT/TPOT
"""

from __future__ import annotations

import importlib.metadata
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import yaml

#: Systems that carry measured operator tables and that Koi uses.
PROFILED_SYSTEMS: tuple[str, ...] = ("a100_sxm", "h100_sxm", "h200_sxm", "l40s", "rtx_pro_6000_server")

BACKENDS: tuple[str, ...] = ("vllm", "sglang", "trtllm")

#: When a backend lacks a table, try these backends next (closest kernel stacks first).
BACKEND_FALLBACK: dict[str, tuple[str, ...]] = {
    "vllm": ("vllm", "sglang", "trtllm"),
    "sglang": ("sglang", "vllm", "trtllm"),
    "trtllm": ("trtllm", "vllm", "sglang"),
}


class PerfDataError(RuntimeError):
    """The measured data needed for a lookup is missing."""


@cache
def package_version() -> str:
    try:
        return importlib.metadata.version("aiconfigurator-core")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - the wheel is a hard dependency
        return "unknown"


@cache
def systems_dir() -> Path:
    try:
        import aiconfigurator_core
    except ImportError as exc:  # pragma: no cover
        raise PerfDataError(
            "aiconfigurator-core is not installed; koi.perf needs its measured tables"
        ) from exc
    root = Path(aiconfigurator_core.__file__).resolve().parent / "systems"
    if not root.is_dir():  # pragma: no cover
        raise PerfDataError(f"aiconfigurator-core has no systems/ directory at {root}")
    return root


def silicon_csv() -> Path:
    return systems_dir() / "silicon_sample.csv"


# ---- system spec yaml ----------------------------------------------------------------------
@dataclass(frozen=True)
class SystemSpec:
    """Figures of ``systems/<name>.yaml`` (SI units: bytes, bytes/s, FLOP/s, seconds)."""

    name: str
    mem_bw: float
    mem_capacity: float
    bf16_flops: float
    fp8_flops: float | None
    gpus_per_node: int
    intra_node_bw: float
    inter_node_bw: float
    pcie_bw: float
    other_mem: float
    nccl_mem: dict[int, float]
    nccl_version: str | None
    sm_version: int

    def nccl_reserve(self, tp: int) -> float:
        """NCCL buffer reserve for a TP group of ``tp`` GPUs (largest listed size not above tp)."""
        if tp <= 1 or not self.nccl_mem:
            return 0.0
        keys = sorted(self.nccl_mem)
        below = [k for k in keys if k <= tp]
        return float(self.nccl_mem[below[-1] if below else keys[0]])


@cache
def system_spec(name: str) -> SystemSpec:
    path = systems_dir() / f"{name}.yaml"
    if not path.is_file():
        raise PerfDataError(f"aiconfigurator-core has no system spec {name!r} ({path})")
    raw: dict[str, Any] = yaml.safe_load(path.read_text(encoding="utf-8"))
    gpu, node, misc = raw.get("gpu", {}), raw.get("node", {}), raw.get("misc", {}) or {}
    return SystemSpec(
        name=name,
        mem_bw=float(gpu["mem_bw"]),
        mem_capacity=float(gpu["mem_capacity"]),
        bf16_flops=float(gpu["bfloat16_tc_flops"]),
        fp8_flops=float(gpu["fp8_tc_flops"]) if gpu.get("fp8_tc_flops") else None,
        gpus_per_node=int(node.get("num_gpus_per_node", 8)),
        intra_node_bw=float(node["intra_node_bw"]),
        inter_node_bw=float(node["inter_node_bw"]),
        pcie_bw=float(node.get("pcie_bw", node["intra_node_bw"])),
        other_mem=float(misc.get("other_mem", 0.0)),
        nccl_mem={int(k): float(v) for k, v in (misc.get("nccl_mem") or {}).items()},
        nccl_version=str(misc["nccl_version"]) if misc.get("nccl_version") else None,
        sm_version=int(gpu.get("sm_version", 0) or 0),
    )


# ---- versions ----------------------------------------------------------------------------------
_VERSION_RE = re.compile(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?(?:\.?(rc|post|dev)\.?(\d+))?")


def version_key(v: str) -> tuple[float, float, float, float]:
    """A sortable key: release numbers, then rc < final < post."""
    m = _VERSION_RE.match(v.strip().lstrip("v"))
    if not m:
        return (0.0, 0.0, 0.0, 0.0)
    major, minor, patch = (float(x) if x else 0.0 for x in m.group(1, 2, 3))
    tag, num = m.group(4), float(m.group(5) or 0)
    extra = {"rc": -1000.0 + num, "dev": -2000.0 + num, "post": num}.get(tag or "", 0.0)
    return (major, minor, patch, extra)


def _version_distance(a: str, b: str) -> float:
    ka, kb = version_key(a), version_key(b)
    return (
        abs(ka[0] - kb[0]) * 1e6 + abs(ka[1] - kb[1]) * 1e3 + abs(ka[2] - kb[2]) + abs(ka[3] - kb[3]) * 1e-4
    )


def nearest_version(available: list[str], wanted: str | None) -> str:
    """The available version closest to ``wanted`` (ties: the older); the newest when ``wanted`` is None."""
    if not available:
        raise PerfDataError("no versions available")
    ordered = sorted(available, key=version_key)
    if not wanted or not _VERSION_RE.match(wanted.strip().lstrip("v")):
        return ordered[-1]
    return min(ordered, key=lambda v: (_version_distance(v, wanted), version_key(v)))


def _usable(version_dir: Path, filename: str) -> bool:
    # A legacy INCOMPLETE.txt without a structured sidecar marks the whole directory unusable.
    if (version_dir / "INCOMPLETE.txt").is_file() and not (version_dir / "collection_meta.yaml").is_file():
        return False
    return (version_dir / filename).is_file()


def table_versions(system: str, family: str, backend: str, filename: str) -> list[str]:
    """Measured versions of one table, oldest first (the installed package's files never change
    while the process runs, so the directory walk is done once per key)."""
    return list(_table_versions(system, family, backend, filename))


@cache
def _table_versions(system: str, family: str, backend: str, filename: str) -> tuple[str, ...]:
    base = systems_dir() / "data" / system / family / backend
    if not base.is_dir():
        return ()
    return tuple(sorted((d.name for d in base.iterdir() if d.is_dir() and _usable(d, filename)), key=version_key))


@dataclass(frozen=True)
class TableRef:
    """One resolved parquet file and how it was chosen."""

    system: str
    family: str
    backend: str
    version: str
    path: Path
    requested_backend: str

    @property
    def fallback(self) -> bool:
        return self.backend != self.requested_backend


def resolve_table(
    system: str, family: str, backend: str, filename: str, version: str | None = None
) -> TableRef | None:
    """The table for (system, backend) at the nearest version; another backend's when this one has none."""
    for b in BACKEND_FALLBACK.get(backend, (backend,)):
        versions = table_versions(system, family, b, filename)
        if versions:
            v = nearest_version(versions, version if b == backend else None)
            return TableRef(
                system, family, b, v, systems_dir() / "data" / system / family / b / v / filename, backend
            )
    return None


def resolve_nccl(system: str) -> TableRef | None:
    spec = system_spec(system)
    versions = table_versions(system, "comm", "nccl", "nccl_perf.parquet")
    if not versions:
        return None
    v = nearest_version(versions, spec.nccl_version)
    return TableRef(
        system,
        "comm",
        "nccl",
        v,
        systems_dir() / "data" / system / "comm" / "nccl" / v / "nccl_perf.parquet",
        "nccl",
    )
