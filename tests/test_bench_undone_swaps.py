"""benchmarks/undone_swaps.py: a swap the next tick reverses to the GPU count before it is counted; other churn is not."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "undone_swaps.py"
_SPEC = importlib.util.spec_from_file_location("undone_swaps", _PATH)
us = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(us)


def tick(gpus: dict[str, int], actions: dict[str, str] | None = None) -> dict:
    return {"gpus_by_job": {j: {"H100": n} for j, n in gpus.items()}, "actions": actions or {}}


TRACE = [
    tick({"a": 96, "b": 8}),
    tick({"a": 112, "b": 8}, {"a": "swap"}),  # a: 96 -> 112 ...
    tick({"a": 96, "b": 16}, {"a": "swap", "b": "swap"}),  # ... -> 96: undone; b grows
    tick({"a": 112, "b": 24}, {"a": "swap", "b": "swap"}),  # a: undone again (112 -> 96 -> 112); b grows again
    tick({"a": 112, "b": 24}),
    tick({"a": 112, "b": 16}, {"b": "swap"}),  # b shrinks one tick after a keep: not an undo
]


def test_only_a_swap_reversed_by_the_next_ticks_swap_counts():
    assert us.undone_swaps(TRACE) == {"a": 2}
    assert us.undone_swaps([]) == {}


def test_the_script_reads_cached_runs(tmp_path):
    run = tmp_path / "seed0-x.json"
    run.write_text(json.dumps({"metrics": {"swaps": 6}, "trace": TRACE}))
    out = subprocess.run([sys.executable, str(_PATH), str(run), "--json"], check=True, capture_output=True, text=True)
    rows = json.loads(out.stdout)
    assert rows == [{"run": str(run), "swaps": 6, "undone": 2, "by_job": {"a": 2}}]
