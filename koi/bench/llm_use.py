"""What a language-model planner's run used of its model: tokens, dollars, and whose plans it committed.

A benchmark row of an LLM policy means little without the model behind it and how often the
model's plan, rather than the fallback, was the tick's proposal: a 135M model that never writes a
usable plan scores as its fallback does. This reads the per-tick stage outputs the planners
already store — ``S4_llm/a<k>`` (the LLM-only planner: status ``parsed`` or ``malformed`` and the
call's usage) and ``S4_rlm/a<k>`` (Koi's RLM planner: the report with ``chosen`` = −1 when the
deterministic anchor won) — and sums them over the run.

Choices: a tick counts once, by its last attempt (a retried S4 after a rejected plan replaces the
first proposal); usage sums every attempt (every call was paid for). A scripted model (the
offline ``koi-scripted`` policy) is reported the same way, with the usage it reports.
"""

from __future__ import annotations

import contextlib
from typing import Any

from pydantic import Field

from koi.agent.llm import Usage
from koi.domain.common import KoiModel


class LlmUse(KoiModel):
    """One run's use of its language model (``RunMeta.llm``)."""

    model: str = Field(default="", description="the model's name as configured (KOI_LLM_MODEL)")
    ticks: int = Field(default=0, description="ticks with a stored LLM planner report")
    model_plans: int = Field(default=0, description="ticks whose S4 proposal is the model's plan")
    cut_plans: int = Field(default=0, description="of the model's plans, those kept from a reply cut at the token "
                                                   "cap (its actions written in full; LLM-only)")
    salvaged_plans: int = Field(default=0, description="of the model's plans, those kept in part after the repair "
                                                        "turn failed too (jobs with a problem dropped; LLM-only)")
    fallback_plans: int = Field(default=0, description="ticks whose proposal is the fallback (keep/defer, or the "
                                                       "deterministic anchor for the RLM planner)")
    caps: dict[str, float] = Field(default_factory=dict, description="the bounds the planner ran under (its "
                                                                     "last report's; across runs, the agreed ones)")
    decoding: str = Field(default="", description="how the LLM-only planner's replies were decoded: none (free "
                                                 "text), json_schema or json_object (constrained to the plan's "
                                                 "schema); empty for the RLM planner")
    usage: Usage = Field(default_factory=Usage)

    @property
    def model_share(self) -> float:
        return self.model_plans / self.ticks if self.ticks else 0.0

    def merge(self, other: LlmUse) -> LlmUse:
        names = sorted({n for n in (self.model, other.model) if n})
        agreed = {k: v for k, v in self.caps.items() if other.caps.get(k) == v}
        decodings = sorted({d for d in (self.decoding, other.decoding) if d})
        return LlmUse(model=",".join(names), caps=agreed, decoding=",".join(decodings), ticks=self.ticks + other.ticks,
                      model_plans=self.model_plans + other.model_plans, cut_plans=self.cut_plans + other.cut_plans,
                      salvaged_plans=self.salvaged_plans + other.salvaged_plans,
                      fallback_plans=self.fallback_plans + other.fallback_plans, usage=self.usage.merge(other.usage))


def _attempt(stage: str, prefix: str) -> int | None:
    """k of ``<prefix>/a<k>`` (not the per-trajectory ``…/a<k>/t<i>`` rows), else None."""
    parts = stage.split("/")
    if len(parts) != 2 or parts[0] != prefix or not parts[1].startswith("a") or not parts[1][1:].isdigit():
        return None
    return int(parts[1][1:])


def tick_llm_use(rows: list[Any]) -> LlmUse | None:
    """One tick's use from its stage-output rows (anything with ``stage`` and ``payload``); None if no report."""
    usage = Usage()
    # (attempt, model's plan?, model, caps, decoding, cut?, salvaged?)
    last: tuple[int, bool, str, dict[str, float], str, bool, bool] | None = None
    for row in rows:
        stage, payload = str(row.stage), row.payload or {}
        if not isinstance(payload, dict):
            continue
        for prefix in ("S4_llm", "S4_rlm"):
            k = _attempt(stage, prefix)
            if k is None:
                continue
            # a report whose usage does not validate still says whose plan it was
            with contextlib.suppress(ValueError):
                usage = usage.merge(Usage.model_validate(payload.get("usage") or {}))
            if prefix == "S4_llm":
                mine = payload.get("status") == "parsed"
            else:
                mine = int(payload.get("chosen", -1)) >= 0
            if last is None or k >= last[0]:
                caps = payload.get("caps")
                last = (k, mine, str(payload.get("model") or ""),
                        {str(c): float(v) for c, v in caps.items() if isinstance(v, int | float)}
                        if isinstance(caps, dict) else {},
                        str(payload.get("decoding") or "") if prefix == "S4_llm" else "",
                        mine and payload.get("cut") is True, mine and payload.get("salvaged") is True)
    if last is None:
        return None
    return LlmUse(model=last[2], caps=last[3], decoding=last[4], ticks=1, model_plans=int(last[1]),
                  cut_plans=int(last[5]), salvaged_plans=int(last[6]), fallback_plans=int(not last[1]), usage=usage)


def run_llm_use(session: Any, cluster_id: str, n_ticks: int) -> LlmUse | None:
    """The whole run's use (ticks 0 … n_ticks − 1); None when no tick has an LLM planner report."""
    from itertools import groupby

    from koi.store.repos.stages import list_stage_outputs_like

    rows = [r for r in list_stage_outputs_like(session, cluster_id, "S4_llm", "S4_rlm") if 0 <= r.tick < n_ticks]
    total: LlmUse | None = None
    for _tick, group in groupby(rows, key=lambda r: r.tick):
        one = tick_llm_use(list(group))
        if one is not None:
            total = one if total is None else total.merge(one)
    return total
