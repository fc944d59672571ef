"""The one registry of X / V / Y variable names (whitepaper, Appendix C).

Every module that names a knob, a mediator or an outcome takes the name from here:
the surrogate's predictions, the simulator's telemetry, the causal graph's nodes,
the store's columns and the scoring objectives. A name that is not registered is
an error, not a new variable: the graph is closed-world (whitepaper, "The Causal
Substrate").

Choices where Appendix C is vague:
- ``total_token_budget`` is listed both as a mediator family ("Work budget") and as
  an SLO context variable; we register it once, as X context, because it is set by
  the job, not caused by the deployment.
- ``live_batch_size``, ``queue_depth`` and ``preemption_rate`` are mediators the
  issues ask the simulator to report; they are measurable engine state between the
  knobs and the outcomes, so they are V.
- ``pd_inbalance`` (sic, the spec's spelling) and the disaggregation knobs are
  registered but marked ``deferred``: no deployment exercises them yet, so no
  mechanism may claim them as testable.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import cache


class Kind(StrEnum):
    X = "X"  # decisions and context (sources of edges)
    V = "V"  # measurable mediators
    Y = "Y"  # outcomes


class Direction(StrEnum):
    MAXIMIZE = "maximize"
    MINIMIZE = "minimize"
    NONE = "none"


@dataclass(frozen=True, slots=True)
class Variable:
    name: str
    kind: Kind
    family: str
    unit: str = ""
    direction: Direction = Direction.NONE
    description: str = ""
    deferred: bool = False
    # X only: True when the planner sets it (a knob); False for environment/workload context.
    controllable: bool = False


def _x(name: str, family: str, unit: str = "", desc: str = "", *, knob: bool = True, deferred: bool = False) -> Variable:
    return Variable(name, Kind.X, family, unit, Direction.NONE, desc, deferred, knob)


def _v(name: str, family: str, unit: str, desc: str, *, deferred: bool = False) -> Variable:
    return Variable(name, Kind.V, family, unit, Direction.NONE, desc, deferred, False)


def _y(name: str, unit: str, direction: Direction, desc: str) -> Variable:
    return Variable(name, Kind.Y, "outcome", unit, direction, desc, False, False)


_REGISTRY: tuple[Variable, ...] = (
    # ---- X: knobs -------------------------------------------------------------
    _x("tp", "parallelism", "", "tensor-parallel degree"),
    _x("pp", "parallelism", "", "pipeline-parallel degree"),
    _x("dp", "parallelism", "", "data-parallel width inside a chain"),
    _x("ep", "parallelism", "", "expert-parallel degree (MoE)"),
    _x("sp", "parallelism", "", "sequence-parallel degree", deferred=True),
    _x("cp", "parallelism", "", "context-parallel degree", deferred=True),
    _x("engine_name", "engine", "", "serving engine (vllm, sglang, trtllm)"),
    _x("engine_version", "engine", "", "serving engine version"),
    _x("block_size", "engine", "tokens", "KV-cache block size"),
    _x("max_num_seqs", "batching", "seqs", "maximum sequences in a running batch"),
    _x("max_num_batched_tokens", "batching", "tokens", "token budget of one engine iteration"),
    _x("preemption_policy", "batching", "", "recompute or swap on KV exhaustion"),
    _x("router_policy", "batching", "", "request router across replicas"),
    _x("gpu_mem_util", "memory", "fraction", "fraction of VRAM the engine may use"),
    _x("prefix_cache_enabled", "memory", "bool", "automatic prefix caching"),
    _x("chunked_prefill_enable", "memory", "bool", "chunked prefill"),
    _x("kv_transfer_method", "memory", "", "KV transfer for disaggregation", deferred=True),
    _x("weight_dtype", "quantization", "", "weight precision (bf16, fp8, int4 ...)"),
    _x("kvcache_dtype", "quantization", "", "KV-cache precision"),
    _x("weight_quantization_bits", "quantization", "bits", "bits per weight"),
    _x("pd_enabled", "disaggregation", "bool", "prefill/decode disaggregation", deferred=True),
    _x("prefill_worker_count", "disaggregation", "", "prefill workers", deferred=True),
    _x("decode_worker_count", "disaggregation", "", "decode workers", deferred=True),
    # ---- X: environment context ------------------------------------------------
    _x("market", "environment", "", "reserved, on_demand or spot"),
    _x("cloud", "environment", "", "cloud provider"),
    _x("region", "environment", "", "cloud region"),
    _x("availability_zone", "environment", "", "availability zone"),
    _x("gpu_type", "environment", "", "accelerator type"),
    _x("instance_type", "environment", "", "instance shape"),
    _x("num_nodes_per_chain", "environment", "", "machines one chain spans"),
    # ---- X: workload / model context (not controllable) ------------------------
    _x("is_moe", "model", "bool", "mixture-of-experts model", knob=False),
    _x("num_routed_experts", "model", "", "experts in total", knob=False),
    _x("num_active_experts", "model", "", "experts active per token", knob=False),
    _x("model_params_b", "model", "B", "parameters, billions", knob=False),
    _x("num_hidden_layers", "model", "", "transformer layers", knob=False),
    _x("hidden_size", "model", "", "hidden dimension", knob=False),
    _x("num_attn_heads", "model", "", "attention heads", knob=False),
    _x("num_kv_heads", "model", "", "KV heads (GQA when < attention heads)", knob=False),
    _x("isl_token_avg", "request_shape", "tokens", "mean input length", knob=False),
    _x("osl_token_avg", "request_shape", "tokens", "mean output length", knob=False),
    _x("request_arrival_rate", "request_shape", "req/s", "offered arrival rate", knob=False),
    _x("workload_prefix_concentration", "request_shape", "fraction", "share of requests with a shared prefix", knob=False),
    _x("shared_prefix_length_avg", "request_shape", "tokens", "mean shared prefix length", knob=False),
    _x("is_session_affinity", "request_shape", "bool", "sticky sessions", knob=False),
    _x("target_p99_ttft_ms", "slo", "ms", "p99 TTFT target", knob=False),
    _x("target_p99_tpot_ms", "slo", "ms", "p99 TPOT target", knob=False),
    _x("total_token_budget", "slo", "tokens", "tokens a batch job must produce", knob=False),
    _x("deadline_hours", "slo", "h", "batch deadline", knob=False),
    # ---- V: mediators ------------------------------------------------------------
    _v("kvcache_hit_rate", "cache_sequence", "fraction", "prefix-cache hit rate"),
    _v("input_length_observed", "cache_sequence", "tokens", "mean observed input length"),
    _v("output_length_observed", "cache_sequence", "tokens", "mean observed output length"),
    _v("gpu_mem_used_fraction", "memory_pressure", "fraction", "VRAM in use / VRAM"),
    _v("kv_cache_util", "memory_pressure", "fraction", "KV blocks in use / KV blocks"),
    _v("vram_headroom_gb", "memory_pressure", "GB", "VRAM left unused per GPU"),
    _v("kv_pressure_score", "memory_pressure", "", "KV demand / KV capacity (>1 means preemption)"),
    _v("pipeline_bubble_fraction", "parallelism_overhead", "fraction", "idle share of pipeline stages"),
    _v("comm_overhead_pct", "parallelism_overhead", "%", "share of step time in collectives"),
    _v("per_tok_comm_bytes", "parallelism_overhead", "B/token", "collective bytes per generated token"),
    _v("pd_inbalance", "parallelism_overhead", "", "prefill/decode imbalance", deferred=True),
    _v("live_batch_size", "scheduler", "seqs", "sequences in the running batch"),
    _v("queue_depth", "scheduler", "requests", "requests waiting for admission"),
    _v("preemption_rate", "scheduler", "1/s", "KV preemptions per second"),
    # ---- Y: outcomes ---------------------------------------------------------------
    _y("throughput_tokens_per_sec", "tok/s", Direction.MAXIMIZE, "system output throughput"),
    _y("p99_ttft_ms", "ms", Direction.MINIMIZE, "online TTFT SLO"),
    _y("p99_tpot_ms", "ms", Direction.MINIMIZE, "online per-token latency SLO"),
    _y("cost_per_token", "$/tok", Direction.MINIMIZE, "price / throughput"),
    _y("slo_margin", "", Direction.MAXIMIZE, "headroom to TTFT/TPOT targets (or deadline)"),
)

VARIABLES: dict[str, Variable] = {v.name: v for v in _REGISTRY}
if len(VARIABLES) != len(_REGISTRY):  # pragma: no cover - a guard on the table above
    raise RuntimeError("duplicate variable name in the registry")

X_NAMES: tuple[str, ...] = tuple(v.name for v in _REGISTRY if v.kind is Kind.X)
V_NAMES: tuple[str, ...] = tuple(v.name for v in _REGISTRY if v.kind is Kind.V)
Y_NAMES: tuple[str, ...] = tuple(v.name for v in _REGISTRY if v.kind is Kind.Y)
KNOB_NAMES: tuple[str, ...] = tuple(v.name for v in _REGISTRY if v.kind is Kind.X and v.controllable)

#: Observable mediators: the V a deployment can actually report (deferred ones excluded).
OBSERVED_V: tuple[str, ...] = tuple(n for n in V_NAMES if not VARIABLES[n].deferred)

#: The scoring objectives in the spec's fixed order (cost, p99 TTFT, p99 TPOT, throughput,
#: SLO margin); the class weights of whitepaper §"Exploitation" are indexed by it.
OBJECTIVES: tuple[str, ...] = (
    "cost_per_token",
    "p99_ttft_ms",
    "p99_tpot_ms",
    "throughput_tokens_per_sec",
    "slo_margin",
)

#: Telemetry series a rank reports every sub-tick sample: all observed V and all Y.
TELEMETRY_SERIES: tuple[str, ...] = OBSERVED_V + Y_NAMES

#: Per job class (``JobClass`` value), series its telemetry measures differently from what the
#: surrogate predicts, so observed and predicted are never compared: a batch request's TTFT is
#: counted from the job's submission (the job's deliberate backlog, minutes to hours), while the
#: surrogate predicts the engine's steady-state TTFT. S2's residuals, the PerfDB records the
#: residual learner fits and ``koi learn``'s stored predictions all leave them out.
NOT_COMPARABLE: dict[str, frozenset[str]] = {"batch": frozenset({"p99_ttft_ms"})}


class UnknownVariableError(KeyError):
    """A name that the closed-world registry does not hold."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0])


