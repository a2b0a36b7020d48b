"""Structured logging for every entry point: JSON in a pod, readable on a terminal.

Call `configure()` once at process start. Bind claim context with
`structlog.contextvars.bound_contextvars(claim_namespace=..., claim_name=..., claim_uid=...)`
so that every line about a claim carries its namespace, name and UID.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import structlog

LogFormat = Literal["json", "console", "auto"]


def configure(level: str = "info", fmt: LogFormat = "auto") -> None:
    """Route structlog and stdlib logging (grpc, kubernetes) through one renderer on stderr."""
    if fmt == "auto":
        fmt = "console" if sys.stderr.isatty() else "json"
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        structlog.stdlib.ExtraAdder(),
    ]
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=True,
    )
    renderer: structlog.types.Processor
    final: list[structlog.types.Processor] = [structlog.stdlib.ProcessorFormatter.remove_processors_meta]
    if fmt == "json":
        final.append(structlog.processors.dict_tracebacks)
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(foreign_pre_chain=shared, processors=[*final, renderer])
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for noisy in ("urllib3", "kubernetes.client.rest", "asyncio"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
