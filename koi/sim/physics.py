"""The thin adapter from koi/perf to the replica engine: feasibility, memory, and step-time tables.

Nothing here invents a latency: every second comes from koi/perf's step model
(measured operator tables, rescaled for GPUs without tables) and every byte of
memory from koi/perf's memory model. What this module adds is *sampling*: the step
model is evaluated once per rank on the fixed grids of :mod:`koi.sim.tables`, so the
engine's hot loop only interpolates.

Choices made here (where the issue is vague):
- **max_model_len**: an operator sets it to what the workload needs, so a chain must
  hold ``min(model context, longest input + longest output)`` tokens of KV cache to
  start (vLLM refuses to start otherwise); that is the ``min_kv_tokens`` feasibility rule.
- **Instances**: a chain of ``g`` GPUs on instances of ``n`` GPUs packs ``⌊n/g⌋`` replicas
  per instance when ``g ≤ n``, and spans ``⌈g/n⌉`` instances otherwise (the step model
  then charges inter-node links); a rank owns whole instances.
- **Prefill work** of ``L`` prompt positions next to ``B`` decodes is the sum over its
  chunks (``max_num_batched_tokens − B`` tokens each, or the whole prompt without
  chunked prefill) of the step model's time with the chunk minus without it; each
  chunk's attention work counts the positions before it (``c·p + c(c+1)/2``).
- **Front end**: koi/perf's fitted per-request ``request_s`` (HTTP, tokenisation,
  streaming) delays each request's arrival at the engine's scheduler; it is part of TTFT.
- **Collective bytes** (``per_tok_comm_bytes``) are payload bytes handed to collectives
  per iteration: two all-reduces of ``tokens × hidden`` bf16 per layer under TP, the
  vocabulary all-gather of the sampled rows, and ``2 · tokens · hidden`` bf16 per
  pipeline boundary. It is an accounting of message sizes, not a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from koi import catalog
from koi.domain import ChainConfig, GpuSpec, InstanceType, Job, ModelArch
from koi.perf import Links, engine_overheads, memory_plan, step_model
from koi.sim.tables import B_AXIS, C_AXIS, L_AXIS, RankTables


def max_model_len(model: ModelArch, job: Job | None) -> int:
    if job is None:
        return model.max_context
    w = job.workload
    return int(min(model.max_context, w.input_len.max + w.output_len.max))


def instances_per_replica(config: ChainConfig, instance: InstanceType) -> tuple[int, int]:
    """(instances one replica spans, replicas one instance holds)."""
    g, n = config.gpus, instance.gpu_count
    if g <= n:
        return 1, n // g
    return math.ceil(g / n), 1


def check_chain(
    model: str | ModelArch, instance: InstanceType, config: ChainConfig, *, min_kv_tokens: int = 0
) -> str | None:
    """Why ``config`` of ``model`` cannot run on ``instance`` (None when it can)."""
    m = catalog.model(model) if isinstance(model, str) else model
    try:
        gpu = catalog.gpu(instance.gpu_type)
    except catalog.CatalogError as exc:
        return str(exc)
    if config.instance_type and config.instance_type != instance.name:
        return f"config names instance type {config.instance_type!r} but the pool is {instance.name!r}"
    plan = memory_plan(m, gpu, config, min_kv_tokens=min_kv_tokens)
    if not plan.feasible:
        return "; ".join(plan.reasons)
    return None


@dataclass(frozen=True)
class ChainSpec:
    """Everything that determines a rank's physics (hashable: tables are cached on it)."""

    model: str
    gpu: str
    instance_cloud: str
    instance_name: str
    interconnect: str
    gpus_per_instance: int
    config_json: str
    max_model_len: int
    gemm_mode: str | None = None  # override koi/perf's GEMM kernel choice (fidelity replays)


def chain_spec(
    model: str, instance: InstanceType, config: ChainConfig, max_len: int, gemm_mode: str | None = None
) -> ChainSpec:
    return ChainSpec(
        model=catalog.canonical_model(model),
        gpu=instance.gpu_type,
        instance_cloud=instance.cloud,
        instance_name=instance.name,
        interconnect=instance.interconnect.value,
        gpus_per_instance=instance.gpu_count,
        config_json=config.model_dump_json(),
        max_model_len=max_len,
        gemm_mode=gemm_mode,
    )


def _links(gpu: GpuSpec, spec: ChainSpec, config: ChainConfig) -> Links:
    nodes = max(1, math.ceil(config.tp * config.pp / spec.gpus_per_instance))
    return Links.of(gpu, interconnect=spec.interconnect, gpus_per_node=spec.gpus_per_instance, nodes=nodes)


@lru_cache(maxsize=512)
def rank_tables(spec: ChainSpec) -> RankTables:
    """Sample the step and memory models of one chain on the engine's grids."""
    with np.errstate(invalid="ignore", divide="ignore"):
        return _rank_tables(spec)


