"""Ending a process that has loaded Temporal's native bridge.

The Temporal SDK's client runs on a Rust (tokio) runtime whose threads can still hold
or release the GIL while CPython finalises. In a short-lived process (``koi submit``,
``koi status``, ``python -m workers.bench``) that race intermittently ends the process
with SIGSEGV or SIGABRT *after* its work is done and its answer printed, so the caller
sees -11 instead of the exit code (temporalio/sdk-python#300; the same race is known
for other pyo3-asyncio bridges). Nothing Koi keeps lives in interpreter finalisers —
the store commits before a command returns — so once the bridge is loaded we flush the
streams and leave with ``os._exit``; without it we exit normally.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

BRIDGE_MODULE = "temporalio.bridge.temporal_sdk_bridge"


def exit_code_of(exc: SystemExit) -> int:
    """The integer status ``sys.exit`` would give for ``exc`` (None → 0, a message → 1)."""
    code = exc.code
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    sys.stderr.write(f"{code}\n")
    return 1


def exit_process(code: int) -> None:
    """Exit with ``code``; skip interpreter finalisation when Temporal's bridge is loaded."""
    if BRIDGE_MODULE not in sys.modules:
        raise SystemExit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe must not fail a finished command
            stream.flush()
    os._exit(code)
