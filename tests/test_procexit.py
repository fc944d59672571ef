"""Leaving a process that loaded Temporal's bridge: the exit code and the printed answer survive."""

from __future__ import annotations

import subprocess
import sys

import pytest

from koi.procexit import exit_code_of

PROGRAM = """
import sys
{load}
from koi.procexit import exit_process
sys.stdout.write("answer")
sys.stderr.write("log line")
exit_process({code})
raise AssertionError("exit_process returned")
"""


@pytest.mark.parametrize("load", ["import temporalio.bridge.temporal_sdk_bridge", "pass"])
@pytest.mark.parametrize("code", [0, 1, 3])
def test_exit_process_keeps_code_and_output(load: str, code: int) -> None:
    proc = subprocess.run([sys.executable, "-c", PROGRAM.format(load=load, code=code)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == "answer"
    assert "log line" in proc.stderr
    assert "AssertionError" not in proc.stderr


@pytest.mark.parametrize(("raised", "code"), [(None, 0), (0, 0), (2, 2), ("bad input", 1)])
def test_exit_code_of(raised: object, code: int) -> None:
    assert exit_code_of(SystemExit(raised)) == code
