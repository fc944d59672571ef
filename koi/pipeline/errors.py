"""Errors of the tick pipeline.

Two kinds matter to the orchestrator: an :class:`InputError` means retrying cannot
help (a missing stage output, a stale tick, a plan that was never validated, a
refused launch) and becomes a non-retryable Temporal failure; anything else is
transient and retried by the stage's retry policy. Either way, a stage that finally
fails sends the tick into keep-all compensation.
"""

from __future__ import annotations


class PipelineError(RuntimeError):
    """Base of the pipeline's own errors."""


class InputError(PipelineError):
    """Invalid or missing input: not retryable."""

    kind = "InputError"


class StaleTick(InputError):
    """The fence refused: a newer tick has committed its plan."""

    kind = "StaleTick"


class PlanRejected(InputError):
    """S6 was asked to deploy a plan S5 did not pass."""

    kind = "PlanRejected"


class LaunchRefused(InputError):
    """The executor refused a launch (no capacity, does not fit): the plan cannot be deployed as is."""

    kind = "LaunchRefused"


class StageUnavailable(InputError):
    """A stage's implementation is not installed (e.g. a module not landed yet)."""

    kind = "StageUnavailable"


def is_retryable(exc: BaseException) -> bool:
    """False for input errors and pydantic validation errors, True otherwise."""
    if isinstance(exc, InputError):
        return False
    try:
        from pydantic import ValidationError
    except ImportError:  # pragma: no cover
        return True
    return not isinstance(exc, ValidationError)


def describe(exc: BaseException) -> str:
    """The error's message, or — for a bare ``assert`` or an empty message — where it was raised."""
    import traceback

    msg = str(exc).strip()
    if msg:
        return msg
    tb = traceback.extract_tb(exc.__traceback__)
    if tb:
        f = tb[-1]
        return f"raised at {f.filename.rsplit('/site-packages/', 1)[-1]}:{f.lineno} ({f.line or f.name})"
    return repr(exc)
