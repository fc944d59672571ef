"""Reading what the model wrote: code blocks, a ``FINAL_VAR(name)`` line, and the plan JSON.

Reply format (RLM style, model-agnostic: no native tool calling, no JSON mode):

- every fenced block tagged ``python``, ``py``, ``repl`` or untagged is code for the
  REPL, run in order (the turn stops at the first block that fails, so a later block
  never runs on the debris of an earlier one);
- a plan is committed by *calling* ``FINAL_VAR(plan)`` inside code. A line
  ``FINAL_VAR(name)`` on its own in the reply text, outside any block, also commits: the
  parent asks the REPL for the variable ``name`` after the turn's code ran. Text the
  code *prints* is never parsed, so printing ``FINAL_VAR(...)`` or a fake protocol line
  commits nothing;
- a fenced ``json`` block holding an object with ``"actions"`` is taken as a plan
  written out directly (weak models often do this); it goes through the same parsing,
  shape check and validation as any other plan.

:func:`parse_plan` turns committed JSON into a domain :class:`~koi.domain.Plan` and
shape-checks it against the snapshot: known job ids, one action per job, ladders where
the action type needs one. It reports every problem at once (the repair prompt shows
them all); it does not judge capacity, feasibility or risk — that is validation's job
(C0–C7). :func:`salvage_plan` is its lenient twin for a last attempt: the same reading,
keeping the jobs written without a problem.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from koi.domain import Action, ActionType, ClusterSnapshot, Issuer, Plan

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
_FINAL_LINE = re.compile(r"^[ \t]*FINAL_VAR\(\s*['\"]?([A-Za-z_][A-Za-z0-9_]*)['\"]?\s*\)[ \t]*$", re.MULTILINE)
CODE_TAGS = frozenset({"", "python", "py", "python3", "repl"})

#: Largest plan (characters of JSON) the parser reads.
MAX_PLAN_CHARS = 1 << 20
MAX_ACTIONS = 2000


@dataclass
class ParsedReply:
    code_blocks: list[str] = field(default_factory=list)
    final_var: str | None = None  # a FINAL_VAR(name) line in the text
    json_plans: list[str] = field(default_factory=list)  # ```json blocks with "actions"

    @property
    def empty(self) -> bool:
        return not self.code_blocks and self.final_var is None and not self.json_plans


def parse_reply(text: str) -> ParsedReply:
    out = ParsedReply()
    outside: list[str] = []
    pos = 0
    for m in _FENCE.finditer(text):
        outside.append(text[pos:m.start()])
        pos = m.end()
        tag, body = m.group(1).strip().lower(), m.group(2)
        if tag in CODE_TAGS:
            if body.strip():
                out.code_blocks.append(body)
        elif tag == "json" and '"actions"' in body:
            out.json_plans.append(body)
    outside.append(text[pos:])
    # An unterminated fence (a reply cut at max_tokens): take the rest as code.
    rest = "".join(outside)
    if not out.code_blocks and rest.count("```") == 1:
        head, _, tail = rest.partition("```")
        first, _, body = tail.partition("\n")
        if first.strip().lower() in CODE_TAGS and body.strip():
            out.code_blocks.append(body)
            rest = head
    finals = _FINAL_LINE.findall(rest)
    if finals:
        out.final_var = finals[-1]
    return out


class PlanParseError(ValueError):
    """The committed value is not a well-formed plan; ``problems`` lists each reason."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("; ".join(problems[:8]) + (f" (+{len(problems) - 8} more)" if len(problems) > 8 else ""))


def _loc(err: dict[str, Any]) -> str:
    return ".".join(str(p) for p in err.get("loc", ()))


def _pydantic_problems(prefix: str, exc: ValidationError, limit: int = 6) -> list[str]:
    out = []
    for err in exc.errors()[:limit]:
        where = _loc(err)
        out.append(f"{prefix}{('.' + where) if where else ''}: {err.get('msg', 'invalid')}")
    return out


