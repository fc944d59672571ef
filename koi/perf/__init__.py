"""koi.perf — measured operator data and the engine step model.

Both the fleet simulator (``koi.sim``) and the planner's surrogate (``koi.surrogate``)
build on this package; neither invents performance constants. Everything here comes from
aiconfigurator-core's measured tables (GEMM, attention, MoE, NCCL and custom all-reduce
latencies per GPU and engine), its system spec files, and — for engine overheads only —
constants fitted on a held-out split of its measured end-to-end ``silicon_sample.csv``.

Entry points
------------
Tables (seconds; every lookup broadcasts numpy arrays)::

    load_tables(system, backend="vllm", version=None) -> OpTables
        .gemm(m, n, k, dtype) / .context_attention(batch, isl, heads, kv_heads, head_dim, kv_dtype)
        .generation_attention(batch, context, ...) / .moe(tokens, hidden, inter, topk, experts, ...)
        .nccl(op, elements, num_gpus) / .allreduce(elements, num_gpus)
    gpu_tables(gpu, backend="vllm", version=None) -> GpuTables     # any catalog GPU; .rescaled_from
    perf_source(gpu) -> PerfSource        # which profiled GPU stands in, and the spec ratios
    nearest_profiled(gpu) -> GpuSpec

Memory and feasibility::

    memory_plan(model, gpu, config, *, min_kv_tokens=0) -> MemoryPlan   # .reasons, .kv_capacity_tokens ...
    check_feasible(model, gpu, config, ...) -> MemoryPlan                # raises InfeasibleConfig(reasons)
    layout(model, config) -> Layout / layout_reasons(model, config) -> list[str]

The step model (one engine iteration, vectorised over iterations/replicas/candidates)::

    step_model(model, gpu, config, links=None, *, gemm_mode=None, version=None) -> StepModel  # cached
    StepModel.step_time(prefill_tokens, prefill_ctx_sum=None, decode_seqs=0, decode_ctx_sum=0,
                        prefill_seqs=None, microbatches=None) -> np.ndarray          # seconds
    StepModel.breakdown(...) -> StepBreakdown  # total, gemm, attention, moe, elementwise,
                                               # communication, pipeline_wait, overhead, bubble_fraction
    Links.of(gpu, interconnect=None, gpus_per_node=None, nodes=1) / Links.for_instance(gpu, instance, nodes)

The closed-loop replay (the fidelity harness the simulator reuses)::

    closed_loop_estimate(model, gpu, config, isl, osl, concurrency, *, links=None, rounds=10,
                         harness=None, ...) -> ClosedLoopResult   # .ttft_s, .tpot_s, .output_tps ...
    Harness(rounds, warmup_rounds, isl_range, osl_range, jitter_s)   # the benchmark client emulated
    default_harness(engine)   # exact prompts, outputs spread by the engine's fitted desync spread
    schedule_closed_loop(policy, concurrency, isl, osl, *, requests, budget, max_seqs, kv_blocks,
                         block_size, ...) -> Schedule               # scheduling only, no timing

Fidelity against measured silicon (``koi sim fidelity``)::

    fidelity_report(*, split="hash", refit=False, limit=None, workers=1) -> FidelityReport
        .summary["holdout"] = {n, ttft_median, ttft_p90, tpot_median, tpot_p90}; .rows per-row table
    fidelity_summary(**kw) -> dict
    engine_default_config(engine, gpu, *, tp, weight_dtype, kv_dtype, ...) -> ChainConfig
    engine_overheads(engine) -> EngineOverheads

Module docstrings hold the modelling choices: :mod:`koi.perf.tables` (reductions),
:mod:`koi.perf.gpu_scale` (nearest profiled GPU and rescaling), :mod:`koi.perf.memory`
(TP/PP/EP rules, budgets), :mod:`koi.perf.step` (what an iteration costs),
:mod:`koi.perf.replay` (schedulers and the emulated benchmark), :mod:`koi.perf.overheads`
and :mod:`koi.perf.fidelity` (the held-out fit).
"""

from koi.perf.aic import PROFILED_SYSTEMS, PerfDataError, SystemSpec, system_spec
from koi.perf.fidelity import (
    FidelityReport,
    engine_default_config,
    fidelity_report,
    fidelity_summary,
    silicon_rows,
)
from koi.perf.gpu_scale import GpuTables, PerfSource, gpu_tables, nearest_profiled, perf_source, profiled_gpus
from koi.perf.memory import (
    InfeasibleConfig,
    Layout,
    MemoryPlan,
    check_feasible,
    layout,
    layout_reasons,
    memory_plan,
)
from koi.perf.overheads import EngineOverheads, engine_overheads
from koi.perf.replay import (
    ClosedLoopResult,
    Harness,
    Schedule,
    closed_loop_estimate,
    default_harness,
    schedule_closed_loop,
)
from koi.perf.step import Links, StepBreakdown, StepModel, step_model
from koi.perf.tables import OpTables, load_tables

__all__ = [
    "PROFILED_SYSTEMS",
    "ClosedLoopResult",
    "EngineOverheads",
    "FidelityReport",
    "GpuTables",
    "InfeasibleConfig",
    "Layout",
    "Links",
    "MemoryPlan",
    "OpTables",
    "PerfDataError",
    "PerfSource",
    "Schedule",
    "StepBreakdown",
    "StepModel",
    "SystemSpec",
    "check_feasible",
    "closed_loop_estimate",
    "default_harness",
    "Harness",
    "engine_default_config",
    "engine_overheads",
    "fidelity_report",
    "fidelity_summary",
    "gpu_tables",
    "layout",
    "layout_reasons",
    "load_tables",
    "memory_plan",
    "nearest_profiled",
    "perf_source",
    "profiled_gpus",
    "schedule_closed_loop",
    "silicon_rows",
    "step_model",
    "system_spec",
]
