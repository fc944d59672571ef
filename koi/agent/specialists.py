"""Per-job specialists: sub-model calls with bounded JSON output, inside a budget slice.

Whitepaper, "The Agentic Planner" and overview §2.6: after the root builds the budget
book, per-job specialists propose *place, keep, swap or defer* within their slice and
report fitness (starved, happy, over-provisioned, blocked); the root rescores the
proposals with σ and reconciles them through the joint selector. Lifecycle actions
(preempt, resume, retry, terminate, diagnose) are the root's alone.

What a specialist sees: the job (model, workload, SLO, status, running ladder), its
slice, the mechanisms applicable to it with their confidence, the backward why-walk of
its SLO outcomes, and up to ``k`` scored candidate ladders (``candidates[i]``). It
answers ``{"proposals": [{"type", "candidate" | "ladder", "rationale"}], "fitness",
"notes"}``.

Bounded output: ``max_tokens`` on the call, at most ``max_proposals`` proposals read,
replies over 16 KB refused. One retry: a reply that is not that JSON gets one more call
with the error; a second failure leaves the job to the deterministic specialist (its best
candidate by σ when that beats keep/defer), recorded as ``source = "deterministic"``.

Enforced in code (never trusted to the prompt): a proposal's type must be one of place,
keep, swap, defer and consistent with the job's status (place/defer for pending,
keep/swap for active); a ladder outside the slice's pools is refused; the issuer is
``specialist``. Proposals are data for the root: nothing here changes the plan.

Fitness is reported twice: the model's word (``reported_fitness``) and a deterministic
one computed by the backend from the job's candidates (``fitness``); the root reconciles
on the deterministic one. Choice where the spec is vague: "blocked" = no feasible
candidate inside the slice; "starved" = a pending job that has one, or an active job
whose running ladder leaves demand unserved or breaches its SLO risk bound;
"over-provisioned" = an active job whose running ladder has more than twice the
capacity its demand needs; "happy" otherwise.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from koi.agent.llm import ChatMessage, ChatModel, LLMError
from koi.agent.prompts import specialist_messages, specialist_retry
from koi.logging import get_logger

log = get_logger("koi.agent.specialists")

Fitness = Literal["starved", "happy", "over-provisioned", "blocked"]
SPECIALIST_TYPES = ("place", "keep", "swap", "defer")
MAX_REPLY_CHARS = 16_384


class SpecialistProposal(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str
    candidate: int | None = None
    ladder: list[dict[str, Any]] | None = None
    rationale: str = Field(default="", max_length=2000)


class SpecialistAnswer(BaseModel):
    model_config = ConfigDict(extra="ignore")

    proposals: list[SpecialistProposal] = Field(default_factory=list)
    fitness: Fitness | None = None
    notes: str = Field(default="", max_length=4000)


_OBJ = re.compile(r"\{.*\}", re.DOTALL)


def parse_answer(text: str, max_proposals: int) -> SpecialistAnswer:
    """The JSON object in a reply (a fenced block or the first {...} span), validated."""
    if len(text) > MAX_REPLY_CHARS:
        raise ValueError(f"reply too long ({len(text)} characters)")
    body = text.strip()
    fence = re.search(r"```(?:json)?\s*\n(.*?)```", body, re.DOTALL)
    if fence:
        body = fence.group(1)
    else:
        m = _OBJ.search(body)
        if m:
            body = m.group(0)
    try:
        data = json.loads(body)
    except ValueError as exc:
        raise ValueError(f"not a JSON object: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("the answer must be a JSON object")
    if isinstance(data.get("fitness"), str):
        data["fitness"] = data["fitness"].strip().lower().replace("_", "-").replace(" ", "-")
    try:
        ans = SpecialistAnswer.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ValueError(f"{'.'.join(str(p) for p in first.get('loc', ()))}: {first.get('msg')}") from None
    ans.proposals = ans.proposals[:max_proposals]
    return ans


def ask_specialist(
    model: ChatModel,
    brief: dict[str, Any],
    *,
    max_tokens: int = 800,
    max_proposals: int = 3,
    seed: int | None = None,
) -> tuple[SpecialistAnswer | None, str, int]:
    """(answer or None, error text, calls made): one call, and one retry on a bad answer."""
    system, user = specialist_messages(brief, max_proposals=max_proposals)
    msgs = [ChatMessage(role="system", content=system), ChatMessage(role="user", content=user)]
    error = ""
    calls = 0
    for attempt in range(2):
        calls += 1
        try:
            reply = model.complete(msgs, temperature=0.0, max_tokens=max_tokens, seed=seed)
        except LLMError as exc:
            error = f"endpoint failed: {exc}"
            break
        try:
            return parse_answer(reply.content, max_proposals), "", calls
        except ValueError as exc:
            error = str(exc)
            if attempt == 0:
                msgs = [*msgs, ChatMessage(role="assistant", content=reply.content[:MAX_REPLY_CHARS]),
                        ChatMessage(role="user", content=specialist_retry(error))]
    return None, error, calls


def proposals_to_actions(
    answer: SpecialistAnswer,
    *,
    job_id: str,
    tenant: str,
    status: str,
    candidates: list[dict[str, Any]],
    allowed_pools: set[str] | None,
    pool_of: Any,
) -> tuple[list[dict[str, Any]], list[str]]:
    """Spec-shaped action dicts for the job, and the reasons proposals were refused."""
    out: list[dict[str, Any]] = []
    refused: list[str] = []
    for i, p in enumerate(answer.proposals):
        t = p.type.strip().lower()
        where = f"proposal {i}"
        if t not in SPECIALIST_TYPES:
            refused.append(f"{where}: {t!r} is not a specialist action (place, keep, swap, defer; lifecycle is root-only)")
            continue
        if status == "pending" and t not in ("place", "defer"):
            refused.append(f"{where}: a pending job can only be placed or deferred, not {t}")
            continue
        if status == "active" and t not in ("keep", "swap"):
            refused.append(f"{where}: an active job can only be kept or swapped, not {t}")
            continue
        action: dict[str, Any] = {"job_id": job_id, "type": t, "tenant_id": tenant, "issuer": "specialist",
                                  "rationale": p.rationale[:500], "budget_ref": f"slice_{job_id}"}
        if t in ("place", "swap"):
            ladder = None
            if p.candidate is not None:
                if 0 <= p.candidate < len(candidates):
                    ladder = candidates[p.candidate].get("ladder")
                else:
                    refused.append(f"{where}: candidate {p.candidate} does not exist (0..{len(candidates) - 1})")
                    continue
            elif p.ladder:
                ladder = p.ladder
            if not ladder:
                refused.append(f"{where}: a {t} needs a candidate index or a ladder")
                continue
            if allowed_pools is not None:
                outside = [str(pool_of(r)) for r in ladder if pool_of(r) not in allowed_pools]
                if outside:
                    refused.append(f"{where}: ladder outside the job's budget slice (pools {outside})")
                    continue
            action["ladder"] = ladder
        out.append(action)
    return out, refused
