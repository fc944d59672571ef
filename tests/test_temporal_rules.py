"""The house rules around Temporal, checked: what may import what, and no side effects in workflow files."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORCHESTRATION = ("temporalio", "workflows", "activities", "workers", "infra")
HEAVY = ("numpy", "scipy", "sqlmodel", "sqlalchemy", "psycopg", "openai", "boto3", "pandas")


def _imports(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
        return [node.module]
    return []


def test_koi_never_imports_the_orchestration_rooms():
    """koi/ imports no Temporal, workflows, activities, workers or infra — not even lazily.
    The commands that drive Temporal live in workers/commands and plug into the CLI by
    entry point."""
    offenders = []
    for path in (ROOT / "koi").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            for name in _imports(node):
                if name.split(".")[0] in ORCHESTRATION:
                    offenders.append((str(path.relative_to(ROOT)), name, node.lineno))
    assert offenders == []


def test_the_ops_commands_reach_the_cli_by_entry_point():
    from typer.main import get_command

    from koi.cli import app

    names = set(get_command(app).commands)
    assert {"submit", "status", "ticks", "reset-tick", "worker", "dev", "up", "down", "demo"} <= names


def test_importing_the_workflows_loads_nothing_heavy():
    code = f"import sys, workflows; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_workflow_files_have_no_module_level_side_effects():
    allowed = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Assign,
               ast.AnnAssign)
    for path in (ROOT / "workflows").glob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in tree.body:
            if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
                continue  # docstring
            if isinstance(node, ast.With):  # only `with workflow.unsafe.imports_passed_through(): import ...`
                assert "imports_passed_through" in ast.unparse(node.items[0].context_expr), path
                assert all(isinstance(n, ast.Import | ast.ImportFrom) for n in node.body), path
                continue
            assert isinstance(node, allowed), f"{path.name}:{node.lineno}: {ast.unparse(node)[:80]}"
            if isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None:
                assert not any(isinstance(n, ast.Await) for n in ast.walk(node.value)), path
        for node in ast.walk(tree):
            for name in _imports(node):
                assert name.split(".")[0] not in HEAVY, f"{path.name} imports {name}"
