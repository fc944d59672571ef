"""Idempotent writes: ``INSERT ... ON CONFLICT (key) DO UPDATE`` on SQLite and PostgreSQL.

A retried step writes the same rows again; keyed on the table's UNIQUE columns, the
second write updates the first instead of adding a row.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.orm import Session

from koi.store.columns import utcnow

#: Rows per statement; keeps SQLite under its bound-parameter limit for wide tables.
CHUNK = 200

#: Never overwritten by an upsert: the row's identity and its first-write time.
_PRESERVED = frozenset({"id", "created_at"})


def _table(table: Any) -> sa.Table:
    return table.__table__ if hasattr(table, "__table__") else table


def _insert(dialect: str):  # noqa: ANN202 - returns a dialect's insert() constructor
    if dialect == "postgresql":
        from sqlalchemy.dialects.postgresql import insert
    elif dialect == "sqlite":
        from sqlalchemy.dialects.sqlite import insert
    else:  # pragma: no cover - make_engine refuses other backends
        raise NotImplementedError(f"upsert is not implemented for {dialect!r}")
    return insert


def upsert(
    session: Session,
    table: Any,
    values: Mapping[str, Any] | Iterable[Mapping[str, Any]],
    key_cols: Sequence[str],
    *,
    update_cols: Sequence[str] | None = None,
) -> int:
    """Insert ``values`` into ``table`` (a SQLModel class or a Table); on a key conflict update the row.

    ``key_cols`` must be the columns of a UNIQUE constraint (or the primary key).
    ``update_cols`` defaults to every given column except the key, ``id`` and
    ``created_at``; an empty list means "insert if absent, else leave alone". A
    table's ``updated_at`` is stamped automatically. Rows repeating a key within one
    call collapse to the last one. Returns the number of rows given.
    """
    tbl = _table(table)
    rows = [dict(values)] if isinstance(values, Mapping) else [dict(v) for v in values]
    if not rows:
        return 0
    columns = set(rows[0])
    for r in rows:
        if set(r) != columns:
            raise ValueError(f"upsert into {tbl.name}: every row needs the same columns")
    missing = [k for k in key_cols if k not in columns]
    if missing:
        raise ValueError(f"upsert into {tbl.name}: key column(s) {missing} missing from the values")
    if "updated_at" in tbl.c and "updated_at" not in columns:
        now = utcnow()
        for r in rows:
            r["updated_at"] = now
    # one row per key, last wins (PostgreSQL refuses to update a row twice in one statement)
    by_key = {tuple(r[k] for k in key_cols): r for r in rows}
    rows = list(by_key.values())
    if update_cols is None:
        update_cols = [c for c in rows[0] if c not in key_cols and c not in _PRESERVED]
    elif "updated_at" in rows[0] and update_cols and "updated_at" not in update_cols:
        update_cols = [*update_cols, "updated_at"]

    insert = _insert(session.get_bind().dialect.name)
    for i in range(0, len(rows), CHUNK):
        stmt = insert(tbl).values(rows[i : i + CHUNK])
        if update_cols:
            stmt = stmt.on_conflict_do_update(
                index_elements=list(key_cols), set_={c: stmt.excluded[c] for c in update_cols}
            )
        else:
            stmt = stmt.on_conflict_do_nothing(index_elements=list(key_cols))
        session.execute(stmt)
    return len(rows)


def insert_if_absent(
    session: Session, table: Any, values: Mapping[str, Any], key_cols: Sequence[str]
) -> bool:
    """Insert one row unless its key exists; True when this call inserted it.

    Decided by the database (``ON CONFLICT DO NOTHING ... RETURNING``), so of two
    concurrent callers exactly one sees True.
    """
    tbl = _table(table)
    row = dict(values)
    if "updated_at" in tbl.c and "updated_at" not in row:
        row["updated_at"] = utcnow()
    insert = _insert(session.get_bind().dialect.name)
    pk = list(tbl.primary_key.columns)[0]
    stmt = insert(tbl).values(row).on_conflict_do_nothing(index_elements=list(key_cols)).returning(pk)
    return session.execute(stmt).first() is not None
