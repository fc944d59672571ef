"""koi.logging: numeric warnings go to the log once per place in the code, other warnings as before."""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import warnings
from koi.logging import configure, log_numeric_warnings
configure(fmt="json", level="WARNING")
log_numeric_warnings()
log_numeric_warnings()  # idempotent: one hook, one line per warning
import numpy as np
for _ in range(3):
    np.array([np.inf]) * 0.0  # inf·0: invalid value, three times from one place
warnings.warn("plain", UserWarning)
"""


def test_numeric_warnings_are_logged_once_per_place_and_other_warnings_pass_through():
    res = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    lines = [ln for ln in res.stderr.splitlines() if "numeric_warning" in ln]
    assert len(lines) == 1, res.stderr
    assert '"category": "RuntimeWarning"' in lines[0] and "invalid value" in lines[0] and '"where": "<string>:' in lines[0]
    assert "UserWarning: plain" in res.stderr  # not ours: Python's own display
