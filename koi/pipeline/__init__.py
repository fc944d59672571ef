"""The tick pipeline: S0–S6 as stage functions with persistence, shared by Temporal and benchmarks.

Public API::

    from koi.pipeline import Runtime, run_tick, run_ticks

    rt = Runtime(engine=engine, world=InProcessWorldProvider(create=...), proposers={...})
    result = run_tick(rt, "koi-dev", 3, proposer="deterministic")   # -> TickResult
    results = run_ticks(rt, "bench-1", 20, jobs=scenario_jobs)         # ensure world, tick, advance

- :mod:`koi.pipeline.messages`: the small summaries every stage returns (pydantic only,
  passed through the workflow sandbox); :class:`TickResult` is the tick's outcome
  (``committed`` or ``fallback`` with a reason).
- :mod:`koi.pipeline.stages`: ``sync_jobs``, ``ensure_world``, ``s0_snapshot`` …
  ``s5_validate_plan``, ``finish_tick``, ``advance_world`` and :mod:`koi.pipeline.deploy`:
  ``s6_deploy``, ``compensate_keep_all`` — ``stage(runtime, input) -> summary``; the
  Temporal activities are thin wrappers.
- :mod:`koi.pipeline.runner`: :func:`run_tick` / :func:`run_ticks`, the in-process
  runner with the TickWorkflow's semantics (one repair round, keep-all on any failure).
- :mod:`koi.pipeline.world`: where the world lives (checkpoints in the store, or one
  object in this process) and :mod:`koi.pipeline.fencing`: the cluster lock and fence.

Imports are lazy so that ``koi.pipeline.messages`` stays light for the workflow sandbox.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "CheckpointWorldProvider", "InProcessWorldProvider", "ProposeContext", "Runtime", "TickOutcome",
    "TickResult", "Verdict", "run_tick", "run_ticks",
]

_WHERE = {
    "Runtime": "koi.pipeline.runtime",
    "ProposeContext": "koi.pipeline.runtime",
    "Verdict": "koi.pipeline.runtime",
    "run_tick": "koi.pipeline.runner",
    "run_ticks": "koi.pipeline.runner",
    "TickResult": "koi.pipeline.messages",
    "TickOutcome": "koi.pipeline.messages",
    "CheckpointWorldProvider": "koi.pipeline.world",
    "InProcessWorldProvider": "koi.pipeline.world",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'koi.pipeline' has no attribute {name!r}")
