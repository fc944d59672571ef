"""GPUs without measured tables borrow the nearest profiled GPU's, rescaled by spec ratios.

Profiled GPUs are those whose catalog entry names an aiconfigurator system with measured
operator tables (A100-80GB, H100, H200, L40S, RTX-PRO-6000). Any other GPU (A10G, L4,
A100-40GB, MI300X) uses the **nearest** profiled GPU, where nearness is

    d(a, b) = |ln(bw_a / bw_b)| + |ln(bf16_tflops_a / bf16_tflops_b)|
              + 0.5 · [interconnect classes differ (NVLink-like vs PCIe)]
              + 2.0 · [vendors differ]

(memory bandwidth and tensor throughput set the two roofline regimes; the link class sets
how collectives behave; a same-vendor reference shares kernels). This picks A10G → L40S,
L4 → L40S, A100-40GB → A100-80GB, MI300X → H200.

The borrowed latencies are rescaled per operator by a roofline blend: an operator of
compute time C and memory time M on the reference (both from the reference's *measured*
peak rates) takes ``t · (C·r_c + M·r_m) / (C + M)`` on the target, with
``r_c = flops_ref / flops_target`` (bf16, or fp8 for fp8 kernels) and
``r_m = bw_ref / bw_target``. Prefill attention is compute-bound (``r_c``), decode
attention memory-bound (``r_m``). Collectives are rescaled by the step model from the
*instance's* link bandwidth against the reference system's measured link (that applies to
profiled GPUs on a different link too). The result carries ``rescaled_from``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache, cached_property

import numpy as np

from koi.domain import GpuSpec, Interconnect
from koi.perf.aic import PROFILED_SYSTEMS, PerfDataError, system_spec, table_versions
from koi.perf.tables import OpTables, load_tables

_NVLINK_LIKE = (Interconnect.NVLINK, Interconnect.INFINITY_FABRIC)


def _catalog_gpus() -> dict[str, GpuSpec]:
    from koi.catalog import gpus

    return gpus()


def resolve_gpu(gpu: GpuSpec | str) -> GpuSpec:
    if isinstance(gpu, GpuSpec):
        return gpu
    from koi.catalog import gpu as catalog_gpu

    return catalog_gpu(gpu)


def _has_tables(system: str | None) -> bool:
    return (
        bool(system)
        and system in PROFILED_SYSTEMS
        and bool(
            table_versions(system, "gemm", "vllm", "gemm_perf.parquet")
            or table_versions(system, "gemm", "trtllm", "gemm_perf.parquet")
            or table_versions(system, "gemm", "sglang", "gemm_perf.parquet")
        )
    )


@cache
def _profiled() -> dict[str, GpuSpec]:
    return {name: g for name, g in _catalog_gpus().items() if _has_tables(g.aic_system)}


def profiled_gpus() -> dict[str, GpuSpec]:
    """Catalog GPUs whose operators are measured (name -> spec)."""
    return dict(_profiled())


def gpu_distance(a: GpuSpec, b: GpuSpec) -> float:
    d = abs(math.log(a.mem_bw_gbs / b.mem_bw_gbs)) + abs(math.log(a.bf16_tflops / b.bf16_tflops))
    if (a.interconnect in _NVLINK_LIKE) != (b.interconnect in _NVLINK_LIKE):
        d += 0.5
    if a.vendor.lower() != b.vendor.lower():
        d += 2.0
    return d


def nearest_profiled(gpu: GpuSpec) -> GpuSpec:
    """The profiled GPU whose tables stand in for ``gpu`` (itself when it is profiled)."""
    if _has_tables(gpu.aic_system):
        return gpu
    prof = _profiled()
    if not prof:
        raise PerfDataError("no profiled GPU in the catalog has measured tables")
    return min(prof.values(), key=lambda r: (gpu_distance(gpu, r), r.name))


@dataclass(frozen=True)
class PerfSource:
    """Which measured tables describe a GPU, and the spec ratios applied to them."""

    gpu: str
    system: str
    reference_gpu: str
    rescaled_from: str | None
    compute_ratio: float  # time multiplier for bf16 compute-bound work (flops_ref / flops_target)
    compute_ratio_fp8: float
    memory_ratio: float  # time multiplier for memory-bound work (bw_ref / bw_target)

    @property
    def rescaled(self) -> bool:
        return self.rescaled_from is not None


def perf_source(gpu: GpuSpec | str) -> PerfSource:
    """Where ``gpu``'s operator latencies come from (measured, or rescaled from the nearest profiled GPU)."""
    return _source_for_spec(resolve_gpu(gpu))


