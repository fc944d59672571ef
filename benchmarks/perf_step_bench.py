"""koi.perf benchmarks: step-model speed, closed-loop replay speed, and fidelity vs silicon.

    .venv/bin/python benchmarks/perf_step_bench.py --speed
    .venv/bin/python benchmarks/perf_step_bench.py --fidelity [--workers 2] [--csv out.csv]
    .venv/bin/python benchmarks/perf_step_bench.py --fit      # refit engine overheads, write the yaml

Results go to stdout (this is a script, not library code).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def speed() -> dict[str, float]:
    from koi.catalog import gpu, model
    from koi.domain import ChainConfig
    from koi.perf import closed_loop_estimate, load_tables, step_model
    from koi.perf.fidelity import engine_default_config

    t0 = time.perf_counter()
    load_tables("h100_sxm", "vllm")
    load_s = time.perf_counter() - t0

    m, g = model("llama-3.1-70b"), gpu("H100")
    cfg = ChainConfig(tp=4, weight_dtype="fp8", kv_dtype="fp8")
    t0 = time.perf_counter()
    sm = step_model(m, g, cfg)
    build_s = time.perf_counter() - t0

    rng = np.random.default_rng(0)
    n = 100_000
    pf = rng.integers(0, 4096, n) * (rng.random(n) < 0.3)
    nd = rng.integers(0, 256, n)
    ctx = nd * rng.integers(128, 8192, n)
    sm.step_time(pf[:10], None, nd[:10], ctx[:10])
    t0 = time.perf_counter()
    sm.step_time(pf, None, nd, ctx)
    step_s = time.perf_counter() - t0

    cases = [(1024, 1024, 64), (8192, 1024, 64), (1024, 8192, 64), (1000, 2000, 512)]
    cfg2 = engine_default_config("vllm", g, tp=4, weight_dtype="fp8", kv_dtype="fp8")
    step_model(m, g, cfg2)
    replay = {}
    for isl, osl, c in cases:
        t0 = time.perf_counter()
        closed_loop_estimate(m, g, cfg2, isl, osl, c)
        replay[f"{isl}x{osl}_c{c}"] = time.perf_counter() - t0
    return {"load_tables_s": load_s, "step_model_build_s": build_s, "step_100k_s": step_s,
            **{f"replay_{k}_s": v for k, v in replay.items()}}  # fmt: skip


def fidelity(workers: int, csv: str | None, refit: bool, split: str) -> None:
    from koi.perf.fidelity import fidelity_report, write_overheads

    t0 = time.perf_counter()
    rep = fidelity_report(workers=workers, refit=refit, split=split)
    took = time.perf_counter() - t0
    if refit and split == "hash":
        path = write_overheads(rep.fitted)
        print(f"wrote {path}")
    if rep.fitted:
        print("fitted overheads:", json.dumps(rep.fitted, indent=1))
    print(f"replayed {len(rep.rows)} rows in {took:.1f}s (split={split})")
    for name, fig in rep.summary.items():
        if fig.get("n"):
            keys = ("ttft_median", "ttft_p90", "tpot_median", "tpot_p90")
            print(f"{name:22s} n={fig['n']:4d} " + " ".join(f"{k}={fig[k]:6.1f}%" for k in keys if k in fig))
        else:
            print(f"{name:22s} n={fig.get('n', 0)}")
    groups = rep.rows[rep.rows["error"] == ""].groupby(["model", "system", "backend", "precision"])
    table = groups.agg(
        n=("id", "size"), ttft_err=("ttft_err_pct", "median"), tpot_err=("tpot_err_pct", "median"),
        ttft_meas=("ttft_ms", "median"), ttft_pred=("pred_ttft_ms", "median"),
    )  # fmt: skip
    print(table.round(1).to_string())
    if csv:
        rep.rows.to_csv(csv, index=False)
        print(f"per-row table: {csv}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--fidelity", action="store_true")
    ap.add_argument(
        "--fit", action="store_true", help="refit the engine overheads on the fit split and store them"
    )
    ap.add_argument("--split", default="hash", choices=["hash", "family"])
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    if args.speed or not (args.fidelity or args.fit):
        for k, v in speed().items():
            print(f"{k:32s} {v:8.4f}")
    if args.fidelity or args.fit:
        fidelity(args.workers, args.csv, args.fit, args.split)


if __name__ == "__main__":
    main()
