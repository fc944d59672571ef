"""Shared test fixtures. Database fixtures: a migrated store on SQLite and on PostgreSQL.

``db_url`` is parametrized over both backends; a test asking for it (or for
``engine``) runs twice. The PostgreSQL variant creates a fresh database per test
(``koi_test_<pid>_<random>``) and drops it afterwards. PostgreSQL tests are marked
``postgres``; when the server is unreachable they FAIL (CI starts it), they do not skip.
Point them elsewhere with ``KOI_TEST_PG_DSN`` (a libpq URL of a database to connect
to for CREATE/DROP DATABASE).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator

import pytest

import koi  # noqa: F401  (first: pins numpy's SIMD kernels before any test imports numpy; koi/numerics.py)

PG_ADMIN_DSN = os.environ.get("KOI_TEST_PG_DSN", "postgresql://postgres@127.0.0.1:5432/test")


def _pg_admin():  # noqa: ANN202 - a psycopg connection
    import psycopg

    try:
        return psycopg.connect(PG_ADMIN_DSN, autocommit=True, connect_timeout=5)
    except psycopg.OperationalError as exc:
        reason = str(exc).strip()
    # outside the except block, so the failure is not reported as a chained traceback
    pytest.fail(
        f"PostgreSQL is unreachable at {PG_ADMIN_DSN} ({reason}). The store's PostgreSQL tests need it: "
        "start the server (CI does) or set KOI_TEST_PG_DSN.",
        pytrace=False,
    )


def _sqlalchemy_url(dsn: str, dbname: str) -> str:
    from sqlalchemy.engine import make_url

    return (
        make_url(dsn)
        .set(drivername="postgresql+psycopg", database=dbname)
        .render_as_string(hide_password=False)
    )


@pytest.fixture
def sqlite_url(tmp_path) -> str:
    return f"sqlite:///{tmp_path / 'koi.db'}"


@pytest.fixture
def pg_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database, dropped at teardown."""
    name = f"koi_test_{os.getpid()}_{secrets.token_hex(4)}"
    with _pg_admin() as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    try:
        yield _sqlalchemy_url(PG_ADMIN_DSN, name)
    finally:
        with _pg_admin() as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request) -> str:
    """An empty database on each backend in turn."""
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "pg_url")


@pytest.fixture
def engine(db_url):  # noqa: ANN201 - sqlalchemy Engine
    """An engine on a database migrated to head (by Alembic, as production does)."""
    from koi.store import init_db, make_engine

    eng = make_engine(db_url)
    init_db(eng)
    try:
        yield eng
    finally:
        eng.dispose()


# ---- EC2 on moto's server (loopback) ----------------------------------------------------------------------
@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    """moto's real HTTP server on 127.0.0.1 (one per test session): the EC2 API Koi's AWS executor talks to."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture(scope="session")
def ec2_factory(moto_endpoint: str):  # noqa: ANN201 - Callable[[str], boto3 client]
    """``region -> EC2 client`` on moto's server, with throwaway credentials (never ~/.aws)."""
    from infra.cloud import ec2_client_factory

    return ec2_client_factory(moto_endpoint, aws_access_key_id="testing", aws_secret_access_key="testing",
                              aws_session_token="testing")
