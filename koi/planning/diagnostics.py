"""Structured diagnostics: one per violated constraint instance (C0–C7), for S5 and repair."""

from __future__ import annotations

from enum import StrEnum
from typing import Any

from pydantic import Field

from koi.domain.common import KoiModel


class Constraint(StrEnum):
    C0 = "C0"  # shape: parses, known jobs, ladder shapes
    C1 = "C1"  # capacity per pool / environment
    C2 = "C2"  # physical feasibility of each chain
    C3 = "C3"  # SLO risk: p_brk ≤ τ
    C4 = "C4"  # swap budget B_t
    C5 = "C5"  # quotas, budget slices and priorities (budget book)
    C6 = "C6"  # admission: defer only when no feasible ladder fits
    C7 = "C7"  # lifecycle: issuer permissions, one action per job, action vs status

    @property
    def title(self) -> str:
        return _TITLES[self]


_TITLES = {
    Constraint.C0: "plan shape",
    Constraint.C1: "capacity",
    Constraint.C2: "physical feasibility",
    Constraint.C3: "SLO risk",
    Constraint.C4: "swap budget",
    Constraint.C5: "quotas and priorities",
    Constraint.C6: "admission",
    Constraint.C7: "lifecycle",
}


class Diagnostic(KoiModel):
    constraint: Constraint
    job_id: str | None = None
    message: str
    data: dict[str, Any] = Field(default_factory=dict)

    def __str__(self) -> str:
        who = f" [{self.job_id}]" if self.job_id else ""
        return f"{self.constraint.value} {self.constraint.title}{who}: {self.message}"
