"""``koi db upgrade|current``: the store's schema, by Alembic migrations."""

from __future__ import annotations

import typer

from koi.cli.output import emit

app = typer.Typer(help="The store: SQLite by default, PostgreSQL via KOI_DATABASE_URL.", no_args_is_help=True)


@app.command()
def upgrade(
    url: str | None = typer.Option(None, help="database URL (default: KOI_DATABASE_URL or the SQLite file)"),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Upgrade the store's schema to the newest revision (creates it when empty)."""
    from koi.config import get_settings
    from koi.store import migrations

    target = url or get_settings().resolved_database_url
    before = migrations.current_revision(target)
    migrations.upgrade(target)
    after = migrations.current_revision(target)
    emit({"database": _redact(target), "from": before, "to": after}, json_out, title="koi db upgrade")


@app.command()
def current(url: str | None = typer.Option(None), json_out: bool = typer.Option(False, "--json")) -> None:
    """Show the store's schema revision."""
    from koi.config import get_settings
    from koi.store import migrations

    target = url or get_settings().resolved_database_url
    emit({"database": _redact(target), "revision": migrations.current_revision(target)}, json_out)


def _redact(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="db")
