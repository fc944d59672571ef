"""Schema migrations (Alembic), run programmatically: ``koi db upgrade`` and :func:`init_db` call these.

The Alembic scripts live beside this file (``env.py``, ``versions/``) and the
``alembic.ini`` one level up, inside the package, so an installed wheel can migrate.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine
from sqlmodel import SQLModel

from koi.logging import get_logger
from koi.store import tables as _tables  # noqa: F401 - registers the tables on the metadata

if TYPE_CHECKING:
    from alembic.config import Config

log = get_logger(__name__)
# Alembic announces each autogenerate plugin at INFO when first imported: noise in every CLI run.
# (Alembic itself is imported lazily, inside the functions, so importing the store stays cheap.)
logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)

#: The revision table; prefixed so a shared PostgreSQL database can hold other Alembic projects.
VERSION_TABLE = "koi_schema_version"
#: pg_advisory_xact_lock key that serialises concurrent upgrades ("koi-store" folded into int64).
PG_LOCK_KEY = 0x6B6F6973746F7265
#: What autogenerate compares against.
target_metadata = SQLModel.metadata

#: Alembic keeps its context in module globals: one migration at a time per process.
#: Across processes (two workers starting at once) the PostgreSQL advisory lock in env.py serialises them.
_LOCK = threading.Lock()

_INI = Path(__file__).resolve().parent.parent / "alembic.ini"


def alembic_config(connection: sa.Connection | None = None) -> Config:
    """The packaged ``alembic.ini``; with ``connection``, Alembic runs on it instead of opening its own."""
    from alembic.config import Config

    cfg = Config(str(_INI))
    cfg.set_main_option("script_location", str(Path(__file__).resolve().parent))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


def head_revision() -> str | None:
    """The newest revision the code knows."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory.from_config(alembic_config()).get_current_head()


def _current(conn: sa.Connection) -> str | None:
    from alembic.runtime.migration import MigrationContext

    return MigrationContext.configure(conn, opts={"version_table": VERSION_TABLE}).get_current_revision()


def upgrade_engine(engine: Engine, revision: str = "head") -> str | None:
    """Upgrade the database behind ``engine`` to ``revision``; returns the revision reached."""
    from alembic import command

    with _LOCK, engine.begin() as conn:
        before = _current(conn)
        command.upgrade(alembic_config(conn), revision)
    with engine.connect() as conn:
        after = _current(conn)
    if before != after:
        log.info("store.migrated", from_revision=before, to_revision=after)
    return after


def downgrade_engine(engine: Engine, revision: str) -> str | None:
    """Downgrade to ``revision`` (``"base"`` drops every table). For tests and rollbacks."""
    from alembic import command

    with _LOCK, engine.begin() as conn:
        command.downgrade(alembic_config(conn), revision)
    with engine.connect() as conn:
        return _current(conn)


def _with_engine(url: str | URL | None, fn, *args):  # noqa: ANN001, ANN202 - small internal adapter
    from koi.store.db import make_engine

    engine = make_engine(url)
    try:
        return fn(engine, *args)
    finally:
        engine.dispose()


def upgrade(url: str | URL | None = None, revision: str = "head") -> str | None:
    """Upgrade the database at ``url`` (default: the configured one) to ``revision``."""
    return _with_engine(url, upgrade_engine, revision)


def downgrade(url: str | URL | None, revision: str) -> str | None:
    return _with_engine(url, downgrade_engine, revision)


def current_revision(url: str | URL | None = None) -> str | None:
    """The revision the database at ``url`` is at; None for an empty database."""

    def _read(engine: Engine) -> str | None:
        with engine.connect() as conn:
            return _current(conn)

    return _with_engine(url, _read)


__all__ = [
    "PG_LOCK_KEY",
    "VERSION_TABLE",
    "alembic_config",
    "current_revision",
    "downgrade",
    "downgrade_engine",
    "head_revision",
    "target_metadata",
    "upgrade",
    "upgrade_engine",
]
