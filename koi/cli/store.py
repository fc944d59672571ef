"""The store, opened read-only for a CLI command (``koi why``, ``koi deploys``)."""

from __future__ import annotations

from koi.cli.output import fail


def open_store(url: str | None, *, required: bool, table: str):  # noqa: ANN201 - Engine | None
    """The store at ``url`` (default: ``KOI_DATABASE_URL`` or the SQLite file) for a read-only command.

    A SQLite file that does not exist is not created, and a store without ``table`` (no schema
    yet) is not used: ``required`` commands fail with what to run first, the others get None.
    """
    from pathlib import Path

    from sqlalchemy import inspect
    from sqlalchemy.engine import make_url

    from koi.config import get_settings
    from koi.store import make_engine

    target = url or get_settings().resolved_database_url
    u = make_url(target)
    if u.get_backend_name() == "sqlite" and u.database not in (None, "", ":memory:") and not Path(u.database).exists():
        if required:
            fail(f"no store at {u.database}; run `koi db upgrade` and a cluster first")
        return None
    eng = make_engine(target)
    if table not in inspect(eng).get_table_names():
        eng.dispose()
        if required:
            fail("the store has no schema yet; run `koi db upgrade`")
        return None
    return eng
