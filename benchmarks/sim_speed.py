"""Simulator speed (issue 3): ``python benchmarks/sim_speed.py [--json] [--only 3h|12h] [--step S]``.

Runs the generated benchmark of :mod:`koi.sim.bench` — a heterogeneous fleet, 25 concurrent
jobs (19 online at 1–20 req/s, 6 recurring batch campaigns of thousands of requests) under
fixed deployments — for 3 hours on ~400 GPUs (target ≤ 60 s wall) and 12 hours on ~800
GPUs (target ≤ 5 min wall), and reports wall and CPU seconds and simulated GPU-hours per
wall second. Same as ``koi sim bench --hours 3 --gpus 400`` / ``--hours 12 --gpus 800``.
"""

from __future__ import annotations

import argparse
import json

from koi.sim.bench import run_benchmark

CASES = {"3h": (3.0, 400, 60.0), "12h": (12.0, 800, 300.0)}

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--only", choices=sorted(CASES))
    ap.add_argument("--step", type=float, default=1.0)
    args = ap.parse_args()
    out = {}
    for name, (hours, gpus, target) in CASES.items():
        if args.only and name != args.only:
            continue
        res = run_benchmark(hours, gpus, step_s=args.step)
        res["target_wall_s"] = target
        res["meets_target"] = res["wall_s"] <= target
        out[name] = res
        if not args.json:
            print(f"{name}: {res['fleet_gpus']} GPUs, {res['jobs']} jobs, {res['requests']} requests: "
                  f"wall {res['wall_s']} s (cpu {res['cpu_s']} s, target {target} s), "
                  f"{res['gpu_hours_per_wall_s']} GPU-h per wall s")
    if args.json:
        print(json.dumps(out, indent=2))
