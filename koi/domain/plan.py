"""Actions and plans, in the JSON shape of the whitepaper's "The Agentic Planner" example."""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any

from pydantic import Field, field_serializer, field_validator, model_validator

from koi.domain.chain import Ladder
from koi.domain.common import KoiModel


class ActionType(StrEnum):
    PLACE = "place"
    KEEP = "keep"
    SWAP = "swap"
    DEFER = "defer"
    PREEMPT = "preempt"
    RESUME = "resume"
    RETRY = "retry"
    TERMINATE = "terminate"
    DIAGNOSE = "diagnose"


#: Actions that carry a new ladder and so contribute σ to Φ(P) (whitepaper, "The Cluster Objective").
LADDER_ACTIONS = frozenset({ActionType.PLACE, ActionType.SWAP, ActionType.RETRY, ActionType.RESUME})
#: Lifecycle actions only the root planner may issue (C7).
ROOT_ONLY_ACTIONS = frozenset(
    {ActionType.PREEMPT, ActionType.RESUME, ActionType.RETRY, ActionType.TERMINATE, ActionType.DIAGNOSE}
)


class Issuer(StrEnum):
    ROOT = "root"
    SPECIALIST = "specialist"


class Action(KoiModel):
    job_id: str = Field(min_length=1)
    type: ActionType
    tenant_id: str | None = None
    ladder: Ladder | None = None
    target_tps: float | None = Field(default=None, ge=0)
    mechanism_id: str | None = None
    swap_reason: str | None = None
    budget_ref: str | None = None
    route_weights: dict[str, float] | None = Field(
        default=None,
        description="a keep only: the gateway weight of each running rank (rank id -> the planner's per-replica "
                    "SLO capacity, req/s) when its learned capacities moved since the ladder was deployed; S6 "
                    "re-weighs the job's router without touching a replica (koi.planning.gateway)",
    )
    rationale: str = ""
    issuer: Issuer = Issuer.ROOT

    @field_validator("type", mode="before")
    @classmethod
    def _type(cls, v: Any) -> Any:
        if isinstance(v, str):
            s = v.strip().lower()
            if s not in ActionType._value2member_map_:
                allowed = ", ".join(a.value for a in ActionType)
                raise ValueError(f"unknown action type {v!r}; expected one of: {allowed}")
            return s
        return v

    @model_validator(mode="after")
    def _ladder(self) -> Action:
        if self.type in LADDER_ACTIONS and self.ladder is None:
            raise ValueError(f"a {self.type.value} action needs a ladder")
        if self.type not in LADDER_ACTIONS and self.ladder is not None:
            raise ValueError(f"a {self.type.value} action carries no ladder")
        if self.route_weights is not None:
            if self.type is not ActionType.KEEP:
                raise ValueError(f"route_weights belong to a keep, not a {self.type.value}: a new ladder carries "
                                 "its weights on its ranks")
            bad = {k: v for k, v in self.route_weights.items() if not (math.isfinite(v) and v > 0)}
            if bad or not self.route_weights:
                raise ValueError(f"route_weights must name ranks with finite positive weights, got {bad or '{}'}")
        return self

    @field_serializer("ladder")
    def _ser_ladder(self, ladder: Ladder | None) -> list[dict[str, Any]] | None:
        if ladder is None:
            return None
        return [r.model_dump(mode="json") for r in ladder.ranks]

    @property
    def carries_ladder(self) -> bool:
        return self.type in LADDER_ACTIONS


class Plan(KoiModel):
    tick: int = Field(default=0, ge=0)
    cluster_id: str | None = None
    actions: list[Action] = Field(default_factory=list)
    tick_rationale: str = ""
    proposer: str = Field(default="deterministic", description="who proposed it: deterministic, rlm, fcfs ...")

    def action_for(self, job_id: str) -> Action | None:
        for a in self.actions:
            if a.job_id == job_id:
                return a
        return None

    @property
    def job_ids(self) -> list[str]:
        return [a.job_id for a in self.actions]
