"""The RLM planner (S4): a root model that plans by writing Python in a sandboxed REPL.

Whitepaper, "The Agentic Planner"; overview §2.6. The model acts by writing code in a REPL
where the cluster state and the deterministic tools are ordinary functions, and commits
with ``FINAL_VAR(plan)``. It proposes; deterministic code parses, validates (C0–C7),
scores and selects; only S6 changes the fleet.

Public API (imports are lazy, so ``koi.agent.messages`` stays light for workflows)::

    from koi.agent import plan_with_rlm, RlmConfig, RlmProposer, ToolBackend, run_audit

    backend = ToolBackend(snapshot, planning_context)          # the tick's frozen inputs
    plan, report = plan_with_rlm(snapshot, backend, model=model, config=RlmConfig(k_p=1), seed=0)
    runtime.proposers["rlm"] = RlmProposer()                   # S4 of the tick pipeline
    report = run_audit()                                       # the sandbox audit corpus

Modules:

- :mod:`koi.agent.sandbox` — the REPL process: OS isolation (network namespace, chroot,
  uid drop, rlimits, seccomp) plus the interpreter-level policy (AST check, restricted
  builtins, module proxies); JSON-lines channel to the parent;
- :mod:`koi.agent.tools` / :mod:`koi.agent.backend` — the tool registry (validated
  arguments, JSON results) over the planning, scoring and causal rooms; the tools
  themselves are one mixin per family, ``koi.agent.tools_*``;
- :mod:`koi.agent.llm` — any OpenAI-compatible endpoint, system-role folding, tokens and $;
- :mod:`koi.agent.trajectory` — one trajectory (K_MAX turns, wall clock, error limit,
  one repair), :mod:`koi.agent.planner` — K_P trajectories, selection, the S4 proposer;
- :mod:`koi.agent.specialists` — per-job sub-model calls inside a budget slice;
- :mod:`koi.agent.scripted` — deterministic stand-in models (tests, demo, benchmark);
- :mod:`koi.agent.audit_corpus` / :mod:`koi.agent.audit` — escape attempts and their runner;
- :mod:`koi.agent.messages` — the Temporal trajectory's small messages.
"""

from __future__ import annotations

from typing import Any

_WHERE = {
    "plan_with_rlm": "koi.agent.planner",
    "RlmProposer": "koi.agent.planner",
    "RlmReport": "koi.agent.planner",
    "scripted_proposer": "koi.agent.planner",
    "tick_usage": "koi.agent.planner",
    "RlmConfig": "koi.agent.trajectory",
    "TrajectoryReport": "koi.agent.trajectory",
    "TrajectoryRunner": "koi.agent.trajectory",
    "ToolBackend": "koi.agent.backend",
    "Sandbox": "koi.agent.sandbox",
    "SandboxLimits": "koi.agent.sandbox",
    "OpenAIChatModel": "koi.agent.llm",
    "CallableChatModel": "koi.agent.llm",
    "Usage": "koi.agent.llm",
    "run_audit": "koi.agent.audit",
}

__all__ = sorted(_WHERE)


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module 'koi.agent' has no attribute {name!r}")
