"""Simulator fidelity (issue 3): ``python benchmarks/sim_fidelity.py [--json] [--step S] [--csv out.csv]``.

Replays every dense H100/H200 aggregated row of aiconfigurator-core's measured
``silicon_sample.csv`` as a fixed-concurrency closed loop through the simulator's own
replica engine (:mod:`koi.sim.fidelity`) and reports median and 90th-percentile absolute
% error of mean TTFT and mean TPOT — per split ('holdout' rows were never used to fit any
constant), per backend and per model. Same as ``koi sim fidelity``.
"""

from __future__ import annotations

import argparse
import json

from koi.sim.fidelity import fidelity_rows, replay, summarize

if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--step", type=float, default=1.0)
    ap.add_argument("--csv", help="write the per-row results here")
    ap.add_argument("--stagger", action="store_true", help="clients start spread over one request lifetime")
    args = ap.parse_args()
    res = replay(fidelity_rows(), step_s=args.step, stagger=args.stagger)
    if args.csv:
        res.to_csv(args.csv, index=False)
    summary = {"step_s": args.step, "stagger": args.stagger, **summarize(res)}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        for k, v in summary.items():
            print(k, v)
