"""The engine step model: seconds of one engine iteration for a batch composition.

One :class:`StepModel` is built per (model, GPU, chain config, links); building it
precomputes every operator curve from the measured tables, so evaluating it is a handful
of vectorised interpolations. Inputs are numpy arrays (one entry per iteration, replica or
candidate; they broadcast):

- ``prefill_tokens``   new prompt tokens computed this iteration (all prefill chunks);
- ``prefill_ctx_sum``  their attention work: Σ over prefill tokens of the context each
                       attends to (a chunk of c tokens after p cached ones adds
                       ``c·p + c(c+1)/2``); default: one fresh sequence, ``T(T+1)/2``;
- ``prefill_seqs``     sequences with a prefill chunk this iteration (default 1 if any);
- ``decode_seqs``      sequences decoding one token;
- ``decode_ctx_sum``   sum of their context lengths (cached tokens each attends to);
- ``microbatches``     micro-batches in flight when pp > 1 (default min(pp, sequences)).

What one iteration costs (per DP rank; a chain with dp > 1 runs dp such engines):

- per layer on one GPU: the GEMMs of QKV, O, gate/up and down at m = prefill + decode
  tokens with N and K divided by TP (MoE models: attention GEMMs, router, and the measured
  fused-MoE kernel for the layer's tokens), prefill attention from the context-attention
  table (batch = prefill sequences, length chosen so the table's causal work equals
  ``prefill_ctx_sum``), decode attention from the generation-attention table (batch =
  decode sequences at their mean context), and the element-wise kernels (norms,
  activation, RoPE/KV write) as measured launch floor + bytes / measured bandwidth;
- communication: two TP all-reduces per layer of ``tokens × hidden`` bf16 elements (the
  faster of the engine's custom all-reduce and NCCL where the engine would use it; NCCL
  only over PCIe beyond two GPUs), rescaled from the reference system's measured link to
  the instance's (``t = floor + (t_ref − floor) · bw_ref / bw``); TP spanning nodes adds
  a ring over the inter-node bandwidth; with pp > 1 each stage boundary sends hidden
  states and residual (``2 · tokens · hidden`` bf16) at the link's bandwidth; expert
  parallelism across DP ranks all-gathers and reduce-scatters the tokens;
- the LM head (logits only for sequences that sample this iteration) and the gather of
  vocabulary shards; sampling as memory traffic over fp32 logits;
- engine overheads (CPU scheduling, input preparation, sampling bookkeeping): the fitted
  constants of :mod:`koi.perf.overheads` for the engine (not guesses: see there);
- pipeline: stage ``s`` takes ``t_s``; one micro-batch's pass takes
  ``Σ t_s + (pp−1)·p2p``; with ``k`` micro-batches in flight an iteration (the period after
  which each sequence has its next token) is ``max(pass, k · max_s t_s)`` and the bubble
  fraction is ``1 − k·Σt_s / (pp · period)`` — ``(pp−1)/pp`` for one micro-batch, falling
  to ~0 once ``k ≥ pp`` (continuous pipelining as vLLM's virtual engines do it, not a
  GPipe flush).

Quantization: fp8 weights use the fp8 GEMM table (per-tensor scaled; the block-scaled
table when that is what there is); a GPU without fp8 tensor cores (or a table without
fp8) runs W8A16: the bf16 GEMM time × the roofline ratio max(C, M_w8)/max(C, M_bf16)
from the measured peak rates. int4/fp4 weights run W4A16 the same way. fp8 KV uses the
fp8 ``kv_cache_dtype`` attention rows.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import dataclass, field, fields
from functools import lru_cache

import numpy as np

from koi.domain import ChainConfig, DType, GpuSpec, Interconnect, ModelArch
from koi.perf.gpu_scale import GpuTables, gpu_tables, resolve_gpu
from koi.perf.memory import InfeasibleConfig, Layout, layout, layout_reasons, tied_embeddings
from koi.perf.overheads import EngineOverheads, engine_overheads

_NVLINK_LIKE = (Interconnect.NVLINK, Interconnect.INFINITY_FABRIC)
# Token-count grid on which the per-layer curves are precomputed (log-spaced, 1 … 2^21).
_M_GRID = np.unique(np.concatenate([np.arange(1, 33), np.round(np.geomspace(32, 2**21, 360))]))
_LOG_M = np.log(_M_GRID)


# ---- links ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Links:
    """The GPU links of one chain: the node's interconnect and how many nodes the chain spans."""

    intra: Interconnect
    intra_bw_gbs: float
    inter_bw_gbs: float
    gpus_per_node: int = 8
    nodes: int = 1

    @classmethod
    def of(
        cls,
        gpu: GpuSpec,
        *,
        interconnect: Interconnect | str | None = None,
        gpus_per_node: int | None = None,
        nodes: int = 1,
    ) -> Links:
        """Links of ``gpu`` in an instance with ``interconnect`` (default: the GPU's own).

        An NVLink-class GPU placed in a PCIe-only instance talks at its PCIe bandwidth.
        """
        ic = Interconnect(interconnect) if interconnect is not None else gpu.interconnect
        bw = gpu.intra_node_bw_gbs if ic in _NVLINK_LIKE else min(gpu.pcie_bw_gbs, gpu.intra_node_bw_gbs)
        return cls(ic, bw, gpu.inter_node_bw_gbs, gpus_per_node or 8, nodes)

    @classmethod
    def for_instance(cls, gpu: GpuSpec, instance, nodes: int = 1) -> Links:
        """Links of a catalog :class:`~koi.domain.InstanceType` (its interconnect and GPU count)."""
        return cls.of(gpu, interconnect=instance.interconnect, gpus_per_node=instance.gpu_count, nodes=nodes)


