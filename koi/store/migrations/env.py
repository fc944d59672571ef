"""Alembic environment of Koi's store.

Programmatic callers (:mod:`koi.store.migrations`) hand over an open connection in
``config.attributes["connection"]``; the ``alembic`` command line gets a URL from
``-x url=...`` or the Koi settings. On PostgreSQL a transaction-scoped advisory lock
serialises concurrent upgrades (two workers starting at once).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import context

from koi.store.migrations import PG_LOCK_KEY, VERSION_TABLE, target_metadata
from koi.store.tables import TABLE_NAMES

config = context.config


def _include_object(obj, name, type_, reflected, compare_to) -> bool:  # noqa: ANN001 - Alembic's hook
    # Only the store's own tables: a shared PostgreSQL database may hold others.
    if type_ == "table":
        return name in TABLE_NAMES
    return True


def _run(connection: sa.Connection) -> None:
    context.configure(
        connection=connection,
        target_metadata=target_metadata,
        version_table=VERSION_TABLE,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
        include_object=_include_object,
    )
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            connection.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": PG_LOCK_KEY})
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    from koi.store.db import make_engine

    url = context.get_x_argument(as_dictionary=True).get("url") or config.get_main_option("sqlalchemy.url")
    engine = make_engine(url or None)
    try:
        with engine.begin() as conn:
            _run(conn)
    finally:
        engine.dispose()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported: Koi's migrations run against a database")
run_migrations_online()