class GpuTables:
    """Operator latencies for one GPU and backend: measured, or a profiled GPU's rescaled.

    Same lookups as :class:`~koi.perf.tables.OpTables` (seconds, numpy-broadcast); the
    collectives are the reference system's as measured (the step model rescales them by link).
    """

    def __init__(self, source: PerfSource, tables: OpTables):
        self.source = source
        self.tables = tables
        self.spec = system_spec(source.system)

    @property
    def rescaled_from(self) -> str | None:
        return self.source.rescaled_from

    @property
    def system(self) -> str:
        return self.source.system

    @cached_property
    def mem_bw(self) -> float:
        """Achieved bytes/s on the *target* GPU (the reference's measured rate, rescaled)."""
        return self.tables.achieved_mem_bw() / self.source.memory_ratio

    @cached_property
    def _ref_rates(self) -> tuple[float, float, float]:
        bw = self.tables.achieved_mem_bw() or self.spec.mem_bw
        f16 = self.tables.achieved_flops("bfloat16") or self.spec.bf16_flops
        f8 = self.tables.achieved_flops("fp8") or f16
        return bw, f16, f8

    def flops(self, dtype: str = "bfloat16") -> float:
        """Achieved FLOP/s on the target GPU."""
        bw, f16, f8 = self._ref_rates
        if dtype.startswith("fp8"):
            return f8 / self.source.compute_ratio_fp8
        return f16 / self.source.compute_ratio

    @cached_property
    def kernel_floor(self) -> float:
        return self.tables.kernel_floor()

    @cached_property
    def comm_floor(self) -> float:
        return self.tables.latency_floor()

    def _blend(self, flops, bytes_, fp8: bool = False) -> np.ndarray | float:
        if not self.source.rescaled:
            return 1.0
        bw, f16, f8 = self._ref_rates
        c = np.asarray(flops, float) / (f8 if fp8 else f16)
        m = np.asarray(bytes_, float) / bw
        rc = self.source.compute_ratio_fp8 if fp8 else self.source.compute_ratio
        return (c * rc + m * self.source.memory_ratio) / np.maximum(c + m, 1e-30)

    # ---- lookups ---------------------------------------------------------------------------------
    def has_gemm(self, dtype: str) -> bool:
        return self.tables.has_gemm(dtype)

    def gemm(self, m, n, k, dtype: str = "bfloat16") -> np.ndarray:
        t = self.tables.gemm(m, n, k, dtype)
        if self.source.rescaled:
            m_, n_, k_ = (np.asarray(x, float) for x in (m, n, k))
            wbytes = 1.0 if dtype.startswith("fp8") else 2.0
            t = t * self._blend(
                2 * m_ * n_ * k_, n_ * k_ * wbytes + m_ * k_ * wbytes + m_ * n_ * 2, dtype.startswith("fp8")
            )
        return t

    def context_attention_fn(self, heads: int, kv_heads: int, head_dim: int, kv_dtype: str = "bfloat16"):
        f = self.tables.context_attention_fn(heads, kv_heads, head_dim, kv_dtype)
        r = self.source.compute_ratio
        return f if not self.source.rescaled else (lambda b, s: f(b, s) * r)

    def generation_attention_fn(self, heads: int, kv_heads: int, head_dim: int, kv_dtype: str = "bfloat16"):
        f = self.tables.generation_attention_fn(heads, kv_heads, head_dim, kv_dtype)
        r = self.source.memory_ratio
        return f if not self.source.rescaled else (lambda b, c: f(b, c) * r)

    def context_attention(
        self, batch, isl, heads: int, kv_heads: int, head_dim: int, kv_dtype: str = "bfloat16"
    ):
        return np.asarray(self.context_attention_fn(heads, kv_heads, head_dim, kv_dtype)(batch, isl))

    def generation_attention(
        self, batch, context, heads: int, kv_heads: int, head_dim: int, kv_dtype: str = "bfloat16"
    ):
        return np.asarray(self.generation_attention_fn(heads, kv_heads, head_dim, kv_dtype)(batch, context))

    def has_moe(self) -> bool:
        return self.tables.has_moe()

    def moe_fn(self, hidden: int, inter: int, topk: int, experts: int, moe_tp: int = 1, moe_ep: int = 1,
               dtype: str = "bfloat16", distribution: str = "power_law_1.01"):  # fmt: skip
        f = self.tables.moe_fn(hidden, inter, topk, experts, moe_tp, moe_ep, dtype, distribution)
        if not self.source.rescaled:
            return f
        wbytes = 1.0 if dtype.startswith("fp8") else 2.0
        fp8 = dtype.startswith("fp8")

        def g(tokens):
            tok = np.asarray(tokens, float)
            touched = np.minimum(experts / moe_ep, tok * topk)
            flops = 2 * tok * topk * 3 * hidden * inter / (moe_tp * moe_ep)
            bytes_ = touched * 3 * hidden * inter / moe_tp * wbytes
            return f(tok) * self._blend(flops, bytes_, fp8)

        return g

    def moe(self, tokens, hidden: int, inter: int, topk: int, experts: int, moe_tp: int = 1, moe_ep: int = 1,
            dtype: str = "bfloat16", distribution: str = "power_law_1.01") -> np.ndarray:  # fmt: skip
        return np.asarray(
            self.moe_fn(hidden, inter, topk, experts, moe_tp, moe_ep, dtype, distribution)(tokens)
        )

    def nccl(self, op: str, elements, num_gpus: int, dtype: str = "half") -> np.ndarray:
        return self.tables.nccl(op, elements, num_gpus, dtype)

    def allreduce(self, elements, num_gpus: int, custom: bool = True) -> np.ndarray:
        if custom:
            return self.tables.allreduce(elements, num_gpus)
        return self.tables.nccl("all_reduce", elements, num_gpus)


