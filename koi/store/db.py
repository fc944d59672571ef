"""Engines and sessions: SQLite by default, PostgreSQL by URL.

SQLite runs in WAL mode (readers do not block the one writer) with foreign keys on
and a busy timeout, so several worker threads can share the file. PostgreSQL URLs
are normalised to the psycopg 3 driver, the only one installed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.engine import URL, Engine, make_url
from sqlalchemy.pool import StaticPool
from sqlmodel import Session

from koi.logging import get_logger
from koi.store.columns import dumps

log = get_logger(__name__)

#: Seconds a SQLite writer waits for the lock before failing with "database is locked".
SQLITE_BUSY_TIMEOUT_S = 30.0


def normalise_url(url: str | URL) -> URL:
    """``postgres://`` and ``postgresql://`` become ``postgresql+psycopg://``."""
    u = make_url(url)
    if u.drivername in ("postgres", "postgresql"):
        u = u.set(drivername="postgresql+psycopg")
    return u


def store_url(store: str) -> str:
    """A kept store named either way — a database URL, or the path of a SQLite file — as a URL."""
    return store if "://" in store else f"sqlite:///{Path(store).resolve()}"


def default_url() -> str:
    from koi.config import get_settings

    return get_settings().resolved_database_url


def _sqlite_pragmas(dbapi_conn, _record) -> None:  # noqa: ANN001 - DB-API connection
    cur = dbapi_conn.cursor()
    try:
        cur.execute("PRAGMA foreign_keys=ON")
        cur.execute(f"PRAGMA busy_timeout={int(SQLITE_BUSY_TIMEOUT_S * 1000)}")
        cur.execute("PRAGMA journal_mode=WAL")
        cur.execute("PRAGMA synchronous=NORMAL")
    finally:
        cur.close()


def make_engine(url: str | URL | None = None, *, echo: bool = False) -> Engine:
    """An engine for ``url`` (default: ``KOI_DATABASE_URL`` or the SQLite file under ``KOI_DATA_DIR``).

    For a SQLite file the parent directory is created. ``sqlite://`` (in memory) gets one
    shared connection, so every session sees the same database.
    """
    u = normalise_url(url if url is not None else default_url())
    backend = u.get_backend_name()
    if backend == "sqlite":
        memory = u.database in (None, "", ":memory:")
        kwargs: dict = {"connect_args": {"timeout": SQLITE_BUSY_TIMEOUT_S, "check_same_thread": False}}
        if memory:
            kwargs["poolclass"] = StaticPool
        else:
            Path(u.database).expanduser().resolve().parent.mkdir(parents=True, exist_ok=True)
        engine = sa.create_engine(u, echo=echo, json_serializer=dumps, **kwargs)
        sa.event.listen(engine, "connect", _sqlite_pragmas)
    elif backend == "postgresql":
        engine = sa.create_engine(u, echo=echo, json_serializer=dumps, pool_pre_ping=True)
    else:
        raise ValueError(f"unsupported database {u.drivername!r}: Koi's store runs on SQLite or PostgreSQL")
    log.debug("store.engine", url=u.render_as_string(hide_password=True))
    return engine


@contextmanager
def session_scope(engine: Engine) -> Iterator[Session]:
    """One unit of work: commit on success, roll back on any exception.

    Objects stay readable after the commit (``expire_on_commit=False``), so a
    repository can return rows that outlive the session.
    """
    with Session(engine, expire_on_commit=False) as session:
        try:
            yield session
            session.commit()
        except BaseException:
            session.rollback()
            raise


def init_db(engine: Engine) -> str | None:
    """Bring the schema to the newest Alembic revision; returns that revision.

    This is the only way production code creates tables: never ``create_all``, so the
    revision table always tells the truth about the schema.
    """
    from koi.store.migrations import upgrade_engine

    return upgrade_engine(engine)
