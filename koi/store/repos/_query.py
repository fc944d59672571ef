"""Small query helpers shared by the repositories."""

from __future__ import annotations

from typing import Any

from sqlmodel import select
from sqlmodel.sql.expression import SelectOfScalar


def fresh(table: Any) -> SelectOfScalar:
    """``select(table)`` that refreshes rows already in the session.

    Writes go through Core upserts, which the ORM identity map does not see; without
    ``populate_existing`` a read after a write in one session could return the old row.
    """
    return select(table).execution_options(populate_existing=True)


def tick_filter(
    stmt: SelectOfScalar, table: Any, tick: int | None, start: int | None, end: int | None
) -> SelectOfScalar:
    """Restrict to one tick, or to the inclusive range [start, end] (either end open)."""
    if tick is not None:
        if start is not None or end is not None:
            raise ValueError("give either tick or a start/end range, not both")
        return stmt.where(table.tick == tick)
    if start is not None:
        stmt = stmt.where(table.tick >= start)
    if end is not None:
        stmt = stmt.where(table.tick <= end)
    return stmt
