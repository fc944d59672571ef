"""The ``koi`` command (typer + rich).

Each sub-command group lives in its own module and registers itself on :data:`app`.
Every command that reports figures takes ``--json`` and then prints exactly one JSON
document on stdout (logs go to stderr), so scripts and CI can read it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util

import typer

from koi import __version__
from koi.cli.output import emit

app = typer.Typer(
    name="koi",
    help="Koi: a self-calibrating planner for heterogeneous, multi-cloud LLM inference fleets.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
#: Command modules, in help order. Each ``koi/cli/<name>.py`` exposes ``register(app)``.
#: A module not written yet is left out; one that fails to import is an error.
COMMAND_MODULES = ("catalog", "db", "sim", "surrogate", "learn", "why", "deploys", "plan", "bench", "agent")

for _name in COMMAND_MODULES:
    if importlib.util.find_spec(f"koi.cli.{_name}") is not None:
        importlib.import_module(f"koi.cli.{_name}").register(app)

# The outer rooms (workers/: ops, dev, demo) plug their commands in by entry point, so the
# domain package never imports Temporal or the workers.
for _ep in sorted(importlib.metadata.entry_points(group="koi.commands"), key=lambda e: e.name):
    _ep.load()(app)


@app.command()
def version(json_out: bool = typer.Option(False, "--json", help="print one JSON document")) -> None:
    """Print Koi's version and the versions of the components it stands on."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as pkg_version

    info = {"koi": __version__}
    for pkg in ("temporalio", "aiconfigurator-core", "pydantic", "sqlmodel", "numpy", "scipy", "boto3",
                "google-cloud-compute", "azure-mgmt-compute"):
        try:
            info[pkg] = pkg_version(pkg)
        except PackageNotFoundError:
            info[pkg] = None
    emit(info, json_out, title="versions")


def main() -> None:
    """Entry point of ``koi``; see :mod:`koi.procexit` for why it may leave via ``os._exit``."""
    from koi.procexit import exit_code_of, exit_process

    try:
        app()
        code = 0
    except SystemExit as exc:
        code = exit_code_of(exc)
    exit_process(code)
