"""The speed benchmark: a generated heterogeneous fleet with 25 jobs under fixed deployments.

:func:`benchmark_scenario` builds the paper's benchmark shape programmatically for any
fleet size: ~400 GPUs over AWS, GCP and Azure (H100, H200, A100-80GB, L40S, L4, A10G,
RTX PRO 6000, MI300X; on-demand, reserved and spot, with spot reclaim hazards and rare
node failures), and 25 concurrent jobs over ten architectures from 1B to 235B (dense
and MoE): 19 online jobs at 1–20 req/s (Poisson, constant and gamma arrivals) and 6
batch jobs of thousands of requests with deadlines of 20–135 minutes, which recur
(a new campaign every 2.5 hours) so a long run keeps its load. Fleet and load scale
with ``gpus / 400``. Every job has a fixed deployment sized to its load (a replica's
64-sequence decode rate from koi/perf, 1.5× headroom), so the run measures the
simulator, not a planner.

:func:`run_benchmark` runs it and reports wall seconds and simulated GPU-hours per wall
second (``koi sim bench``; ``benchmarks/sim_speed.py``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from koi import catalog
from koi.domain import ChainConfig
from koi.sim.physics import chain_spec, instances_per_replica, rank_tables
from koi.sim.scenario import Scenario, parse_scenario
from koi.sim.tables import B_AXIS, C_AXIS

# (name, cloud, region, market, instance type, instances per 400 GPUs, reclaim/h, failure/h)
_POOLS = [
    ("aws-h100-od", "aws", "us-east-1", "on_demand", "p5.48xlarge", 6, 0.0, 0.002),
    ("aws-h100-spot", "aws", "us-east-2", "spot", "p5.48xlarge", 4, 0.05, 0.002),
    ("gcp-h100-res", "gcp", "us-central1", "reserved", "a3-highgpu-8g", 4, 0.0, 0.002),
    ("aws-h200-od", "aws", "us-east-1", "on_demand", "p5en.48xlarge", 4, 0.0, 0.002),
    ("azure-h200-spot", "azure", "eastus", "spot", "Standard_ND96isr_H200_v5", 2, 0.05, 0.002),
    ("aws-a100-res", "aws", "us-west-2", "reserved", "p4de.24xlarge", 4, 0.0, 0.002),
    ("gcp-a100-spot", "gcp", "us-central1", "spot", "a2-ultragpu-8g", 4, 0.08, 0.002),
    ("azure-a100-od", "azure", "westus2", "on_demand", "Standard_ND96amsr_A100_v4", 2, 0.0, 0.002),
    ("aws-l40s-spot", "aws", "us-west-2", "spot", "g6e.48xlarge", 4, 0.1, 0.002),
    ("aws-l40s-od", "aws", "us-east-1", "on_demand", "g6e.12xlarge", 8, 0.0, 0.002),
    ("gcp-l4-spot", "gcp", "us-central1", "spot", "g2-standard-48", 8, 0.1, 0.002),
    ("aws-a10g-od", "aws", "us-east-1", "on_demand", "g5.48xlarge", 4, 0.0, 0.002),
    ("gcp-rtx-od", "gcp", "us-central1", "on_demand", "g4-standard-384", 3, 0.0, 0.002),
    ("azure-mi300x-od", "azure", "eastus", "on_demand", "Standard_ND96isr_MI300X_v5", 2, 0.0, 0.002),
]


def _ln(mean: float, std: float, lo: int, hi: int) -> dict[str, Any]:
    return {"kind": "lognormal", "mean": mean, "std": std, "min": lo, "max": hi}


# (job, model, pool, tp, arrival, rate rps, input, output, slo) for online jobs
_ONLINE = [
    ("mod-1b", "llama-3.2-1b", "gcp-l4-spot", 1, "constant", 20.0, _ln(250, 80, 16, 1024), {"kind": "fixed", "mean": 6, "min": 6, "max": 6}, (300, 40)),
    ("mod-3b", "llama-3.2-3b", "aws-a10g-od", 1, "poisson", 12.0, _ln(400, 150, 16, 2048), _ln(20, 10, 1, 64), (400, 50)),
    ("chat-8b-a", "llama-3.1-8b", "aws-l40s-od", 1, "poisson", 10.0, _ln(900, 600, 16, 6000), _ln(250, 150, 8, 1024), (1500, 80)),
    ("chat-8b-b", "llama-3.1-8b", "aws-l40s-spot", 1, "gamma", 8.0, _ln(900, 600, 16, 6000), _ln(250, 150, 8, 1024), (1500, 80)),
    ("chat-q8b", "qwen3-8b", "gcp-rtx-od", 1, "poisson", 6.0, _ln(1200, 700, 16, 8000), _ln(300, 200, 8, 1536), (2000, 80)),
    ("rag-8b", "llama-3.1-8b", "aws-h100-od", 1, "poisson", 8.0, _ln(3500, 1500, 256, 12000), _ln(200, 100, 8, 768), (2500, 60)),
    ("code-phi4", "phi-4", "aws-l40s-od", 1, "gamma", 4.0, _ln(1500, 800, 64, 8000), _ln(350, 200, 16, 1536), (2500, 90)),
    ("code-32b", "qwen3-32b", "aws-h100-od", 2, "poisson", 5.0, _ln(1800, 900, 64, 12000), _ln(400, 250, 16, 2048), (3000, 100)),
    ("chat-32b", "qwen3-32b", "aws-h200-od", 1, "poisson", 4.0, _ln(1000, 600, 16, 8000), _ln(300, 200, 8, 1536), (2500, 90)),
    ("assist-70b", "llama-3.1-70b", "aws-h200-od", 4, "poisson", 3.0, _ln(1200, 700, 16, 8000), _ln(300, 200, 8, 1536), (3000, 100)),
    ("chat-70b", "llama-3.1-70b", "gcp-h100-res", 4, "gamma", 2.5, _ln(1000, 600, 16, 8000), _ln(250, 150, 8, 1024), (3000, 100)),
    ("agent-moe", "qwen3-30b-a3b", "aws-h100-spot", 2, "poisson", 3.0, _ln(4000, 2000, 256, 16000), _ln(600, 300, 32, 2048), (4000, 60)),
    ("chat-moe", "qwen3-30b-a3b", "azure-h200-spot", 1, "poisson", 5.0, _ln(800, 400, 16, 4096), _ln(300, 150, 8, 1024), (1500, 50)),
    ("mixtral-chat", "mixtral-8x7b", "gcp-a100-spot", 2, "poisson", 3.0, _ln(900, 500, 16, 6000), _ln(250, 150, 8, 1024), (2500, 100)),
    ("big-moe", "qwen3-235b-a22b", "azure-mi300x-od", 8, "poisson", 1.5, _ln(1500, 800, 64, 8000), _ln(400, 200, 16, 1536), (5000, 120)),
    ("summ-8b", "qwen3-8b", "azure-a100-od", 1, "poisson", 2.0, _ln(12000, 6000, 1024, 24000), _ln(300, 150, 32, 1024), (6000, 80)),
    ("chat-1b", "llama-3.2-1b", "gcp-l4-spot", 1, "poisson", 15.0, _ln(500, 300, 16, 2048), _ln(150, 80, 4, 512), (500, 40)),
    ("tool-3b", "llama-3.2-3b", "aws-a10g-od", 1, "constant", 8.0, _ln(700, 300, 16, 3000), _ln(80, 40, 4, 256), (800, 60)),
    ("qa-phi4", "phi-4", "gcp-rtx-od", 1, "gamma", 3.0, _ln(1500, 700, 64, 8000), _ln(250, 120, 8, 1024), (3000, 90)),
]

# (job, model, pool, tp, requests, input, output, deadline min, first submission s)
_BATCH = [
    ("batch-summ-70b", "llama-3.1-70b", "aws-a100-res", 4, 3000, _ln(5000, 2000, 512, 14000), _ln(300, 120, 32, 1024), 135, 300),
    ("batch-extract-8b", "llama-3.1-8b", "gcp-a100-spot", 1, 8000, _ln(2000, 900, 128, 8000), _ln(150, 60, 8, 512), 60, 600),
    ("batch-label-3b", "llama-3.2-3b", "aws-l40s-spot", 1, 12000, _ln(600, 250, 32, 2048), _ln(20, 8, 1, 64), 20, 900),
    ("batch-trans-32b", "qwen3-32b", "gcp-h100-res", 2, 2500, _ln(1200, 500, 64, 6000), _ln(900, 400, 64, 2048), 90, 1200),
    ("batch-mixtral", "mixtral-8x7b", "aws-a100-res", 2, 4000, _ln(1500, 600, 64, 6000), _ln(250, 100, 16, 1024), 75, 1500),
    ("batch-moe", "qwen3-30b-a3b", "aws-h100-spot", 2, 5000, _ln(2500, 1000, 128, 10000), _ln(400, 200, 16, 1536), 100, 1800),
]

_PERIOD_S = 9000.0  # a batch campaign recurs every 2.5 hours


def _replicas(model: str, itype_cloud: str, itype_name: str, tp: int, want_tps: float, lens: tuple[float, float]) -> int:
    itype = catalog.instance(itype_cloud, itype_name)
    cfg = ChainConfig(tp=tp)
    t = rank_tables(chain_spec(model, itype, cfg, int(lens[0] + lens[1])))
    ib, ic = int(np.searchsorted(B_AXIS, 64.0)), int(np.searchsorted(C_AXIS, 1024.0))
    per_rep = 64.0 / float(t.dec_time[ib, ic])
    return max(1, math.ceil(1.5 * want_tps / per_rep))


def benchmark_scenario(hours: float = 3.0, gpus: int = 400, seed: int = 0, *, step_s: float = 1.0) -> Scenario:
    """The generated benchmark scenario (validated like a file would be)."""
    scale = gpus / 400.0
    pools = []
    sizes: dict[str, tuple[str, str, int]] = {}
    for name, cloud, region, market, itype, n, reclaim, fail in _POOLS:
        k = max(1, round(n * scale))
        sizes[name] = (cloud, itype, k)
        pools.append({"name": name, "cloud": cloud, "region": region, "market": market, "instance_type": itype,
                      "instances": k, "reclaim_rate_per_hour": reclaim, "failure_rate_per_hour": fail,
                      "return_after_s": 1800, "repair_s": 3600})  # fmt: skip
    # replicas: what the load needs, then the pools filled by handing out spare instances to the
    # job furthest below its pool's fill level (a benchmark fleet is busy, not mostly idle)
    specs = []  # (job dict, pool, model, tp, need)
    for name, model, pool, tp, proc, rate, inp, outp, (ttft, tpot) in _ONLINE:
        r = rate * scale
        cloud, itype, _k = sizes[pool]
        need = _replicas(model, cloud, itype, tp, r * outp["mean"], (inp["max"], outp["max"]))
        job = {
            "job_id": name, "model": model, "job_class": "online",
            "workload": {"kind": name.split("-")[0], "input_len": inp, "output_len": outp,
                         "arrival": {"process": proc, "rate_rps": r, **({"cv": 1.5} if proc == "gamma" else {})},
                         **({"shared_prefix_fraction": 0.5, "shared_prefix_len": 256} if "chat" in name else {})},
            "slo": {"p99_ttft_ms": ttft, "p99_tpot_ms": tpot},
        }  # fmt: skip
        specs.append(([job], pool, tp, need))
    horizon = hours * 3600.0
    for name, model, pool, tp, nreq, inp, outp, deadline_min, first in _BATCH:
        n = max(1, round(nreq * scale))
        cloud, itype, _k = sizes[pool]
        need = _replicas(model, cloud, itype, tp, n * outp["mean"] / (deadline_min * 60.0), (inp["max"], outp["max"]))
        group = []
        k = 0
        t = float(first)
        while t < horizon:
            group.append({
                "job_id": f"{name}-{k}", "model": model, "job_class": "batch", "submitted_at": t,
                "workload": {"kind": "batch", "input_len": inp, "output_len": outp},
                "slo": {"deadline_s": deadline_min * 60.0, "num_requests": n},
            })  # fmt: skip
            k += 1
            t += _PERIOD_S
        specs.append((group, pool, tp, need))

    def inst(pool: str, tp: int, n: int) -> int:
        cloud, itype, _k = sizes[pool]
        ipr, rpi = instances_per_replica(ChainConfig(tp=tp), catalog.instance(cloud, itype))
        return math.ceil(n / rpi) if ipr == 1 else n * ipr

    reps = [max(1, s[3]) for s in specs]
    for pool, (_cloud, _itype, k) in sizes.items():
        idx = [i for i, s in enumerate(specs) if s[1] == pool]
        while idx and sum(inst(pool, specs[i][2], reps[i]) for i in idx) > k:  # over capacity: trim the largest
            j = max(idx, key=lambda i: reps[i] / specs[i][3])
            if reps[j] == 1:
                break
            reps[j] -= 1
        while idx:
            cands = [i for i in idx if sum(inst(pool, specs[m][2], reps[m] + (m == i)) for m in idx) <= k]
            if not cands:
                break
            j = min(cands, key=lambda i: (reps[i] / specs[i][3], i))
            reps[j] += 1
    jobs = []
    for (group, pool, tp, _need), n in zip(specs, reps, strict=True):
        for job in group:
            job["deploy"] = [{"pool": pool, "config": {"tp": tp}, "n_replicas": n}]
            jobs.append(job)
    sc = {
        "name": f"bench-{hours:g}h-{gpus}gpu",
        "description": "generated speed benchmark (koi.sim.bench)",
        "seed": seed,
        "duration_s": horizon,
        "step_s": step_s,
        "sample_s": 15.0,
        "pools": pools,
        "events": [{"at_s": horizon / 3, "kind": "spot_reclaim", "pool": "aws-l40s-spot", "instances": 1,
                    "return_after_s": 1800}],  # fmt: skip
        "hidden": [
            {"kind": "efficiency", "match": {"cloud": "azure"}, "step_time_factor": 1.08},
            {"kind": "noisy_neighbours", "match": {"market": "spot"}, "step_time_factor": 1.03, "jitter_cv": 0.05},
            {"kind": "engine_change", "match": {"gpu_type": "H100"}, "start_s": horizon / 2, "throughput_factor": 0.85},
        ],
        "jobs": jobs,
    }
    return parse_scenario(sc, source="<benchmark>", check_deployments=False)


def run_benchmark(
    hours: float = 3.0, gpus: int = 400, seed: int = 0, *, step_s: float = 1.0,
    on_progress: Callable[[float, float], None] | None = None,
) -> dict[str, Any]:  # fmt: skip
    """Run the benchmark; wall seconds, simulated GPU-hours per wall second and what was simulated."""
    from koi.sim.driver import FixedDriver, summarize
    from koi.sim.world import World

    t_build = time.perf_counter()
    sc = benchmark_scenario(hours, gpus, seed, step_s=step_s)
    world = World(sc)
    driver = FixedDriver(world)
    build_s = time.perf_counter() - t_build
    until = hours * 3600.0
    t0 = time.perf_counter()
    c0 = time.process_time()
    driver.run(until, chunk_s=300.0, on_progress=(lambda t: on_progress(t, until)) if on_progress else None)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    summary = summarize(world, driver)
    fleet_gpus = sc.total_gpus
    gpu_h = fleet_gpus * hours
    f = summary["fleet"]
    return {
        "scenario": sc.name,
        "hours": hours,
        "fleet_gpus": fleet_gpus,
        "jobs": len(sc.jobs),
        "concurrent_job_specs": len(_ONLINE) + len(_BATCH),
        "step_s": step_s,
        "setup_s": round(build_s, 2),
        "wall_s": round(wall, 2),
        "cpu_s": round(cpu, 2),
        "simulated_gpu_hours": gpu_h,
        "gpu_hours_per_wall_s": round(gpu_h / wall, 1),
        "requests": f["requests"],
        "served": f["served"],
        "output_tokens": f["output_tokens"],
        "engines": world.engine.R,
        "replicas_failed_to_materialize": f["replicas_failed_to_materialize"],
        "spot_reclaims": f["spot_reclaims"],
        "failed_launches": len(f["failed_launches"]),
        "cost_usd": f["cost_usd"],
    }
