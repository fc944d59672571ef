"""Per-GPU memory of a chain: weights, workspace reserve, KV cache capacity, feasibility.

Rules chosen where engines leave room (all as vLLM does them, since vLLM is Koi's default):

- **TP and heads.** ``tp`` must divide the attention heads. KV heads shard when ``tp``
  divides them and *replicate* when ``tp`` exceeds them and is a multiple of them (vLLM
  replicates KV heads, e.g. 8 KV heads at tp=16 keep one KV head per GPU, each stored on
  two GPUs). Any other combination is infeasible. ``tp`` must also divide the FFN width
  (dense) or the expert width across the expert-TP group (MoE).
- **PP and layers.** Uneven splits are allowed (vLLM's default partition): the first
  ``L mod pp`` stages take one extra layer; the bottleneck stage sets time and memory.
  ``pp`` may not exceed the layer count.
- **EP (MoE).** ``ep`` must be 1 for a dense model and divide ``num_experts`` for an MoE.
  With ``ep > 1`` the expert group spans the TP × DP ranks (vLLM's expert parallelism):
  each GPU holds ``num_experts / ep`` experts, each split ``moe_tp = tp·dp/ep`` ways;
  with ``ep = 1`` experts are TP-sharded like dense FFNs.
- **Dtypes.** Linear layers take the weight dtype; embeddings and LM head stay bf16 (fp8
  and int4 checkpoints keep them unquantized). fp8 weights on a GPU without fp8 tensor
  cores run weight-only (Marlin W8A16), so they are feasible.
- **Budget.** vLLM caps the engine at ``gpu_mem_util`` × VRAM and KV bytes = budget −
  weights − activation peak − reserve, where the reserve is the aiconfigurator system yaml's
  measured basis: ``other_mem`` (CUDA context, graphs, allocator slack: 3.5 GiB) plus
  ``nccl_mem[tp]``. TRT-LLM gives the KV cache ``gpu_mem_util`` of the memory *free* after
  weights, activations and reserve (``kv_cache_free_gpu_mem_fraction``). SGLang's
  ``mem_fraction_static`` is the static pool itself: KV = fraction × VRAM − weights (its
  activations and graphs live in the rest).
- **VRAM.** The aiconfigurator ``mem_capacity`` (exact bytes) for profiled GPUs; the
  catalog's marketed ``memory_gb`` × 1e9 otherwise (conservative by up to 7%).
- **Tied embeddings** are inferred: a model whose ``params_b`` is closer to the shape's
  count with one vocab matrix than with two has tied input/output embeddings.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from koi.domain import ChainConfig, DType, GpuSpec, ModelArch
from koi.perf.aic import system_spec

GIB = 1024**3


# ---- parallel layout ------------------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    """How one model copy is cut across GPUs (per DP rank)."""

    tp: int
    pp: int
    dp: int
    ep: int
    heads_per_gpu: int
    kv_heads_per_gpu: int
    stage_layers: tuple[int, ...]
    moe_tp: int
    experts_per_gpu: int

    @property
    def max_stage_layers(self) -> int:
        return max(self.stage_layers)


def stage_layers(num_layers: int, pp: int) -> tuple[int, ...]:
    base, extra = divmod(num_layers, pp)
    return tuple(base + (1 if i < extra else 0) for i in range(pp))


def layout_reasons(model: ModelArch, config: ChainConfig) -> list[str]:
    """Why the parallel shape is impossible for this model (empty when it is possible)."""
    tp, pp, ep, dp = config.tp, config.pp, config.ep, config.dp
    out: list[str] = []
    if model.num_heads % tp:
        out.append(f"tp={tp} does not divide the {model.num_heads} attention heads of {model.name}")
    kv = model.num_kv_heads
    if tp <= kv and kv % tp:
        out.append(f"tp={tp} does not divide the {kv} KV heads of {model.name}")
    if tp > kv and tp % kv:
        out.append(f"tp={tp} is neither a divisor nor a multiple of the {kv} KV heads of {model.name}")
    if pp > model.num_layers:
        out.append(f"pp={pp} exceeds the {model.num_layers} layers of {model.name}")
    if model.is_moe:
        if model.num_experts % ep:
            out.append(f"ep={ep} does not divide the {model.num_experts} experts of {model.name}")
        moe_tp = tp if ep == 1 else max(1, (tp * dp) // ep)
        if model.moe_intermediate_size % moe_tp:
            out.append(
                f"expert width {model.moe_intermediate_size} is not divisible by the expert TP size {moe_tp}"
            )
    else:
        if ep > 1:
            out.append(f"ep={ep} needs an MoE model; {model.name} is dense")
        if model.intermediate_size % tp:
            out.append(f"tp={tp} does not divide the FFN width {model.intermediate_size} of {model.name}")
    return out


def layout(model: ModelArch, config: ChainConfig) -> Layout:
    tp, ep, dp = config.tp, config.ep, config.dp
    moe_tp = tp if ep == 1 else max(1, (tp * dp) // ep)
    return Layout(
        tp=tp,
        pp=config.pp,
        dp=dp,
        ep=ep,
        heads_per_gpu=max(1, model.num_heads // tp),
        kv_heads_per_gpu=max(1, model.num_kv_heads // tp),
        stage_layers=stage_layers(model.num_layers, min(config.pp, model.num_layers)),
        moe_tp=moe_tp,
        experts_per_gpu=max(1, model.num_experts // ep) if model.is_moe else 0,
    )


# ---- parameter counts -------------------------------------------------------------------------------
def _attn_params(m: ModelArch) -> float:
    return (
        m.hidden_size * (m.num_heads + 2 * m.num_kv_heads) * m.head_dim
        + m.num_heads * m.head_dim * m.hidden_size
    )


def _ffn_params(m: ModelArch) -> float:
    if m.is_moe:
        shared = m.num_shared_experts * 3 * m.hidden_size * m.moe_intermediate_size
        return (
            m.num_experts * 3 * m.hidden_size * m.moe_intermediate_size
            + m.hidden_size * m.num_experts
            + shared
        )
    return 3 * m.hidden_size * m.intermediate_size


def tied_embeddings(m: ModelArch) -> bool:
    body = m.num_layers * (_attn_params(m) + _ffn_params(m) + 2 * m.hidden_size)
    vh = m.vocab_size * m.hidden_size
    p = m.params_b * 1e9
    return abs(p - (body + vh)) < abs(p - (body + 2 * vh))


def weight_bytes_per_gpu(model: ModelArch, config: ChainConfig) -> tuple[float, ...]:
    """Weight bytes on one GPU of each pipeline stage (one entry per stage)."""
    lay = layout(model, config)
    wb = config.weight_dtype.bytes
    h, d = model.hidden_size, model.head_dim
    attn = (h * lay.heads_per_gpu * d * 2 + h * 2 * lay.kv_heads_per_gpu * d) * wb
    if model.is_moe:
        expert = 3 * h * model.moe_intermediate_size / lay.moe_tp
        ffn = lay.experts_per_gpu * expert * wb + h * model.num_experts * 2.0
        ffn += model.num_shared_experts * 3 * h * model.moe_intermediate_size / lay.tp * wb
    else:
        ffn = 3 * h * model.intermediate_size / lay.tp * wb
    per_layer = attn + ffn + 2 * h * 2.0  # + two norms in bf16
    emb = model.vocab_size * h / lay.tp * DType.BF16.bytes
    tied = tied_embeddings(model)
    out = []
    for i, n in enumerate(lay.stage_layers):
        w = n * per_layer
        if i == 0:
            w += emb
        if i == len(lay.stage_layers) - 1 and not (tied and len(lay.stage_layers) == 1):
            w += emb + h * 2.0  # LM head (+ final norm)
        out.append(w)
    return tuple(out)


def kv_bytes_per_token_per_gpu(model: ModelArch, config: ChainConfig) -> tuple[float, ...]:
    """KV bytes one token occupies on one GPU of each stage (its layers, its KV heads)."""
    lay = layout(model, config)
    per_layer = 2.0 * lay.kv_heads_per_gpu * model.head_dim * config.kv_cache_dtype.bytes
    return tuple(n * per_layer for n in lay.stage_layers)


def activation_bytes(model: ModelArch, config: ChainConfig) -> float:
    """Peak activation workspace of one forward at ``max_num_batched_tokens`` plus the sampler.

    Live tensors at the FFN: residual and normed hidden states (2h), the gate/up output and
    the activated half (3·I per GPU); attention's QKV output is narrower. The sampler holds
    fp32 logits and probabilities for ``max_num_seqs`` rows of the (TP-gathered) vocabulary.
    """
    lay = layout(model, config)
    if model.is_moe:
        width = model.num_experts_active * model.moe_intermediate_size / lay.moe_tp
    else:
        width = model.intermediate_size / lay.tp
    tokens = config.max_num_batched_tokens
    act = tokens * (2 * model.hidden_size + 3 * width) * 2.0
    sampler = min(config.max_num_seqs, tokens) * model.vocab_size * 4.0 * 2
    return act + sampler


def vram_bytes(gpu: GpuSpec) -> float:
    if gpu.aic_system:
        try:
            return system_spec(gpu.aic_system).mem_capacity
        except Exception:  # no yaml for that system: fall back to the catalog
            pass
    return gpu.memory_gb * 1e9


def reserve_bytes(gpu: GpuSpec, tp: int) -> float:
    """other_mem + nccl_mem[tp] of the aiconfigurator system describing ``gpu``."""
    from koi.perf.gpu_scale import perf_source

    spec = system_spec(perf_source(gpu).system)
    return spec.other_mem + spec.nccl_reserve(tp)


# ---- the plan -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryPlan:
    """Memory of one GPU (the bottleneck stage) and the KV capacity of one model copy."""

    vram_bytes: float
    budget_bytes: float
    weight_bytes: float
    activation_bytes: float
    reserve_bytes: float
    kv_bytes: float
    kv_bytes_per_token: float
    kv_capacity_tokens: int
    kv_capacity_blocks: int
    block_size: int
    reasons: tuple[str, ...] = field(default=())

    @property
    def feasible(self) -> bool:
        return not self.reasons

    @property
    def weight_fraction(self) -> float:
        return self.weight_bytes / self.vram_bytes

    def summary(self) -> dict[str, float | int | bool | list[str]]:
        g = 1e9
        return {
            "vram_gb": self.vram_bytes / g,
            "budget_gb": self.budget_bytes / g,
            "weights_gb": self.weight_bytes / g,
            "activation_gb": self.activation_bytes / g,
            "reserve_gb": self.reserve_bytes / g,
            "kv_gb": self.kv_bytes / g,
            "kv_capacity_tokens": self.kv_capacity_tokens,
            "feasible": self.feasible,
            "reasons": list(self.reasons),
        }


class InfeasibleConfig(ValueError):
    """A chain that cannot run; ``reasons`` names every violated rule."""

    def __init__(self, reasons: list[str] | tuple[str, ...]):
        self.reasons = tuple(reasons)
        super().__init__("; ".join(self.reasons))


def memory_plan(model: ModelArch, gpu: GpuSpec, config: ChainConfig, *, min_kv_tokens: int = 0) -> MemoryPlan:
    """Weights, reserve and KV capacity of ``config`` on ``gpu``; ``reasons`` lists what makes it infeasible.

    ``min_kv_tokens``: the KV cache must hold at least this many tokens (e.g. one request of the
    workload's longest length) for the engine to start.
    """
    reasons = layout_reasons(model, config)
    if reasons:
        # Shapes below assume a valid layout; report the layout problems alone.
        return MemoryPlan(gpu_vram := vram_bytes(gpu), gpu_vram * config.gpu_mem_util, 0, 0, 0, 0, 0, 0, 0,
                          config.block_size, tuple(reasons))  # fmt: skip
    vram = vram_bytes(gpu)
    weights = weight_bytes_per_gpu(model, config)
    kv_tok = kv_bytes_per_token_per_gpu(model, config)
    act = activation_bytes(model, config)
    reserve = reserve_bytes(gpu, config.tp)
    if config.engine_name == "trtllm":
        budget = vram
        free = [vram - w - act - reserve for w in weights]
        kv_per_stage = [max(f, 0.0) * config.gpu_mem_util for f in free]
    elif config.engine_name == "sglang":
        # mem_fraction_static covers the static pool (weights + KV); activations, CUDA graphs
        # and NCCL buffers live in the remaining (1 - fraction) of the GPU.
        budget = vram * config.gpu_mem_util
        kv_per_stage = [budget - w for w in weights]
    else:
        budget = vram * config.gpu_mem_util
        kv_per_stage = [budget - w - act - reserve for w in weights]
    caps = [kv / t if t > 0 else 0.0 for kv, t in zip(kv_per_stage, kv_tok, strict=True)]
    stage = min(range(len(caps)), key=lambda i: caps[i])
    kv_bytes = kv_per_stage[stage]
    blocks = max(int(caps[stage] // config.block_size), 0) if kv_bytes > 0 else 0
    tokens = blocks * config.block_size
    if kv_bytes <= 0 or blocks == 0:
        need = weights[stage] + act + reserve
        reasons.append(
            f"{model.name} does not fit: {need / 1e9:.1f} GB per GPU of weights "
            f"({weights[stage] / 1e9:.1f}), activations and reserve exceed the "
            f"{(budget if config.engine_name != 'trtllm' else vram) / 1e9:.1f} GB usable on {gpu.name} "
            f"(tp={config.tp}, pp={config.pp}, {config.weight_dtype.value} weights)"
        )
    elif tokens < min_kv_tokens:
        reasons.append(
            f"the KV cache of {model.name} on {gpu.name} holds {tokens} tokens, fewer than the {min_kv_tokens} required"
        )
    return MemoryPlan(
        vram_bytes=vram,
        budget_bytes=budget,
        weight_bytes=weights[stage],
        activation_bytes=act,
        reserve_bytes=reserve,
        kv_bytes=max(kv_bytes, 0.0),
        kv_bytes_per_token=kv_tok[stage],
        kv_capacity_tokens=tokens,
        kv_capacity_blocks=blocks,
        block_size=config.block_size,
        reasons=tuple(reasons),
    )


def check_feasible(
    model: ModelArch, gpu: GpuSpec, config: ChainConfig, *, min_kv_tokens: int = 0
) -> MemoryPlan:
    """:func:`memory_plan`, raising :class:`InfeasibleConfig` naming every reason when infeasible."""
    plan = memory_plan(model, gpu, config, min_kv_tokens=min_kv_tokens)
    if not plan.feasible:
        raise InfeasibleConfig(plan.reasons)
    return plan