def _rank_tables(spec: ChainSpec) -> RankTables:
    model = catalog.model(spec.model)
    gpu = catalog.gpu(spec.gpu)
    config = ChainConfig.model_validate_json(spec.config_json)
    links = _links(gpu, spec, config)
    sm = step_model(model, gpu, config, links, gemm_mode=spec.gemm_mode)
    plan = memory_plan(model, gpu, config)

    # ---- decode iterations over (B, mean context) --------------------------------------------------
    Bg, Cg = np.meshgrid(np.maximum(B_AXIS, 1.0), C_AXIS, indexing="ij")
    bd = sm.breakdown(prefill_tokens=0, decode_seqs=Bg, decode_ctx_sum=Bg * Cg)
    dec_time = np.asarray(bd.total, float)
    dec_comm = np.asarray(bd.communication, float)
    dec_bub = np.asarray(bd.bubble_fraction, float)

    # ---- cumulative prefill work over (B, prompt position) --------------------------------------------
    budget = config.max_num_batched_tokens if config.chunked_prefill else 1 << 30
    nb, nl = len(B_AXIS), len(L_AXIS)
    pre_work = np.zeros((nb, nl))
    pre_comm = np.zeros((nb, nl))
    base = sm.breakdown(prefill_tokens=0, decode_seqs=np.maximum(B_AXIS, 1.0), decode_ctx_sum=np.maximum(B_AXIS, 1.0) * 1024)
    Lmax = float(L_AXIS[-1])
    for i, b in enumerate(B_AXIS):
        chunk = float(max(budget - b, 16)) if config.chunked_prefill else Lmax
        dec_sum = b * 1024.0  # decode attention is in the base iteration; its context cancels out
        nfull = int(min(Lmax // chunk, 4096))
        offs = np.arange(nfull) * chunk
        full = sm.breakdown(
            prefill_tokens=chunk, prefill_ctx_sum=chunk * offs + chunk * (chunk + 1) / 2, decode_seqs=b, decode_ctx_sum=dec_sum
        )
        bt, bc = float(base.total[i]), float(base.communication[i])
        fw = np.maximum(np.asarray(full.total, float) - bt, 0.0)
        fc = np.maximum(np.asarray(full.communication, float) - bc, 0.0)
        cw = np.concatenate([[0.0], np.cumsum(fw)])
        cc = np.concatenate([[0.0], np.cumsum(fc)])
        k = np.minimum((L_AXIS // chunk).astype(int), nfull)
        rem = L_AXIS - k * chunk
        off = k * chunk
        part = sm.breakdown(
            prefill_tokens=rem, prefill_ctx_sum=rem * off + rem * (rem + 1) / 2, decode_seqs=b, decode_ctx_sum=dec_sum
        )
        pw = np.where(rem > 0, np.maximum(np.asarray(part.total, float) - bt, 0.0), 0.0)
        pc = np.where(rem > 0, np.maximum(np.asarray(part.communication, float) - bc, 0.0), 0.0)
        pre_work[i] = np.maximum.accumulate(cw[k] + pw)
        pre_comm[i] = np.maximum.accumulate(cc[k] + pc)

    # ---- collective payload bytes ------------------------------------------------------------------------
    h = model.hidden_size
    tp, pp = config.tp, config.pp
    per_tok = 0.0
    if tp > 1:
        per_tok += 2 * model.num_layers * h * 2.0
    if pp > 1:
        per_tok += (pp - 1) * 2 * h * 2.0
    sample_bytes = model.vocab_size * 2.0 if tp > 1 else 0.0
    dec_comm_bytes = np.maximum(B_AXIS, 1.0) * (per_tok + sample_bytes)
    pre_comm_bytes = L_AXIS * per_tok

    vram = plan.vram_bytes
    static = plan.weight_bytes + plan.activation_bytes + plan.reserve_bytes
    return RankTables(
        dec_time=dec_time,
        dec_comm=dec_comm,
        dec_bubble=dec_bub,
        dec_comm_bytes=dec_comm_bytes,
        pre_work=pre_work,
        pre_comm=pre_comm,
        pre_comm_bytes=pre_comm_bytes,
        kv_blocks=int(plan.kv_capacity_blocks),
        block_size=int(config.block_size),
        max_seqs=int(config.max_num_seqs),
        budget=int(config.max_num_batched_tokens),
        chunked=bool(config.chunked_prefill),
        gpus=config.tp * config.pp,
        vram_bytes=float(vram),
        static_bytes=float(static),
        kv_bytes_per_token=float(plan.kv_bytes_per_token),
        policy={"vllm": 0, "trtllm": 1, "sglang": 2}[config.engine_name],
        request_s=float(getattr(engine_overheads(config.engine_name), "request_s", 0.0)),
        meta={
            "weight_bytes_per_gpu": float(plan.weight_bytes),
            "rescaled_from": sm.rescaled_from,
            "links": links.intra.value,
            "nodes": links.nodes,
        },
    )


def weight_load_s(tables: RankTables, load_gbps: float) -> float:
    """Seconds to load one GPU's weight shard at ``load_gbps`` (all GPUs of a replica load in parallel)."""
    return tables.meta["weight_bytes_per_gpu"] / (load_gbps * 1e9)