# ---- result ---------------------------------------------------------------------------------------
@dataclass
class StepBreakdown:
    """Seconds per iteration (arrays), by where the time goes; ``total`` is their sum."""

    total: np.ndarray
    gemm: np.ndarray
    attention: np.ndarray
    moe: np.ndarray
    elementwise: np.ndarray
    communication: np.ndarray
    pipeline_wait: np.ndarray
    overhead: np.ndarray
    bubble_fraction: np.ndarray
    prefill_attention: np.ndarray = field(repr=False)
    decode_attention: np.ndarray = field(repr=False)

    def as_dict(self) -> dict[str, np.ndarray]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def compute(self) -> np.ndarray:
        return self.gemm + self.attention + self.moe + self.elementwise


# ---- the model ------------------------------------------------------------------------------------
class StepModel:
    """Seconds of one engine iteration of ``model`` on ``gpu`` under ``config`` (vectorised)."""

    def __init__(
        self,
        model: ModelArch,
        gpu: GpuSpec | str,
        config: ChainConfig,
        links: Links | None = None,
        *,
        gemm_mode: str | None = None,
        overheads: EngineOverheads | None = None,
        version: str | None = None,
    ):
        gpu = resolve_gpu(gpu)
        reasons = layout_reasons(model, config)
        if reasons:
            raise InfeasibleConfig(reasons)
        self.model, self.gpu, self.config = model, gpu, config
        self.links = links or Links.of(gpu)
        self.tables: GpuTables = gpu_tables(gpu, config.engine_name, version or config.engine_version)
        self.layout: Layout = layout(model, config)
        self.overheads = overheads if overheads is not None else engine_overheads(config.engine_name)
        self.gemm_mode = gemm_mode or self._gemm_mode(config.weight_dtype)
        self.kv_mode = "fp8" if config.kv_cache_dtype in (DType.FP8,) else "bfloat16"
        self._build()

    # ---- metadata ----------------------------------------------------------------------------------
    @property
    def rescaled_from(self) -> str | None:
        return self.tables.rescaled_from

    def _gemm_mode(self, wd: DType) -> str:
        fp8_ok = self.gpu.supports_fp8
        if wd is DType.FP8 and fp8_ok:
            if self.tables.has_gemm("fp8"):
                return "fp8"
            if self.tables.has_gemm("fp8_block"):
                return "fp8_block"
        if wd in (DType.BF16, DType.FP16):
            return "bfloat16"
        return {DType.FP8: "w8a16", DType.INT8: "w8a16", DType.INT4: "w4a16", DType.FP4: "w4a16"}[wd]

    # ---- building the curves -----------------------------------------------------------------------
    def _gemm(self, m: np.ndarray, n: float, k: float, mode: str | None = None) -> np.ndarray:
        mode = mode or self.gemm_mode
        T = self.tables
        if mode in ("bfloat16", "fp8", "fp8_block"):
            return T.gemm(m, n, k, mode)
        # Weight-only quantization: bf16 GEMM scaled by the roofline ratio of its weight bytes.
        wbytes = 1.0 if mode == "w8a16" else 0.5
        t16 = T.gemm(m, n, k, "bfloat16")
        c = 2.0 * m * n * k / T.flops("bfloat16")
        act = (m * k + m * n) * 2.0
        mq = (n * k * wbytes + act) / T.mem_bw
        m16 = (n * k * 2.0 + act) / T.mem_bw
        return t16 * np.maximum(c, mq) / np.maximum(c, m16)

    def _link_scaled(self, t_ref: np.ndarray, floor: float) -> np.ndarray:
        ref_bw = self.tables.spec.intra_node_bw / 1e9
        ratio = ref_bw / self.links.intra_bw_gbs
        return floor + np.maximum(t_ref - floor, 0.0) * ratio

    def _allreduce(self, elements: np.ndarray, n: int) -> np.ndarray:
        """One bf16 all-reduce of ``elements`` over ``n`` TP ranks on this chain's links."""
        if n <= 1:
            return np.zeros_like(elements, dtype=float)
        T, L = self.tables, self.links
        per_node = min(n, L.gpus_per_node)
        nodes = int(np.ceil(n / max(per_node, 1)))
        # Engines use their own all-reduce kernel over NVLink (and between two PCIe GPUs).
        custom = L.intra in _NVLINK_LIKE or per_node <= 2
        ref_pcie = self.tables.spec.intra_node_bw <= self.tables.spec.pcie_bw * 1.01
        if ref_pcie and L.intra in _NVLINK_LIKE:
            custom = False  # a PCIe-measured custom kernel says nothing about NVLink
        if per_node > 1:
            t_ref = T.allreduce(elements, per_node, custom=custom)
            floor = float(np.min(T.allreduce(np.array([1.0]), per_node, custom=custom)))
            t = self._link_scaled(t_ref, floor)
        else:
            t = np.zeros_like(elements, dtype=float)
        if nodes > 1:
            bytes_ = elements * 2.0
            t = t + T.comm_floor * 2 + 2.0 * (nodes - 1) / nodes * bytes_ / (L.inter_bw_gbs * 1e9)
        return t

    def _build(self) -> None:
        m_, lay, T = self.model, self.layout, self.tables
        M = _M_GRID
        h, d = m_.hidden_size, m_.head_dim
        hg, kvg = lay.heads_per_gpu, lay.kv_heads_per_gpu
        floor = T.kernel_floor
        bw = T.mem_bw
        act_bytes = 2.0

        # Dense parts of a layer (attention projections; FFN for dense models).
        g = self._gemm(M, (hg + 2 * kvg) * d, h) + self._gemm(M, h, hg * d)
        moe = np.zeros_like(M, dtype=float)
        ew_width = 0.0
        if m_.is_moe:
            g = g + T.gemm(M, m_.num_experts, h, "bfloat16")  # router
            if m_.num_shared_experts:
                si = m_.num_shared_experts * m_.moe_intermediate_size / lay.tp
                g = g + self._gemm(M, 2 * si, h) + self._gemm(M, h, si)
            dtype = self._moe_dtype()
            dp_tokens = lay.dp if (lay.ep > 1 and lay.dp > 1) else 1
            f = T.moe_fn(
                h, m_.moe_intermediate_size, m_.num_experts_active, m_.num_experts, lay.moe_tp, lay.ep, dtype
            )
            moe = np.asarray(f(M * dp_tokens), dtype=float)
            ew_width = m_.num_experts_active * m_.moe_intermediate_size / lay.moe_tp
        else:
            inter = m_.intermediate_size / lay.tp
            g = g + self._gemm(M, 2 * inter, h) + self._gemm(M, h, inter)
            ew_width = inter
        # Element-wise kernels: two add+RMSNorm (read x and residual, write both), the gated
        # activation (read 2·I, write I), RoPE + KV-cache write over the QKV output.
        ew_bytes = M * (8 * h + 3 * ew_width + 2 * (hg + 2 * kvg) * d) * act_bytes
        ew = 4 * floor + ew_bytes / bw
        # TP communication: two all-reduces per layer of tokens × hidden.
        comm = 2 * self._allreduce(M * h, lay.tp)
        if m_.is_moe and lay.ep > 1 and lay.dp > 1:
            n = min(lay.ep, self.links.gpus_per_node)
            ag = T.nccl("all_gather", M * h * lay.dp, n) + T.nccl("reduce_scatter", M * h * lay.dp, n)
            comm = comm + self._link_scaled(ag, T.comm_floor)
        self._layer_gemm = np.log(np.maximum(g, 1e-12))
        self._layer_moe = np.log(np.maximum(moe, 1e-12)) if m_.is_moe else None
        self._layer_ew = np.log(ew)
        self._layer_comm = np.log(np.maximum(comm, 1e-12)) if lay.tp > 1 or m_.is_moe and lay.ep > 1 else None

        # LM head for the sampling sequences, vocabulary-shard gather, sampling traffic.
        vocab_local = m_.vocab_size / lay.tp
        lm = T.gemm(M, vocab_local, h, "bfloat16") + floor + M * m_.vocab_size * 4.0 * 2 / bw
        if lay.tp > 1:
            lm = lm + self._link_scaled(T.nccl("all_gather", M * m_.vocab_size, min(lay.tp, 8)), T.comm_floor)
        self._lm = np.log(lm)
        self._embed = np.log(floor + M * h * act_bytes / bw)
        # Pipeline hand-off: hidden states + residual between stages.
        if lay.pp > 1:
            # Stages fill nodes in order: of the pp - 1 boundaries, nodes - 1 cross the network.
            cross = min(lay.pp - 1, max(self.links.nodes - 1, 0))
            inside = lay.pp - 1 - cross
            msg = 2 * M * h * act_bytes
            p2p = inside * (T.comm_floor + msg / (self.links.intra_bw_gbs * 1e9))
            p2p = p2p + cross * (T.comm_floor + msg / (self.links.inter_bw_gbs * 1e9))
            self._p2p = np.log(p2p)  # all boundaries of one pass
        else:
            self._p2p = None

        # Attention surfaces for this per-GPU head shape.
        self._ctx = T.context_attention_fn(hg, kvg, d, self.kv_mode)
        self._gen = T.generation_attention_fn(hg, kvg, d, self.kv_mode)
        self.tied = tied_embeddings(m_)

    def _moe_dtype(self) -> str:
        wd = self.config.weight_dtype
        avail = {k[0] for k in self.tables.tables.moe_grids} if self.tables.has_moe() else set()
        if wd is DType.FP8 and self.gpu.supports_fp8:
            for cand in ("fp8", "fp8_block"):
                if cand in avail:
                    return cand
        if wd in (DType.INT4, DType.FP4):
            for cand in ("int4_wo", "w4a16_mxfp4"):
                if cand in avail:
                    return cand
        return "bfloat16"

    # ---- evaluation --------------------------------------------------------------------------------
    @staticmethod
    def _curve(logc: np.ndarray, m: np.ndarray) -> np.ndarray:
        lm = np.log(np.maximum(m, 1e-9))
        out = np.exp(np.interp(lm, _LOG_M, logc))
        # beyond the grid: linear in tokens
        big = m > _M_GRID[-1]
        if np.any(big):
            out = np.where(big, out * m / _M_GRID[-1], out)
        return np.where(m > 0, out, 0.0)

    def breakdown(
        self,
        prefill_tokens=0,
        prefill_ctx_sum=None,
        decode_seqs=0,
        decode_ctx_sum=0,
        prefill_seqs=None,
        microbatches=None,
        overheads: EngineOverheads | None = None,
    ) -> StepBreakdown:
        """Seconds of one iteration per entry of the (broadcast) inputs, with the breakdown."""
        tp_ = np.asarray(prefill_tokens, dtype=float)
        nd = np.asarray(decode_seqs, dtype=float)
        sd = np.asarray(decode_ctx_sum, dtype=float)
        pa = tp_ * (tp_ + 1) / 2 if prefill_ctx_sum is None else np.asarray(prefill_ctx_sum, dtype=float)
        npf = np.where(tp_ > 0, 1.0, 0.0) if prefill_seqs is None else np.asarray(prefill_seqs, dtype=float)
        tp_, nd, sd, pa, npf = np.broadcast_arrays(tp_, nd, sd, pa, npf)
        lay = self.layout
        pp = lay.pp
        seqs = nd + npf
        if microbatches is None:
            k = np.clip(np.minimum(pp, np.maximum(seqs, 1.0)), 1.0, None)
        else:
            k = np.clip(np.broadcast_to(np.asarray(microbatches, dtype=float), tp_.shape), 1.0, None)

        # One micro-batch: a 1/k share of the tokens and sequences.
        m = (tp_ + nd) / k
        gemm = self._curve(self._layer_gemm, m)
        ew = self._curve(self._layer_ew, m)
        moe = self._curve(self._layer_moe, m) if self._layer_moe is not None else np.zeros_like(m)
        comm = self._curve(self._layer_comm, m) if self._layer_comm is not None else np.zeros_like(m)

        has_p = npf > 0
        npf_safe = np.where(has_p, npf, 1.0)
        s_eq = np.sqrt(2.0 * np.maximum(pa, 1.0) / npf_safe)
        attn_p = np.where(has_p, np.asarray(self._ctx(npf_safe, s_eq)) / k, 0.0)
        has_d = nd > 0
        nd_safe = np.where(has_d, nd, 1.0)
        ctx_mean = np.maximum(sd / nd_safe, 1.0)
        attn_d = np.where(has_d, np.asarray(self._gen(np.maximum(nd_safe / k, 1.0), ctx_mean)), 0.0)
        attn_d = attn_d * np.where(nd_safe / k < 1.0, nd_safe / k, 1.0)

        per_layer = gemm + ew + moe + comm + attn_p + attn_d
        L = self.model.num_layers
        sample_seqs = seqs / k
        lm = self._curve(self._lm, sample_seqs)
        emb = self._curve(self._embed, m)
        stage_l = lay.stage_layers
        # Stage times (first carries the embedding, last the LM head).
        t_first = stage_l[0] * per_layer + emb
        t_last = stage_l[-1] * per_layer + lm if pp > 1 else t_first + lm
        t_max = np.maximum(np.maximum(t_first, t_last), lay.max_stage_layers * per_layer)
        busy = L * per_layer + emb + lm  # Σ_s t_s
        if pp > 1:
            p2p = self._curve(self._p2p, m)
            pass_t = busy + p2p
            period = np.maximum(pass_t, k * t_max)
            wait = period - pass_t
            bubble = np.clip(1.0 - k * busy / (pp * period), 0.0, 1.0)
        else:
            p2p = np.zeros_like(m)
            period = busy
            wait = np.zeros_like(m)
            bubble = np.zeros_like(m)

        o = self.overheads if overheads is None else overheads
        active = (tp_ + nd) > 0
        over = np.where(active, o.per_step_s + o.per_seq_s * seqs + o.per_prefill_token_s * tp_, 0.0)
        over = over + np.where(has_p, o.per_prefill_layer_s * lay.max_stage_layers, 0.0)
        total = np.where(active, period + over, 0.0)
        Lf = float(L)
        return StepBreakdown(
            total=total,
            gemm=Lf * gemm + np.where(active, lm, 0.0),
            attention=Lf * (attn_p + attn_d),
            moe=Lf * moe,
            elementwise=Lf * ew + emb,
            communication=Lf * comm + p2p,
            pipeline_wait=wait,
            overhead=over,
            bubble_fraction=bubble,
            prefill_attention=Lf * attn_p,
            decode_attention=Lf * attn_d,
        )

    def step_time(self, prefill_tokens=0, prefill_ctx_sum=None, decode_seqs=0, decode_ctx_sum=0,
                  prefill_seqs=None, microbatches=None, overheads: EngineOverheads | None = None) -> np.ndarray:  # fmt: skip
        """Seconds of one iteration (the ``total`` of :meth:`breakdown`)."""
        return self.breakdown(prefill_tokens, prefill_ctx_sum, decode_seqs, decode_ctx_sum, prefill_seqs,
                              microbatches, overheads).total  # fmt: skip

    def clock(self, overheads: EngineOverheads | None = None) -> StepClock:
        """A scalar-speed :meth:`step_time` for schedulers that need time while they schedule."""
        return StepClock(self, overheads)


