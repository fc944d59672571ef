"""The benchmark suite's speed (issue 8): every non-LLM policy × seeds on a scenario, timed.

    .venv/bin/python benchmarks/bench_suite.py                         # hetero-3h, all non-LLM policies, 3 seeds, 2 processes
    .venv/bin/python benchmarks/bench_suite.py --policies koi --seeds 1 --hours 1
    .venv/bin/python benchmarks/bench_suite.py --profile koi           # one Koi run under pyinstrument (text to stdout)

Runs go through ``koi bench run``'s machinery with ``--fresh`` (nothing from the cache) into a
scratch cache (``--cache-dir``, default a temporary directory), and the script reports the suite's
wall time, every run's wall and CPU seconds and stage totals, and the load average sampled every
5 s during the suite (the machine is shared: when the load exceeds the cores, the wall figures
overstate what the runs need and the CPU figures are the ones to compare). The target: the
hetero-3h suite (about 12 policies × 3 seeds, 36 ticks each) in ≤ 30 min with 2 processes.

Results go to stdout as one JSON document (this is a script, not library code).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path


def _loads(stop: threading.Event, out: list[float]) -> None:
    while not stop.wait(5.0):
        out.append(os.getloadavg()[0])


def suite(args: argparse.Namespace) -> dict:
    from koi.bench.cache import RunCache
    from koi.bench.policy import all_policies, get_policy
    from koi.bench.runner import RunSpec, load, n_ticks_for, run_key
    from koi.cli.bench import _run_parallel, _run_serial

    sc, path = load(args.scenario)
    hours, n_ticks = n_ticks_for(sc, args.hours)
    if args.policies == "all":
        specs = [p for p in all_policies(llm_configured=False)]
    else:
        specs = [get_policy(n.strip()) for n in args.policies.split(",") if n.strip()]
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="koi-bench-suite-")
    todo = [RunSpec(str(path), p.name, s, hours) for p in specs for s in range(args.seeds)]
    samples: list[float] = []
    stop = threading.Event()
    sampler = threading.Thread(target=_loads, args=(stop, samples), daemon=True)
    load0 = os.getloadavg()
    t0 = time.perf_counter()
    sampler.start()
    try:
        if args.jobs > 1:
            briefs = _run_parallel(todo, cache_dir, True, args.jobs, False, sys.stderr.isatty())
        else:
            briefs = _run_serial(todo, cache_dir, True, sys.stderr.isatty())
    finally:
        stop.set()
    wall = time.perf_counter() - t0
    cache = RunCache(cache_dir)
    runs = []
    for s in todo:
        r = cache.load(run_key(sc, s.policy, s.seed, hours))
        if r is None:
            runs.append({"policy": s.policy, "seed": s.seed, "error": next(
                (b.get("error") for b in briefs if b.get("policy") == s.policy and b.get("seed") == s.seed), "missing")})
            continue
        runs.append({"policy": s.policy, "seed": s.seed, "wall_s": r.meta.wall_s, "cpu_s": r.meta.cpu_s,
                     "sim_s": r.meta.sim_s, "stage_s": r.meta.stage_s, "load_before": r.meta.load_before,
                     "load_after": r.meta.load_after, "fallback_ticks": r.meta.ticks_fallback,
                     "composite": r.metrics.composite})  # fmt: skip
    ok = [r for r in runs if "wall_s" in r]
    per_policy: dict[str, dict[str, float]] = {}
    for r in ok:
        d = per_policy.setdefault(r["policy"], {"runs": 0, "wall_s": 0.0, "cpu_s": 0.0})
        d["runs"] += 1
        d["wall_s"] += r["wall_s"]
        d["cpu_s"] += r["cpu_s"]
    for d in per_policy.values():
        d["wall_s_mean"] = round(d.pop("wall_s") / d["runs"], 1)
        d["cpu_s_mean"] = round(d.pop("cpu_s") / d["runs"], 1)
    return {
        "scenario": sc.name, "hours": hours, "ticks_per_run": n_ticks, "policies": [p.name for p in specs],
        "seeds": args.seeds, "jobs": args.jobs, "cores": os.cpu_count(), "runs": len(todo), "failed": len(todo) - len(ok),
        "suite_wall_s": round(wall, 1), "target_s": 1800.0,
        "run_wall_s_mean": round(sum(r["wall_s"] for r in ok) / max(len(ok), 1), 1),
        "run_cpu_s_mean": round(sum(r["cpu_s"] for r in ok) / max(len(ok), 1), 1),
        "cpu_s_total": round(sum(r["cpu_s"] for r in ok), 1),
        "load_avg_before": [round(x, 2) for x in load0], "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        "load_1min_mean_during": round(sum(samples) / len(samples), 2) if samples else None,
        "load_1min_max_during": round(max(samples), 2) if samples else None,
        "per_policy": per_policy, "cache_dir": cache_dir, "per_run": runs,
    }  # fmt: skip


def profile(args: argparse.Namespace) -> None:
    import pyinstrument

    from koi.bench.runner import run_one

    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="koi-bench-profile-")
    p = pyinstrument.Profiler()
    p.start()
    r = run_one(args.scenario, args.profile, 0, hours=args.hours, cache_dir=cache_dir, fresh=True)
    p.stop()
    sys.stdout.write(p.output_text(unicode=True, show_all=False))
    sys.stdout.write(json.dumps({"wall_s": r.meta.wall_s, "cpu_s": r.meta.cpu_s, "stage_s": r.meta.stage_s,
                                 "sim_s": r.meta.sim_s}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scenario", default="hetero-3h")
    ap.add_argument("--policies", default="all", help="'all' (every non-LLM policy) or comma-separated names")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--hours", type=float, default=None)
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--profile", default=None, metavar="POLICY", help="profile one run of this policy instead")
    args = ap.parse_args()
    from koi.logging import configure

    configure(level="WARNING")
    import warnings

    warnings.simplefilter("ignore", RuntimeWarning)
    if args.cache_dir:
        Path(args.cache_dir).mkdir(parents=True, exist_ok=True)
    if args.profile:
        profile(args)
        return
    sys.stdout.write(json.dumps(suite(args), indent=1) + "\n")


if __name__ == "__main__":
    main()
