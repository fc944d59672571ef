"""structlog, configured once: console in development, JSON in production.

Library code takes a logger with :func:`get_logger` and binds context
(cluster, tick, job, rank) with ``log.bind(...)``; it never prints.
"""

from __future__ import annotations

import logging
import sys
import warnings

import structlog

_configured = False


class _StderrLogger:
    """Writes each line to whatever ``sys.stderr`` is *now*: test runners and CLIs swap it, and
    a logger that captured the stream at configuration time would write to a closed file."""

    def msg(self, message: str) -> None:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()

    log = debug = info = warning = warn = error = critical = exception = fatal = msg


class _StderrLoggerFactory:
    def __call__(self, *args: object) -> _StderrLogger:
        return _StderrLogger()


def configure(fmt: str | None = None, level: str | None = None) -> None:
    """Configure structlog and the stdlib root logger. Idempotent."""
    global _configured
    from koi.config import get_settings

    s = get_settings()
    fmt = fmt or s.log_format
    lvl = getattr(logging, (level or s.log_level).upper(), logging.INFO)
    processors: list = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.processors.StackInfoRenderer(),
        structlog.processors.format_exc_info,
    ]
    renderer = structlog.processors.JSONRenderer() if fmt == "json" else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[*processors, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=_StderrLoggerFactory(),
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=lvl, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    _configured = True


def get_logger(name: str | None = None, **bound: object) -> structlog.stdlib.BoundLogger:
    if not _configured:
        configure()
    log = structlog.get_logger(name) if name else structlog.get_logger()
    return log.bind(**bound) if bound else log


def log_numeric_warnings() -> None:
    """Send numpy's floating-point warnings (RuntimeWarning: ∞·0, 0/0, overflow) to the log, once per
    place in the code, instead of hiding them: such a warning once marked a NaN the surrogate returned
    for some replicas (``koi/surrogate/queueing.py``), and a long run's progress bars should not bury it."""
    if getattr(warnings.showwarning, "_koi_numeric", False):
        return  # already routed (idempotent: CLIs and workers call it once per command)
    log = get_logger("koi.numeric")
    previous = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001, ANN202
        if issubclass(category, RuntimeWarning):
            log.warning("numeric_warning", category=category.__name__, where=f"{filename}:{lineno}",
                        message=str(message))
        else:
            previous(message, category, filename, lineno, file, line)

    show._koi_numeric = True  # type: ignore[attr-defined]
    warnings.showwarning = show
    warnings.simplefilter("default", RuntimeWarning)
