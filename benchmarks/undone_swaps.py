"""Swaps the next tick undid: ``python benchmarks/undone_swaps.py RUN.json [RUN.json ...]``.

Each RUN.json is a cached benchmark run (``D/<scenario>/runs/<policy>/seedN-*.json``). A job's swap at tick t is
*undone* when the job is swapped again at t + 1 back to the GPU count it had before t (A → B → A): the churn of a
planner that reads the first swap's handover as the new ladder's fault (``benchmarks/results/homo-12h/README.md``,
the A-B-A cycle of agent-235b). Prints one line per run — swaps, undone swaps, the jobs with the most — or, with
``--json``, one document.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path


def undone_swaps(trace: Sequence[dict]) -> Counter[str]:
    """job id -> how many of its swaps the next tick undid (A → B → A in the job's GPU count)."""
    out: Counter[str] = Counter()
    jobs = sorted({j for t in trace for j in t.get("gpus_by_job", {})})
    for j in jobs:
        gpus = [sum(t.get("gpus_by_job", {}).get(j, {}).values()) for t in trace]
        swap = [(t.get("actions") or {}).get(j) == "swap" for t in trace]
        for i in range(1, len(trace) - 1):
            if swap[i] and swap[i + 1] and gpus[i] != gpus[i - 1] and gpus[i + 1] == gpus[i - 1]:
                out[j] += 1
    return out


def summarize(path: Path) -> dict:
    run = json.loads(path.read_text())
    undone = undone_swaps(run.get("trace", []))
    return {"run": str(path), "swaps": run.get("metrics", {}).get("swaps"), "undone": sum(undone.values()),
            "by_job": dict(undone.most_common())}  # fmt: skip


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("runs", nargs="+", type=Path, help="cached run JSON files")
    ap.add_argument("--json", action="store_true", help="one JSON document on stdout")
    args = ap.parse_args()
    rows = [summarize(p) for p in args.runs]
    if args.json:
        print(json.dumps(rows, indent=2))
    else:
        for r in rows:
            top = ", ".join(f"{j} {n}" for j, n in list(r["by_job"].items())[:4])
            print(f"{r['run']}: {r['swaps']} swaps, {r['undone']} undone ({top or 'none'})")