class StepClock:
    """Seconds of one iteration from scalar inputs, fast enough to call once per scheduled iteration.

    Same cost model as :meth:`StepModel.breakdown` (pp = 1): every curve of the model is tabulated
    once with the vectorised model — the per-layer dense part (GEMMs, element-wise, MoE,
    all-reduces), LM head and embedding over tokens, prefill attention over (sequences, equivalent
    length), decode attention over (sequences, mean context) — and read back by (bi)linear
    interpolation in log space, which the grids' own log-log interpolation makes near-exact
    (within ~1%). Pipelines (pp > 1) are timed with the vectorised model itself, one call per
    iteration. Used by :mod:`koi.perf.replay` to place arrivals that depend on time; the replay's
    reported latencies always come from :meth:`StepModel.step_time`.
    """

    _NPF = np.array([1.0, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024])
    _LEN = np.geomspace(1.0, 2.0**21, 169)
    _NB = np.unique(np.round(np.geomspace(1.0, 8192.0, 90)))

    def __init__(self, sm: StepModel, overheads: EngineOverheads | None = None):
        self.sm = sm
        o = sm.overheads if overheads is None else overheads
        self.o = (
            o.per_step_s,
            o.per_seq_s,
            o.per_prefill_token_s,
            o.per_prefill_layer_s * sm.layout.max_stage_layers,
        )
        self.pp = sm.layout.pp
        if self.pp > 1:
            return
        M = _M_GRID
        dense = sum(
            sm._curve(c, M)
            for c in (sm._layer_gemm, sm._layer_ew, sm._layer_moe, sm._layer_comm)
            if c is not None
        )
        L = float(sm.model.num_layers)
        self._lm_ = _LOG_M.tolist()
        self._m_max = float(_M_GRID[-1])
        self._dense = np.log(L * dense).tolist()
        self._head = np.log(sm._curve(sm._lm, M)).tolist()
        self._emb = np.log(sm._curve(sm._embed, M)).tolist()
        ls = np.log(self._LEN).tolist()
        ctx = np.log(L * np.asarray(sm._ctx(self._NPF[:, None], self._LEN[None, :]), dtype=float))
        self._ctx = (np.log(self._NPF).tolist(), ls, ctx.tolist())
        gen = np.log(L * np.asarray(sm._gen(self._NB[:, None], self._LEN[None, :]), dtype=float))
        self._gen = (np.log(self._NB).tolist(), ls, gen.tolist())

    @staticmethod
    def _bilinear(tab: tuple[list, list, list], x: float, y: float) -> float:
        ax, ay, v = tab
        lx, ly = math.log(max(x, 1e-9)), math.log(max(y, 1e-9))
        i = min(max(bisect_right(ax, lx) - 1, 0), len(ax) - 2)
        j = min(max(bisect_right(ay, ly) - 1, 0), len(ay) - 2)
        fx = min(max((lx - ax[i]) / (ax[i + 1] - ax[i]), 0.0), 1.0)
        fy = min(max((ly - ay[j]) / (ay[j + 1] - ay[j]), 0.0), 1.0)
        r0, r1 = v[i], v[i + 1]
        r = (1 - fx) * ((1 - fy) * r0[j] + fy * r0[j + 1]) + fx * ((1 - fy) * r1[j] + fy * r1[j + 1])
        # beyond the largest tabulated value: linear in sequences, as the tables extrapolate sizes
        return math.exp(r) * (x / math.exp(ax[-1]) if lx > ax[-1] else 1.0)

    def _one(self, log_tab: list, m: float) -> float:
        if m <= 0:
            return 0.0
        lm, ax = math.log(m), self._lm_
        i = min(max(bisect_right(ax, lm) - 1, 0), len(ax) - 2)
        f = min(max((lm - ax[i]) / (ax[i + 1] - ax[i]), 0.0), 1.0)
        out = math.exp(log_tab[i] + f * (log_tab[i + 1] - log_tab[i]))
        return out * (m / self._m_max) if m > self._m_max else out

    def decode_run(self, decode_seqs: int, decode_ctx_sum: int, k: int) -> np.ndarray:
        """Seconds of ``k`` decode-only iterations of ``decode_seqs`` sequences, the j-th at context
        sum ``decode_ctx_sum + j · decode_seqs`` (vectorised)."""
        n = float(decode_seqs)
        ctx = decode_ctx_sum + n * np.arange(k, dtype=float)
        if self.pp > 1 or n <= 0:
            return np.asarray(self.sm.step_time(0, None, np.full(k, n), ctx, 0), dtype=float)
        base = self._one(self._dense, n) + self._one(self._emb, n) + self._one(self._head, n)
        ps, pq, _, _ = self.o
        base += ps + pq * n
        ax, ay, v = self._gen
        lx = math.log(n)
        i = min(max(bisect_right(ax, lx) - 1, 0), len(ax) - 2)
        fx = min(max((lx - ax[i]) / (ax[i + 1] - ax[i]), 0.0), 1.0)
        ly = np.log(np.maximum(ctx / n, 1.0))
        row = (1 - fx) * np.interp(ly, ay, v[i]) + fx * np.interp(ly, ay, v[i + 1])
        scale = n / math.exp(ax[-1]) if lx > ax[-1] else 1.0
        return base + np.exp(row) * scale

    def __call__(self, prefill_tokens: float, prefill_ctx_sum: float, prefill_seqs: float, decode_seqs: float,
                 decode_ctx_sum: float) -> float:  # fmt: skip
        """Seconds of one iteration (see :meth:`StepModel.breakdown` for the inputs)."""
        m = prefill_tokens + decode_seqs
        if m <= 0:
            return 0.0
        if self.pp > 1:
            return float(self.sm.step_time(np.array([prefill_tokens]), np.array([prefill_ctx_sum]),
                                           np.array([decode_seqs]), np.array([decode_ctx_sum]),
                                           np.array([prefill_seqs]))[0])  # fmt: skip
        t = (
            self._one(self._dense, m)
            + self._one(self._emb, m)
            + self._one(self._head, prefill_seqs + decode_seqs)
        )
        if prefill_seqs > 0:
            t += self._bilinear(
                self._ctx, prefill_seqs, math.sqrt(2.0 * max(prefill_ctx_sum, 1.0) / prefill_seqs)
            )
        if decode_seqs > 0:
            nb = max(decode_seqs, 1.0)
            t += self._bilinear(self._gen, nb, max(decode_ctx_sum / nb, 1.0))
        ps, pq, pt, pl = self.o
        t += ps + pq * (prefill_seqs + decode_seqs) + pt * prefill_tokens + (pl if prefill_seqs > 0 else 0.0)
        return t


