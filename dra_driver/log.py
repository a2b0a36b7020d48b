"""Structured logging for every entry point: JSON in a pod, readable on a terminal.

Call `configure()` once at process start. Bind claim context with
`structlog.contextvars.bound_contextvars(claim_namespace=..., claim_name=..., claim_uid=...)`
so that every line about a claim carries its namespace, name and UID.

The driver's own lines are rendered by structlog and written straight to stderr, without
the standard library's LogRecords and handlers (much cheaper per line, and Prepare
logs on its hot path); a line below the level is dropped before any rendering. Lines of
libraries that log through `logging` (grpc, kubernetes) get the same renderer. This module
must not buffer: a line is on stderr when the call returns.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Literal

import structlog
from structlog.types import EventDict, Processor

LogFormat = Literal["json", "console", "auto"]

_WRITE_LOCK = threading.Lock()  # one whole line at a time, from any thread
_LEVELS = logging.getLevelNamesMapping()
_threshold = logging.INFO


def _drop_below_level(logger: Any, method: str, event: EventDict) -> EventDict:
    # A processor, not a filtering wrapper class: loggers are cached at first use, and a
    # level baked into them would outlive a later configure() (and structlog's capture_logs).
    if _LEVELS.get(method.upper(), logging.ERROR) < _threshold:
        raise structlog.DropEvent
    return event


class _StderrLogger:
    """Writes each rendered line to the current `sys.stderr` (click's test runner swaps it)."""

    def __init__(self, name: str) -> None:
        self.name = name  # for structlog.stdlib.add_logger_name

    def msg(self, message: str) -> None:
        stream = sys.stderr
        with _WRITE_LOCK:
            stream.write(message + "\n")
            stream.flush()

    debug = info = warning = error = critical = exception = msg


def _logger(*args: Any) -> _StderrLogger:
    return _StderrLogger(str(args[0]) if args else "")


def configure(level: str = "info", fmt: LogFormat = "auto") -> None:
    """Route structlog and stdlib logging (grpc, kubernetes) through one renderer on stderr."""
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    renderer: Processor
    tracebacks: list[Processor] = []
    if fmt == "json":
        # without locals: a frame's locals may hold a bearer token or a claim's whole config
        transformer = structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        tracebacks.append(structlog.processors.ExceptionRenderer(transformer))
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer()  # renders tracebacks itself
    global _threshold
    _threshold = numeric = _LEVELS[level.upper()]
    structlog.configure(
        # set_exc_info: the generic BoundLogger's `exception()` passes no exc_info of its own,
        # and without it both renderers dropped the exception (type, message, traceback)
        processors=[_drop_below_level, *shared, structlog.processors.StackInfoRenderer(),
                    structlog.dev.set_exc_info, *tracebacks, renderer],
        logger_factory=_logger,
        wrapper_class=structlog.BoundLogger,
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*shared, structlog.stdlib.ExtraAdder()],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, *tracebacks, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    for noisy in ("urllib3", "kubernetes.client.rest", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