def get(name: str) -> Variable:
    """The registered variable ``name``; a clear error naming it otherwise."""
    try:
        return VARIABLES[name]
    except KeyError:
        raise UnknownVariableError(f"unknown variable {name!r}: not in koi.variables (Appendix C)") from None


def kind_of(name: str) -> Kind:
    return get(name).kind


def is_maximized(name: str) -> bool:
    v = get(name)
    if v.kind is not Kind.Y:
        raise ValueError(f"{name!r} is a {v.kind} variable; only outcomes have a direction")
    return v.direction is Direction.MAXIMIZE


def edge_id(src: str, dst: str) -> str:
    """The canonical id of an edge, as in the spec's mechanism example: ``"pp->pipeline_bubble_fraction"``."""
    return f"{src}->{dst}"


def split_edge_id(eid: str) -> tuple[str, str]:
    src, sep, dst = eid.partition("->")
    if not sep or not src or not dst:
        raise ValueError(f"malformed edge id {eid!r}: expected 'src->dst'")
    return src, dst


def is_legal_edge(src: str, dst: str) -> bool:
    """Only X→V and V→Y edges exist: every effect passes through a measurable mediator."""
    ks, kd = kind_of(src), kind_of(dst)
    return (ks is Kind.X and kd is Kind.V) or (ks is Kind.V and kd is Kind.Y)


@cache
def names_of(kind: Kind) -> tuple[str, ...]:
    return {Kind.X: X_NAMES, Kind.V: V_NAMES, Kind.Y: Y_NAMES}[kind]
