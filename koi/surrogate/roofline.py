"""A plain roofline predictor: the anchor the surrogate is measured against.

The paper's digest: "A roofline model calibrated with measured peak compute and
bandwidth misses by up to 4.7×". This is that model, kept deliberately plain so
the comparison in ``koi surrogate eval`` is honest:

- the chain's GPUs are one device with ``N = tp · pp`` times the data-sheet dense
  FLOP/s (FP8 when the weights are FP8 and the GPU has it) and memory bandwidth;
- an operation takes ``max(FLOPs / peak, bytes / bandwidth)``; no kernel
  efficiency, no launch floor, no communication, no pipeline bubble, no scheduler;
- prefill of one prompt: 2 · active params · isl FLOPs plus causal attention
  (2 · layers · heads · head_dim · isl² FLOPs), reading the weights once;
- a decode step at batch b: 2 · active params · b FLOPs against reading the
  weights once plus every sequence's KV cache at its mean context isl + osl/2;
- TTFT is the prefill of one prompt (no queueing); TPOT is the decode step at the
  batch the load implies (closed loop: the concurrency; open loop: Little's law
  ``b = λ · osl · step(b)``, linear in b so closed-form). Capacity is the batch that
  fills the memory left after weights (or max_num_seqs) over osl steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from koi.domain.common import DType
from koi.domain.hardware import GpuSpec
from koi.domain.model import ModelArch


@dataclass(frozen=True, slots=True)
class RooflineResult:
    ttft_ms: np.ndarray
    tpot_ms: np.ndarray
    throughput_tps: np.ndarray
    capacity_rps: np.ndarray


def _peak_flops(gpu: GpuSpec, dtype: DType) -> float:
    if dtype in (DType.FP8, DType.INT8, DType.INT4, DType.FP4) and gpu.fp8_tflops:
        return gpu.fp8_tflops * 1e12
    return gpu.bf16_tflops * 1e12


def _terms(model: ModelArch, gpu: GpuSpec, n_gpu, dtype: DType, kv_dtype: DType):
    n = np.asarray(n_gpu, dtype=float)
    flops = _peak_flops(gpu, dtype) * n
    bw = gpu.mem_bw_gbs * 1e9 * n
    w_bytes = model.weight_bytes(dtype)
    kv_tok = model.kv_bytes_per_token(kv_dtype)
    p_act = model.active_params_b * 1e9
    attn = 2.0 * model.num_layers * model.num_heads * model.head_dim  # × isl² for causal prefill
    return flops, bw, w_bytes, kv_tok, p_act, attn


def prefill_s(model: ModelArch, gpu: GpuSpec, n_gpu, isl, dtype: DType, kv_dtype: DType) -> np.ndarray:
    flops, bw, w, _, p, attn = _terms(model, gpu, n_gpu, dtype, kv_dtype)
    isl = np.asarray(isl, dtype=float)
    return np.maximum((2.0 * p * isl + attn * isl**2) / flops, w / bw)


def decode_step_s(model: ModelArch, gpu: GpuSpec, n_gpu, batch, ctx, dtype: DType, kv_dtype: DType) -> np.ndarray:
    flops, bw, w, kv, p, attn = _terms(model, gpu, n_gpu, dtype, kv_dtype)
    b = np.asarray(batch, dtype=float)
    return np.maximum((2.0 * p * b + 2.0 * attn * b * ctx) / flops, (w + b * ctx * kv) / bw)


def closed_loop(
    model: ModelArch, gpu: GpuSpec, tp, pp, isl, osl, concurrency, dtype: DType = DType.BF16, kv_dtype: DType | None = None
) -> RooflineResult:
    """Mean TTFT/TPOT of ``concurrency`` clients (arrays broadcast)."""
    kvd = kv_dtype or dtype
    n = np.asarray(tp) * np.asarray(pp)
    isl, osl, c = (np.asarray(x, dtype=float) for x in (isl, osl, concurrency))
    ttft = prefill_s(model, gpu, n, isl, dtype, kvd)
    tpot = decode_step_s(model, gpu, n, c, isl + osl / 2.0, dtype, kvd)
    thr = c * osl / (ttft + osl * tpot)
    return RooflineResult(ttft * 1e3, tpot * 1e3, thr, thr / np.maximum(osl, 1.0))


def open_loop(
    model: ModelArch,
    gpu: GpuSpec,
    tp,
    pp,
    isl,
    osl,
    rate_rps,
    *,
    dtype: DType = DType.BF16,
    kv_dtype: DType | None = None,
    gpu_mem_util: float = 0.9,
    max_num_seqs: int = 256,
) -> RooflineResult:
    """TTFT/TPOT/throughput of one replica at an arrival rate (arrays broadcast)."""
    kvd = kv_dtype or dtype
    n = np.asarray(tp, dtype=float) * np.asarray(pp, dtype=float)
    isl, osl, lam = (np.asarray(x, dtype=float) for x in (isl, osl, rate_rps))
    ctx = isl + osl / 2.0
    flops, bw, w, kv, p, attn = _terms(model, gpu, n, dtype, kvd)
    free = np.maximum(n * gpu.memory_gb * 1e9 * gpu_mem_util - w, 0.0)
    b_max = np.clip(free / (ctx * kv), 0.0, max_num_seqs)
    # step(b) = a + s·b in whichever regime binds at b_max (linear pieces; take the max).
    a_mem, s_mem = w / bw, ctx * kv / bw
    s_cmp = (2.0 * p + 2.0 * attn * ctx) / flops
    step_max = np.maximum(a_mem + s_mem * b_max, s_cmp * b_max)
    cap = np.where(b_max >= 1.0, b_max / (osl * np.maximum(step_max, 1e-12)), 0.0)
    lam_s = np.minimum(lam, cap)
    # b = λ·osl·(a + s·b) → b = λ·osl·a / (1 - λ·osl·s), per regime; the binding one is the larger step.
    b_mem = lam_s * osl * a_mem / np.maximum(1.0 - lam_s * osl * s_mem, 1e-9)
    b_cmp = np.zeros_like(b_mem)
    b = np.clip(np.maximum(b_mem, b_cmp), 0.0, np.maximum(b_max, 1.0))
    tpot = decode_step_s(model, gpu, n, np.maximum(b, 1.0), ctx, dtype, kvd)
    ttft = prefill_s(model, gpu, n, isl, dtype, kvd)
    return RooflineResult(ttft * 1e3, tpot * 1e3, lam_s * osl, cap)
