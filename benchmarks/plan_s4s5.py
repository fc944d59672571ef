"""Full deterministic S4 + S5 benchmarks (issue 6): ``python benchmarks/plan_s4s5.py [--json] [--analytic]``.

25 jobs on 400 GPUs (target ≤ 2 s) and 1,000 jobs on 10,000 GPUs (target ≤ 60 s). See
:mod:`koi.planning.bench`; timings are wall and CPU seconds with the load average.
"""

from __future__ import annotations

import json
import sys

from koi.planning.bench import run

if __name__ == "__main__":
    pred = "analytic" if "--analytic" in sys.argv else "surrogate"
    result = run(["s4s5_small", "s4s5_large"], pred)
    if "--json" in sys.argv:
        print(json.dumps(result, indent=2, default=str))
    else:
        for k, v in result.items():
            print(k, v)