#: Distinct step models a 3-hour hetero-3h run builds: ~920 (25 jobs × their chains' step knobs × GPU types).
#: At 256 entries the cache thrashed — a one-hour MILP run built 1,034 models for 791 distinct ones — and
#: each build costs ~4 ms; 2,048 holds a run's set (~35 MB) with room for the 12-hour scenarios' drift.
_STEP_MODELS = 2048


@lru_cache(maxsize=_STEP_MODELS)
def _cached(model_json: str, gpu_json: str, config_json: str, links: Links | None, gemm_mode: str | None,
            version: str | None) -> StepModel:  # fmt: skip
    return StepModel(
        ModelArch.model_validate_json(model_json),
        GpuSpec.model_validate_json(gpu_json),
        ChainConfig.model_validate_json(config_json),
        links,
        gemm_mode=gemm_mode,
        version=version,
    )


def step_model(
    model: ModelArch,
    gpu: GpuSpec | str,
    config: ChainConfig,
    links: Links | None = None,
    *,
    gemm_mode: str | None = None,
    version: str | None = None,
) -> StepModel:
    """A cached :class:`StepModel` (building one costs milliseconds; reuse it)."""
    g = resolve_gpu(gpu)
    return _cached(
        model.model_dump_json(), g.model_dump_json(), config.model_dump_json(), links, gemm_mode, version
    )


__all__ = ["Links", "StepBreakdown", "StepClock", "StepModel", "step_model"]
