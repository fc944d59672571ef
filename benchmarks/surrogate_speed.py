"""Surrogate batch-API speed (issue 4): ``python benchmarks/surrogate_speed.py [--json] [--png out.png]``.

Times :meth:`koi.surrogate.Surrogate.predict_many` over the catalog's candidate chains (every
instance shape × region × market × TP/PP × dtype × max_num_seqs, repeated to the requested
count) for one online job: the first call (cold: operator tables, step models and tables
built), then warm calls with the capacity search and without it (``with_capacity=False``,
scoring at a fixed load). Target: ≥ 5,000 candidate predictions per second. The figure plots
predictions/s against the number of candidates per call. Same figures as
``koi surrogate speed``. Timings depend on the machine's load (reported).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from koi.surrogate.evaluate import speed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--png", default=None, help="write the figure here (default: KOI_DATA_DIR/reports/surrogate_speed.png)")
    ap.add_argument("--sizes", default="500,1000,2000,5000,10000")
    args = ap.parse_args()
    sizes = [int(x) for x in args.sizes.split(",")]
    rows = []
    for n in sizes:
        r = speed(n)
        r["load_avg_1m"] = round(os.getloadavg()[0], 2)
        rows.append(r)
    out = {"target_per_s": 5000, "runs": rows, "at": time.strftime("%Y-%m-%dT%H:%M:%S")}
    png = args.png
    if png is None:
        from koi.config import get_settings

        d = get_settings().data_dir / "reports"
        d.mkdir(parents=True, exist_ok=True)
        png = str(d / "surrogate_speed.png")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.4, 4.0))
        ns = [r["candidates"] for r in rows]
        ax.plot(ns, [r["warm_per_s"] for r in rows], "o-", label="warm, with capacity search")
        ax.plot(ns, [r["warm_no_capacity_per_s"] for r in rows], "s-", label="warm, fixed load only")
        ax.plot(ns, [r["cold_per_s"] for r in rows], "^--", label="cold (first call)")
        ax.axhline(5000, color="grey", ls=":", label="target 5,000/s")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("candidate chains per call")
        ax.set_ylabel("predictions per second")
        ax.set_title("koi.surrogate predict_many throughput")
        ax.legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(png, dpi=120)
        out["figure"] = png
    except Exception as exc:  # the numbers matter more than the picture
        out["figure_error"] = str(exc)
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for r in rows:
            print(r)
        print("figure:", out.get("figure", out.get("figure_error")))


if __name__ == "__main__":
    main()
