"""C2: is a chain physically valid (overview §2.2, "each chain is physically valid with respect
to VRAM and parallelism")?

The memory and layout rules are koi.perf's (:func:`koi.perf.memory.memory_plan`: weights,
activation peak, reserve and KV capacity within ``gpu_mem_util`` × VRAM; TP divides the
attention and KV heads (or replicates KV heads), PP ≤ layers, EP divides the experts, ep
only on MoE). This module composes them with the catalog's instance shapes and the workload:

- the instance type (``config.instance_type``, or else the cheapest-shaped catalog
  instance of the environment's cloud and GPU that holds the chain: the smallest one with
  enough GPUs, else the largest for a multi-node chain) must carry the environment's GPU on
  the environment's cloud;
- a chain of g = tp·pp·dp GPUs runs on one instance when g ≤ its GPU count, or spans
  ``g / gpu_count`` whole instances when g is a multiple of it (the paper's TP4/PP2 across
  two 4-GPU g5.12xlarge). Across nodes we require each TP group to stay inside a node when
  possible; TP wider than a node is allowed but flagged ``tp_across_nodes`` (slow: the
  step model charges the network for its all-reduces);
- with a workload, the KV cache must hold its longest request (``input.max + output.max``,
  capped by the context: vLLM's ``max_model_len``; the engine refuses to start otherwise),
  and the p99 request must fit the model's context window.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from koi import catalog
from koi.domain.chain import Chain, ChainConfig
from koi.domain.hardware import GpuSpec, InstanceType
from koi.domain.model import ModelArch
from koi.domain.workload import WorkloadProfile
from koi.perf.memory import MemoryPlan, memory_plan
from koi.surrogate import lengths


@dataclass(frozen=True)
class Feasibility:
    ok: bool
    reasons: tuple[str, ...]
    flags: tuple[str, ...] = ()
    instance: InstanceType | None = None
    nodes: int = 1
    memory: MemoryPlan | None = None
    extra: dict[str, float] = field(default_factory=dict)


def resolve_model(model: str | ModelArch) -> ModelArch:
    return model if isinstance(model, ModelArch) else catalog.model(model)


def resolve_instance(chain: Chain) -> tuple[InstanceType | None, list[str]]:
    """The instance shape a chain runs on, and why it cannot (empty when it can)."""
    env, cfg = chain.env, chain.config
    if cfg.instance_type:
        try:
            inst = catalog.instance(env.cloud, cfg.instance_type)
        except catalog.CatalogError as exc:
            return None, [str(exc)]
        if inst.gpu_type != env.gpu_type:
            return inst, [f"instance {inst.name} carries {inst.gpu_type}, not the environment's {env.gpu_type}"]
        return inst, []
    shapes = catalog.instances_for_gpu(env.gpu_type, env.cloud)
    if not shapes:
        return None, [f"no {env.gpu_type} instance type on {env.cloud} in the catalog"]
    g = cfg.gpus
    single = [i for i in shapes if i.gpu_count >= g]
    if single:
        return min(single, key=lambda i: (i.gpu_count, _od_price(i))), []
    multi = [i for i in shapes if g % i.gpu_count == 0]
    if multi:
        return max(multi, key=lambda i: (i.gpu_count, -_od_price(i))), []
    return max(shapes, key=lambda i: i.gpu_count), []


def _od_price(i: InstanceType) -> float:
    return min(p.on_demand_hourly for p in i.prices)


def instance_reasons(cfg: ChainConfig, inst: InstanceType) -> tuple[list[str], list[str], int]:
    """(reasons, flags, nodes) of a chain's GPU count against one instance shape."""
    g, per = cfg.gpus, inst.gpu_count
    if g <= per:
        return [], [], 1
    if g % per:
        return [f"the chain's {g} GPUs are not a whole number of {inst.name} instances ({per} GPUs each)"], [], 1
    nodes = g // per
    flags: list[str] = ["multi_node"]
    if cfg.tp > per:
        flags.append("tp_across_nodes")
    elif per % cfg.tp:
        return [f"tp={cfg.tp} groups do not tile the {per} GPUs of {inst.name}"], flags, nodes
    return [], flags, nodes


def min_kv_tokens(model: ModelArch, workload: WorkloadProfile | None) -> tuple[int, list[str]]:
    """KV tokens the engine must hold to start, and reasons the workload cannot fit the model.

    Choice (as koi.sim does it, and as an operator sets vLLM's ``max_model_len``): the longest
    request the workload declares, ``input.max + output.max``, capped by the model's context.
    A workload whose p99 request exceeds the context is refused outright.
    """
    if workload is None:
        return 0, []
    reasons = []
    p99 = int(lengths.quantile(workload.input_len, 0.99) + lengths.quantile(workload.output_len, 0.99))
    if p99 > model.max_context:
        reasons.append(f"p99 request length {p99} tokens exceeds the {model.max_context}-token context of {model.name}")
    need = int(workload.input_len.max + workload.output_len.max)
    return min(need, model.max_context), reasons


def check(model: str | ModelArch, chain: Chain, workload: WorkloadProfile | None = None) -> Feasibility:
    """Every C2 rule for ``chain`` serving ``model`` (and one request of ``workload``, if given)."""
    arch = resolve_model(model)
    gpu: GpuSpec = catalog.gpu(chain.env.gpu_type)
    inst, reasons = resolve_instance(chain)
    flags: list[str] = []
    nodes = 1
    if inst is not None and not reasons:
        r, flags, nodes = instance_reasons(chain.config, inst)
        reasons += r
    need, r = min_kv_tokens(arch, workload)
    reasons += r
    mem = memory_plan(arch, gpu, chain.config, min_kv_tokens=need)
    reasons += list(mem.reasons)
    return Feasibility(
        ok=not reasons, reasons=tuple(reasons), flags=tuple(flags), instance=inst, nodes=nodes, memory=mem
    )


def feasibility(model: str | ModelArch, chain: Chain, workload: WorkloadProfile | None = None) -> tuple[bool, list[str]]:
    """(ok, reasons): the C2 verdict for ``chain`` (see :func:`check` for the full report)."""
    f = check(model, chain, workload)
    return f.ok, list(f.reasons)
