"""Flat feature context of one rank: what mechanism scopes are evaluated on.

A mechanism's scope (whitepaper, "Mechanisms": ``workload_type``, ``model_type``,
``conditions``) is a predicate over knobs, workload, model and hardware. This module
builds that context once per (job, rank) so the validator (S2), the surrogate, the
simulator and the why-queries all read the same values.

Choices:
- Feature names are the registry's X names (``koi.variables``), valued from the job,
  the chain config, the model architecture and the environment; deferred variables
  are left out (no deployment exercises them).
- A few *derived* features, documented in :data:`DERIVED_FEATURES`, are functions of
  registered variables that the physics needs but the registry does not name
  (``interconnect``, ``gqa_ratio``, ``gpus_per_chain`` ...). They are scope predicates
  only, never graph nodes, so they invent no X/V/Y variable.
- ``num_nodes_per_chain`` comes from the instance's GPU count when known, else from an
  8-GPU node (the common NVLink domain).
- ``preemption_policy`` and ``router_policy`` are not in :class:`ChainConfig`; they take
  vLLM's defaults (``recompute``, ``round_robin``) unless the caller overrides them.
- Workload types are tags, not one label: a 16k-token summarisation job is both
  ``long_context`` and ``prefill_heavy``. Thresholds: ``long_context`` when the mean
  input ≥ 8192 tokens; ``prefill_heavy`` when input ≥ 4 × output; ``decode_heavy``
  when output ≥ input (short prompts, long generations, whitepaper "Background");
  ``balanced`` otherwise; ``shared_prefix`` when ≥ 20% of requests share a prefix.
"""

from __future__ import annotations

import math
from typing import Any

from koi import variables
from koi.domain.chain import ChainConfig, Rank
from koi.domain.common import Interconnect
from koi.domain.hardware import Environment, GpuSpec, InstanceType
from koi.domain.job import Job
from koi.domain.model import ModelArch

FeatureValue = bool | int | float | str | tuple[str, ...]

#: Derived scope features and what they mean.
DERIVED_FEATURES: dict[str, str] = {
    "interconnect": "peer link inside a node: nvlink | pcie | infinity_fabric (instance shape, else GPU spec)",
    "gqa_ratio": "attention heads per KV head (1 = MHA; ≥ 4 = strong GQA)",
    "gpus_per_chain": "tp · pp · dp",
    "model_type": "moe | dense_large (≥ 30B) | dense_small (ModelArch.model_type)",
    "job_class": "online | batch",
    "workload_types": "tags: long_context, prefill_heavy, decode_heavy, balanced, shared_prefix",
    "isl_osl_ratio": "mean input / mean output tokens",
    "gpu_memory_gb": "VRAM per GPU",
    "weight_gb_per_gpu": "weight bytes per GPU after TP/PP/EP sharding, GB",
    "mem_fit_ratio": "weight_gb_per_gpu / (gpu_memory_gb · gpu_mem_util): near 1 leaves no KV room",
}

WORKLOAD_TYPES: tuple[str, ...] = ("any", "long_context", "prefill_heavy", "decode_heavy", "balanced", "shared_prefix")
MODEL_TYPES: tuple[str, ...] = ("any", "dense_small", "dense_large", "moe")

LONG_CONTEXT_TOKENS = 8192
PREFILL_HEAVY_RATIO = 4.0
SHARED_PREFIX_MIN = 0.2
GPUS_PER_NODE_DEFAULT = 8


def feature_names() -> tuple[str, ...]:
    """Every name a scope condition may use: non-deferred X variables plus derived features."""
    xs = tuple(n for n in variables.X_NAMES if not variables.VARIABLES[n].deferred)
    return xs + tuple(DERIVED_FEATURES)


def workload_types(isl: float, osl: float, prefix_fraction: float = 0.0) -> tuple[str, ...]:
    tags: list[str] = []
    if isl >= LONG_CONTEXT_TOKENS:
        tags.append("long_context")
    if isl >= PREFILL_HEAVY_RATIO * osl:
        tags.append("prefill_heavy")
    elif osl >= isl:
        tags.append("decode_heavy")
    else:
        tags.append("balanced")
    if prefix_fraction >= SHARED_PREFIX_MIN:
        tags.append("shared_prefix")
    return tuple(tags)


def _gpu_spec(gpu_type: str) -> GpuSpec | None:
    try:
        from koi import catalog

        return catalog.gpu(gpu_type)
    except Exception:  # a GPU the catalog lacks still gets features, without hardware figures
        return None


def _instance(cloud: str, name: str | None) -> InstanceType | None:
    if not name:
        return None
    try:
        from koi import catalog

        return catalog.instance(cloud, name)
    except Exception:
        return None


