"""Rendering for the CLI: a rich table for people, one JSON document for scripts."""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

# Piped output (CI logs, `| less`) gets a wide table rather than 80 folded columns.
console = Console(width=None if sys.stdout.isatty() else 200)
err_console = Console(stderr=True)


def to_jsonable(obj: Any) -> Any:
    if hasattr(obj, "model_dump"):
        return obj.model_dump(mode="json")
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float) and obj != obj:  # NaN is not JSON
        return None
    return obj


def print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(to_jsonable(obj), indent=2, sort_keys=False, default=str) + "\n")
    sys.stdout.flush()


def table(rows: Sequence[Mapping[str, Any]], title: str | None = None, columns: Sequence[str] | None = None) -> Table:
    cols = list(columns or (rows[0].keys() if rows else []))
    t = Table(title=title, show_lines=False, header_style="bold")
    for c in cols:
        t.add_column(c, overflow="fold")
    for r in rows:
        t.add_row(*[_fmt(r.get(c)) for c in cols])
    return t


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, list | tuple):
        return ", ".join(_fmt(x) for x in v)
    return str(v)


def emit(data: Any, json_out: bool, *, title: str | None = None, columns: Sequence[str] | None = None) -> None:
    """Print ``data`` as JSON (``--json``) or as a table (a list of rows, or a mapping shown as key/value)."""
    if json_out:
        print_json(data)
        return
    if isinstance(data, Mapping):
        rows = [{"key": k, "value": v} for k, v in data.items()]
        console.print(table(rows, title=title, columns=["key", "value"]))
    else:
        console.print(table(list(data), title=title, columns=columns))


def fail(message: str, code: int = 2) -> None:
    """A clear error on stderr and a non-zero exit."""
    import typer

    err_console.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(code)