@cache
def _gpu_tables(gpu_name: str, backend: str, version: str | None) -> GpuTables:
    src = perf_source(gpu_name)
    return GpuTables(src, load_tables(src.system, backend, version))


def gpu_tables(gpu: GpuSpec | str, backend: str = "vllm", version: str | None = None) -> GpuTables:
    """Tables for a catalog GPU (by name or spec) and engine backend, rescaled when unprofiled."""
    spec = resolve_gpu(gpu)
    catalog = _catalog_gpus()
    if spec.name in catalog and catalog[spec.name] == spec:
        return _gpu_tables(spec.name, backend, version)
    src = _source_for_spec(spec)  # an ad-hoc spec (tests, what-ifs): not cached by name
    return GpuTables(src, load_tables(src.system, backend, version))


def _source_for_spec(spec: GpuSpec) -> PerfSource:
    if _has_tables(spec.aic_system):
        return PerfSource(spec.name, str(spec.aic_system), spec.name, None, 1.0, 1.0, 1.0)
    ref = nearest_profiled(spec)
    rc = ref.bf16_tflops / spec.bf16_tflops
    rc8 = ref.fp8_tflops / spec.fp8_tflops if (ref.fp8_tflops and spec.fp8_tflops) else rc
    return PerfSource(
        spec.name, str(ref.aic_system), ref.name, ref.name, rc, rc8, ref.mem_bw_gbs / spec.mem_bw_gbs
    )