def rank_features(
    job: Job,
    rank: Rank | tuple[Environment, ChainConfig],
    model: ModelArch,
    gpu: GpuSpec | None = None,
    instance: InstanceType | None = None,
    *,
    interconnect: Interconnect | str | None = None,
    preemption_policy: str = "recompute",
    router_policy: str = "round_robin",
) -> dict[str, FeatureValue]:
    """The flat feature dict of (job, rank, model, GPU, instance). Pure and deterministic.

    ``gpu`` and ``instance`` default to the catalog's entries for the rank's environment;
    ``interconnect`` overrides both (e.g. an observer that knows the real topology).
    """
    if isinstance(rank, Rank):
        env, cfg = rank.env, rank.config
    else:
        env, cfg = rank
    gpu = gpu or _gpu_spec(env.gpu_type)
    instance = instance or _instance(env.cloud, cfg.instance_type)
    wl = job.workload
    gpus_per_chain = cfg.tp * cfg.pp * cfg.dp
    per_node = instance.gpu_count if instance is not None else GPUS_PER_NODE_DEFAULT
    nodes = max(1, math.ceil(gpus_per_chain / per_node))
    if interconnect is not None:
        link = Interconnect(str(interconnect)).value
    elif instance is not None:
        link = instance.interconnect.value
    elif gpu is not None:
        link = gpu.interconnect.value
    else:
        link = "pcie"
    f: dict[str, FeatureValue] = {
        # knobs
        "tp": cfg.tp,
        "pp": cfg.pp,
        "dp": cfg.dp,
        "ep": cfg.ep,
        "engine_name": cfg.engine_name,
        "engine_version": cfg.engine_version,
        "block_size": cfg.block_size,
        "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens,
        "preemption_policy": preemption_policy,
        "router_policy": router_policy,
        "gpu_mem_util": cfg.gpu_mem_util,
        "prefix_cache_enabled": cfg.prefix_caching,
        "chunked_prefill_enable": cfg.chunked_prefill,
        "weight_dtype": cfg.weight_dtype.value,
        "kvcache_dtype": cfg.kv_cache_dtype.value,
        "weight_quantization_bits": cfg.weight_dtype.bits,
        # environment
        "market": env.market.value,
        "cloud": env.cloud,
        "region": env.region,
        "availability_zone": env.zone,
        "gpu_type": env.gpu_type,
        "instance_type": cfg.instance_type or "",
        "num_nodes_per_chain": nodes,
        # model
        "is_moe": model.is_moe,
        "num_routed_experts": model.num_experts,
        "num_active_experts": model.num_experts_active,
        "model_params_b": model.params_b,
        "num_hidden_layers": model.num_layers,
        "hidden_size": model.hidden_size,
        "num_attn_heads": model.num_heads,
        "num_kv_heads": model.num_kv_heads,
        # workload
        "isl_token_avg": wl.isl,
        "osl_token_avg": wl.osl,
        "request_arrival_rate": wl.arrival.rate_rps,
        "workload_prefix_concentration": wl.shared_prefix_fraction,
        "shared_prefix_length_avg": float(wl.shared_prefix_len),
        "is_session_affinity": wl.session_affinity,
        # SLO context
        "target_p99_ttft_ms": job.slo.p99_ttft_ms if job.slo.p99_ttft_ms is not None else 0.0,
        "target_p99_tpot_ms": job.slo.p99_tpot_ms if job.slo.p99_tpot_ms is not None else 0.0,
        "total_token_budget": job.total_token_budget or 0.0,
        "deadline_hours": (job.slo.deadline_s / 3600.0) if job.slo.deadline_s else 0.0,
    }
    weight_gb = model.weight_bytes(cfg.weight_dtype) / 1e9
    shards = cfg.tp * cfg.pp
    per_gpu = weight_gb / shards
    f.update(
        {
            "interconnect": link,
            "gqa_ratio": float(model.gqa_ratio),
            "gpus_per_chain": gpus_per_chain,
            "model_type": model.model_type,
            "job_class": job.job_class.value,
            "workload_types": workload_types(wl.isl, wl.osl, wl.shared_prefix_fraction),
            "isl_osl_ratio": wl.isl / wl.osl,
            "weight_gb_per_gpu": per_gpu,
        }
    )
    if gpu is not None:  # hardware figures only when the GPU is known (a missing feature fails its conditions)
        f["gpu_memory_gb"] = gpu.memory_gb
        f["mem_fit_ratio"] = per_gpu / (gpu.memory_gb * cfg.gpu_mem_util)
    return f


def features_from_mapping(values: dict[str, Any]) -> dict[str, FeatureValue]:
    """Validate a hand-built feature dict (tests, the agent's what-if queries): names must be known."""
    known = set(feature_names())
    bad = sorted(set(values) - known)
    if bad:
        raise ValueError(f"unknown feature(s) {bad}; features are registry X names or {sorted(DERIVED_FEATURES)}")
    return dict(values)
