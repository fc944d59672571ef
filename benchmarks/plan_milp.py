"""Joint-selector MILP benchmarks (issue 6): ``python benchmarks/plan_milp.py [--json] [--analytic]``.

1,000 jobs × 30 candidates × 40 environments (target: gap ≤ 1% within 10 s) and a 25-job,
400-GPU snapshot (target: proven optimal). See :mod:`koi.planning.bench`.
"""

from __future__ import annotations

import json
import sys

from koi.planning.bench import run

if __name__ == "__main__":
    pred = "analytic" if "--analytic" in sys.argv else "surrogate"
    result = run(["milp_small", "milp_large"], pred)
    if "--json" in sys.argv:
        print(json.dumps(result, indent=2, default=str))
    else:
        for k, v in result.items():
            print(k, v)
