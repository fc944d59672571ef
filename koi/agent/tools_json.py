"""How the planner's tools write numbers and ladders into their JSON results.

``_finite`` rounds a float to six places and spells the non-finite ones ``"inf"``, ``"-inf"``
or ``"nan"`` (the sandbox channel carries strict JSON); ``_ladder_json`` writes a ladder as the
list of ranks the spec uses. Every tool family of :class:`~koi.agent.backend.ToolBackend` and
:class:`~koi.agent.tools_predict.LadderScore` shape their results with these two, so they sit in
a module of their own rather than in any one family's.
"""

from __future__ import annotations

import math
from typing import Any

from koi.domain import Ladder


def _ladder_json(ladder: Ladder | None) -> list[dict[str, Any]] | None:
    if ladder is None:
        return None
    return [r.model_dump(mode="json") for r in ladder.ranks]


def _finite(x: float) -> float | str:
    x = float(x)
    if math.isfinite(x):
        return round(x, 6)
    return "nan" if x != x else ("inf" if x > 0 else "-inf")
