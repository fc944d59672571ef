"""Scripted models: deterministic stand-ins for an LLM, for tests, the demo and the benchmark.

Each policy is a function ``(messages, meta) -> reply text`` usable as
:class:`koi.agent.llm.CallableChatModel` (in-process) or behind the loopback fake
OpenAI server (``tests/fakes/openai_server.py``). They write the same kind of code a
real model writes — REPL blocks calling the tools, then ``FINAL_VAR(plan)`` — so every
path from the reply parser through the sandbox, the tools, parsing and validation is
exercised for real. A conversation's position is read from the messages themselves
(the number of assistant turns, the trajectory index in the tick brief, a repair
prompt), never from hidden state, so a policy behaves the same across processes.

Policies:

- :func:`baseline_policy` — inspects the state, commits the deterministic proposer's
  plan (``propose_baseline()``) after validating it;
- :func:`budget_first_policy` — the spec's flow: budget book, per-job specialists,
  joint selection over their proposals, validate, commit;
- :func:`invalid_policy` — commits a plan that is over capacity and uses a TP (16) that does
  not divide the KV heads, and insists after the repair prompt;
- :func:`keep_or_swap_policy` — trajectory 0 keeps everything, trajectory 1 swaps each
  active job to its best-σ ladder (the selection must pick trajectory 1);
- :func:`bench_policy` — for the benchmark: usually commits the deterministic plan,
  sometimes (seeded) a worse one (a pending job dropped) or an invalid one (repaired
  after the repair prompt), so the bench measures what the safety net costs;
- :func:`hostile_policy` — runs escape attempts turn after turn, then commits the
  baseline (the audit's "the tick still produces a valid plan" check);
- :func:`garbage_policy` — never writes code (the consecutive-error limit).

Specialist calls (the specialist system prompt) are answered by
:func:`specialist_reply`: candidate 0, or keep/defer when there is none.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

from koi.agent.llm import ChatMessage

Policy = Callable[[Sequence[ChatMessage], dict[str, Any]], str]

_TRAJ = re.compile(r"\(trajectory (\d+)\)")


def _py(code: str) -> str:
    return f"```python\n{code.strip()}\n```"


def turn_of(messages: Sequence[ChatMessage]) -> int:
    """The index of the turn being answered (assistant replies so far)."""
    n = sum(1 for m in messages if m.role == "assistant")
    for m in messages:
        mm = re.match(r"\[(\d+) earlier turn\(s\) left out", m.content)
        if m.role == "user" and mm:
            n += int(mm.group(1))
    return n


def trajectory_of(messages: Sequence[ChatMessage]) -> int:
    for m in messages:
        if m.role == "user":
            mm = _TRAJ.search(m.content)
            if mm:
                return int(mm.group(1))
    return 0


def repairing(messages: Sequence[ChatMessage]) -> bool:
    last = next((m for m in reversed(messages) if m.role == "user"), None)
    return last is not None and "was not accepted" in last.content


def is_specialist(messages: Sequence[ChatMessage]) -> bool:
    return any("You are the specialist for ONE job" in m.content for m in messages if m.role in ("system", "user"))


def specialist_reply(messages: Sequence[ChatMessage], meta: dict[str, Any]) -> str:
    user = next((m.content for m in messages if m.role == "user" and "Job and context" in m.content), "")
    try:
        brief = json.loads(user.split("Job and context:", 1)[1])
    except (IndexError, ValueError):
        brief = {}
    status = brief.get("status", "pending")
    if brief.get("candidates"):
        t = "swap" if status == "active" else "place"
        props = [{"type": t, "candidate": 0, "rationale": "the best-scored candidate"}]
        fitness = "starved" if status == "pending" else "happy"
    else:
        props = [{"type": "keep" if status == "active" else "defer", "candidate": None, "rationale": "nothing fits"}]
        fitness = "blocked"
    return json.dumps({"proposals": props, "fitness": fitness, "notes": "scripted specialist"})


def _with_specialists(policy: Policy) -> Policy:
    def wrapped(messages: Sequence[ChatMessage], meta: dict[str, Any]) -> str:
        if is_specialist(messages):
            return specialist_reply(messages, meta)
        return policy(messages, meta)

    wrapped.__name__ = getattr(policy, "__name__", "policy")
    wrapped.__doc__ = policy.__doc__
    return wrapped


def _program(name: str) -> str:
    """A REPL program the scripted models send, from ``koi/agent/programs/<name>.repl``.

    They are data — code a model writes for the sandbox, where ``print`` is how it sees
    results — not library code, so they live beside the module rather than in it."""
    return "\n" + resources.files("koi.agent").joinpath("programs", f"{name}.repl").read_text(encoding="utf-8")


INSPECT = _program("inspect")

COMMIT_BASELINE = _program("commit_baseline")

INVALID = _program("invalid")

SWAP_BEST = _program("swap_best")

KEEP_ALL = _program("keep_all")

BUDGET_FIRST = _program("budget_first")

DROP_ONE = _program("drop_one")


@_with_specialists
def baseline_policy(messages: Sequence[ChatMessage], meta: dict[str, Any]) -> str:
    """Inspect, then commit the deterministic plan."""
    t = turn_of(messages)
    if t == 0:
        return "Let me look at the cluster first.\n" + _py(INSPECT)
    return "The deterministic plan is a good start; I validate it and commit.\n" + _py(COMMIT_BASELINE)


@_with_specialists
def budget_first_policy(messages: Sequence[ChatMessage], meta: dict[str, Any]) -> str:
    """Budget book → specialists → joint selection → commit."""
    if turn_of(messages) == 0:
        return _py(INSPECT)
    if repairing(messages):
        return _py(COMMIT_BASELINE)
    return "Budget first, then the specialists.\n" + _py(BUDGET_FIRST)


@_with_specialists
def invalid_policy(messages: Sequence[ChatMessage], meta: dict[str, Any]) -> str:
    """Over capacity and a TP that does not divide the heads; insists after the repair prompt."""
    return "I want the biggest deployment possible.\n" + _py(INVALID)


@_with_specialists
def keep_or_swap_policy(messages: Sequence[ChatMessage], meta: dict[str, Any]) -> str:
    """Trajectory 0 keeps everything; trajectory 1 swaps active jobs to their best-σ ladders."""
    if trajectory_of(messages) == 0:
        return _py(KEEP_ALL)
    return _py(SWAP_BEST)


def bench_policy_factory(p_worse: float = 0.15, p_invalid: float = 0.15) -> Policy:
    """A benchmark policy: the deterministic plan most of the time, sometimes worse or invalid."""

    @_with_specialists
    def bench_policy(messages: Sequence[ChatMessage], meta: dict[str, Any]) -> str:
        t = turn_of(messages)
        if t == 0:
            return _py(INSPECT)
        if repairing(messages):
            return "Fixing it with the validated baseline.\n" + _py(COMMIT_BASELINE)
        seed = meta.get("seed")
        rng = random.Random(int(seed) if seed is not None else 0)
        u = rng.random()
        if u < p_invalid:
            return _py(INVALID)
        if u < p_invalid + p_worse:
            return _py(DROP_ONE)
        return _py(COMMIT_BASELINE)

    return bench_policy


bench_policy = bench_policy_factory()


def hostile_policy_factory(attacks: Sequence[str]) -> Policy:
    """Runs each attack as one turn, then commits the baseline."""

    @_with_specialists
    def hostile_policy(messages: Sequence[ChatMessage], meta: dict[str, Any]) -> str:
        t = turn_of(messages)
        if t < len(attacks):
            return "Trying something.\n" + _py(attacks[t])
        return _py(COMMIT_BASELINE)

    return hostile_policy


def garbage_policy(messages: Sequence[ChatMessage], meta: dict[str, Any]) -> str:
    """Never writes code."""
    return "I think the plan should be good. FINAL ANSWER: deploy everything on H100."


POLICIES: dict[str, Policy] = {
    "baseline": baseline_policy,
    "budget-first": budget_first_policy,
    "invalid": invalid_policy,
    "keep-or-swap": keep_or_swap_policy,
    "bench": bench_policy,
    "garbage": garbage_policy,
}
