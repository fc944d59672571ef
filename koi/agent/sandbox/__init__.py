"""The planner's sandbox: a separate, isolated Python process per trajectory (see ``child.py``)."""

from koi.agent.sandbox.host import (
    LAYERS,
    ExecResult,
    Sandbox,
    SandboxError,
    SandboxLimits,
    ToolCallRecord,
)
from koi.agent.sandbox.policy import ALLOWED_BUILTINS, ALLOWED_MODULES, PolicyViolation, check_code

__all__ = [
    "ALLOWED_BUILTINS", "ALLOWED_MODULES", "LAYERS", "ExecResult", "PolicyViolation", "Sandbox",
    "SandboxError", "SandboxLimits", "ToolCallRecord", "check_code",
]
