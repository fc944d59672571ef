"""Column types and JSON encoding shared by every table.

Bulk payloads are plain ``JSON`` on both SQLite and PostgreSQL, not JSONB: JSON keeps
the text as written (key order included), so a stage replayed on stored inputs sees
the same dict order as the run that stored them. The columns we filter on are real
columns beside the payload.
"""

from __future__ import annotations

import json
import math
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa
from pydantic import BaseModel
from pydantic_core import to_jsonable_python
from sqlmodel import Field

#: One JSON type for both backends; SQL NULL (not JSON ``null``) for a missing value.
JsonType = sa.JSON(none_as_null=True)

#: Timestamps are metadata for ops, never inputs to a stage.
TimestampType = sa.DateTime(timezone=True)


def json_column(*, nullable: bool = False) -> sa.Column:
    """A fresh JSON column (a Column object belongs to exactly one table)."""
    return sa.Column(JsonType, nullable=nullable)


def created_at_field() -> Any:
    return Field(
        default=None,
        sa_type=TimestampType,
        sa_column_kwargs={"server_default": sa.text("CURRENT_TIMESTAMP")},
        nullable=False,
    )


def updated_at_field() -> Any:
    return Field(default=None, sa_type=TimestampType, nullable=True)


def utcnow() -> datetime:
    return datetime.now(UTC)


def _fallback(obj: Any) -> Any:
    # numpy scalars and arrays (slow-loop state is computed with numpy)
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if hasattr(obj, "item"):
        return obj.item()
    raise TypeError(f"cannot store a {type(obj).__name__} as JSON")


def to_json(obj: Any) -> Any:
    """A JSON-able copy of a pydantic model, dict or list (numpy values become Python ones)."""
    if isinstance(obj, BaseModel):
        return obj.model_dump(mode="json")
    return to_jsonable_python(obj, fallback=_fallback)


def dumps(obj: Any) -> str:
    """The engines' JSON serializer: NaN and infinity are refused on both backends.

    PostgreSQL rejects them anyway; SQLite would store them silently, so without this
    the two backends would disagree on what a valid payload is.
    """
    try:
        return json.dumps(obj, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
    except ValueError as exc:
        raise ValueError(
            f"payload holds a non-finite float (NaN or infinity), which JSON cannot store: {exc}"
        ) from exc


def check_finite(name: str, value: float) -> float:
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return float(value)