def _no_duplicate_keys(problems: list[str]) -> Any:
    """A ``json.loads`` hook that builds each object and names a key written twice in it (``json.loads``
    keeps the last silently: ``{"type": "keep", "type": "swap"}`` would be a swap nobody can see)."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                problems.append(f"key {k!r} written twice in one object")
            out[k] = v
        return out

    return hook


@dataclass
class _ReadPlan:
    """A plan read action by action: what is wrong with it as a whole (``fatal``: no plan can be had from
    it), what is wrong but harmless (``notes``: fields the plan does not use), and each action's problem
    with the job it names (None when no job id could be read)."""

    fatal: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    actions: list[Action] = field(default_factory=list)  # the first well-formed action of each known job
    action_problems: list[tuple[str | None, str]] = field(default_factory=list)
    rationale: str = ""

    @property
    def problems(self) -> list[str]:
        return [*self.fatal, *self.notes, *(p for _job, p in self.action_problems)]


def _read_plan(value: str | dict[str, Any] | list[Any], snapshot: ClusterSnapshot, default_issuer: Issuer) -> _ReadPlan:
    out = _ReadPlan()
    if isinstance(value, str):
        if len(value) > MAX_PLAN_CHARS:
            raise PlanParseError([f"plan too large: {len(value)} characters"])
        try:
            data: Any = json.loads(value, object_pairs_hook=_no_duplicate_keys(out.fatal))
        except (ValueError, RecursionError) as exc:
            raise PlanParseError([f"not JSON: {exc}"]) from None
    else:
        data = value
    if isinstance(data, list):
        data = {"actions": data}
    if not isinstance(data, dict):
        raise PlanParseError([f"a plan is an object with 'actions', got {type(data).__name__}"])
    actions = data.get("actions")
    if not isinstance(actions, list):
        raise PlanParseError(["a plan needs 'actions': a list of actions"])
    if len(actions) > MAX_ACTIONS:
        raise PlanParseError([f"too many actions: {len(actions)}"])
    extra = sorted(set(data) - {"actions", "tick_rationale", "tick", "cluster_id", "proposer"})
    if extra:
        out.notes.append(f"unknown plan fields {extra} (allowed: tick_rationale, actions)")
    rationale = data.get("tick_rationale", "")
    if not isinstance(rationale, str):
        out.notes.append("tick_rationale must be a string")
        rationale = ""
    out.rationale = rationale
    known = {js.job.job_id: js for js in snapshot.jobs}
    seen: set[str] = set()
    for i, raw in enumerate(actions):
        where = f"actions[{i}]"
        if not isinstance(raw, dict):
            out.action_problems.append((None, f"{where}: an action is an object, got {type(raw).__name__}"))
            continue
        raw = dict(raw)
        job_id = raw.get("job_id") if isinstance(raw.get("job_id"), str) else None
        if job_id is not None:
            where = f"actions[{i}] (job {job_id})"
        raw.setdefault("issuer", default_issuer.value)
        if raw.get("ladder") == []:
            raw["ladder"] = None
        try:
            action = Action.model_validate(raw)
        except ValidationError as exc:
            out.action_problems += [(job_id, p) for p in _pydantic_problems(where, exc)]
            continue
        if action.job_id not in known:
            out.action_problems.append((action.job_id, f"{where}: unknown job_id {action.job_id!r}"))
            continue
        if action.job_id in seen:
            out.action_problems.append(
                (action.job_id, f"{where}: a second action for job {action.job_id!r} (one action per job)"))
            continue
        seen.add(action.job_id)
        out.actions.append(action)
    return out


def parse_plan(
    value: str | dict[str, Any] | list[Any],
    snapshot: ClusterSnapshot,
    *,
    proposer: str = "rlm",
    default_issuer: Issuer = Issuer.ROOT,
) -> Plan:
    """Committed JSON (text or data) -> :class:`Plan`, or :class:`PlanParseError` listing every problem.

    Accepts the spec's shape ``{"tick_rationale", "actions": [...]}`` and a bare list of
    actions. A key written twice in one object of the JSON text is a problem, not the silent
    overwrite ``json.loads`` does. ``tick`` and ``cluster_id`` come from the snapshot, never from the model.
    Omitted jobs are *not* filled in here (see :func:`koi.agent.backend.complete`).
    """
    read = _read_plan(value, snapshot, default_issuer)
    if read.problems:
        raise PlanParseError(read.problems)
    return Plan(tick=snapshot.tick, cluster_id=snapshot.cluster_id, actions=read.actions,
                tick_rationale=read.rationale[:4000], proposer=proposer)


def salvage_plan(
    value: str | dict[str, Any] | list[Any],
    snapshot: ClusterSnapshot,
    *,
    proposer: str = "rlm",
    default_issuer: Issuer = Issuer.ROOT,
) -> tuple[Plan, list[str]]:
    """The part of a plan :func:`parse_plan` refuses that is still the model's word: ``(plan, problems)``.

    For a last attempt, after the repair turn (the strict parse goes first, so the model sees every
    problem once). Each job's action stands alone and a job the plan omits keeps running or keeps
    waiting (white paper), so a problem tied to one job drops **every** action of that job — for a
    job written twice, both: which one the model meant cannot be told — and the other jobs' actions
    stand. An action without a readable job id is dropped by itself; fields the plan does not use are
    ignored. Nothing is repaired or guessed. A problem with the plan as a whole (not JSON, no
    ``actions`` list, a key written twice in one object — that one cannot be tied to an action) still
    raises :class:`PlanParseError`. ``problems`` lists what was dropped and why."""
    read = _read_plan(value, snapshot, default_issuer)
    if read.fatal:
        raise PlanParseError(read.problems)
    bad = {job for job, _p in read.action_problems if job is not None}
    kept = [a for a in read.actions if a.job_id not in bad]
    return (Plan(tick=snapshot.tick, cluster_id=snapshot.cluster_id, actions=kept,
                 tick_rationale=read.rationale[:4000], proposer=proposer), read.problems)


_ACTIONS_OPEN = re.compile(r'"actions"\s*:\s*\[')


def salvage_cut_plan(text: str) -> str | None:
    """The complete actions of a plan reply cut off mid-way (at the token cap), as a closed plan's JSON.

    A reply stopped by ``max_tokens`` ends inside an action: ``{"actions": [{...}, {"job_id": "b",
    "type": "pla``. Each job's action stands alone and the spec gives every job a plan omits a default
    (keep a running job, defer a waiting one), so the actions written in full are a plan that omits
    the rest — nothing of the cut action is guessed. Returns the text of those actions as written,
    closed (so the parser still sees a key written twice); None when no action was complete."""
    m = _ACTIONS_OPEN.search(text)
    if m is None:
        return None
    dec = json.JSONDecoder()
    pos, last = m.end(), None
    while True:
        try:
            _action, i = dec.raw_decode(text, _skip_space(text, pos))
        except ValueError:
            break
        last = i
        i = _skip_space(text, i)
        if text[i:i + 1] != ",":
            break
        pos = i + 1
    if last is None:
        return None
    return '{"actions": ' + text[m.end() - 1:last] + "]}"


def _skip_space(text: str, i: int) -> int:
    while i < len(text) and text[i] in " \t\r\n":
        i += 1
    return i


def keep_defer_plan(snapshot: ClusterSnapshot, proposer: str = "keep-all", rationale: str = "") -> Plan:
    """Every active job keeps its ladder, every pending job waits: the safe state."""
    actions = []
    for js in snapshot.jobs:
        if js.status.value == "active":
            actions.append(Action(job_id=js.job.job_id, type=ActionType.KEEP, tenant_id=js.job.tenant))
        elif js.status.value == "pending":
            actions.append(Action(job_id=js.job.job_id, type=ActionType.DEFER, tenant_id=js.job.tenant))
    return Plan(tick=snapshot.tick, cluster_id=snapshot.cluster_id, actions=actions,
                tick_rationale=rationale, proposer=proposer)


def fill_omitted(plan: Plan, snapshot: ClusterSnapshot) -> Plan:
    """Omitted active jobs KEEP, omitted pending jobs DEFER (whitepaper: "any omitted jobs
    automatically default to KEEP (running) or DEFER (waiting)"). Used when the planning
    room's ``complete_plan`` is not available."""
    have = set(plan.job_ids)
    extra = [a for a in keep_defer_plan(snapshot).actions if a.job_id not in have]
    if not extra:
        return plan
    for a in extra:
        a.rationale = "omitted by the planner: default"
    return plan.model_copy(update={"actions": [*plan.actions, *extra]})
