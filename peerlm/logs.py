"""Structured logging: JSON lines for services, a readable console format on a TTY.

Every line carries ``component`` and ``identity`` so that logs from many processes of a
federation can be merged and filtered. Configure once, in a process entry point.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import MutableMapping
from typing import Any

import structlog

from peerlm.config import LogFormat

__all__ = ["configure_logging", "get_logger"]

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING}


def configure_logging(
    component: str, identity: str, fmt: LogFormat = "auto", level: str = "info"
) -> Any:
    """Configure structlog for this process and return a logger bound to it.

    ``fmt="auto"`` renders for people when stderr is a terminal and JSON otherwise.
    """
    use_console = fmt == "console" or (fmt == "auto" and sys.stderr.isatty())
    static = {"component": component, "identity": identity}

    def add_static(_: Any, __: str, event: MutableMapping[str, Any]) -> MutableMapping[str, Any]:
        for key, value in static.items():
            event.setdefault(key, value)
        return event

    renderer: Any = (
        structlog.dev.ConsoleRenderer(colors=True)
        if use_console
        else structlog.processors.JSONRenderer(sort_keys=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            add_static,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS.get(level, logging.ERROR)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
    _route_stdlib(add_static, renderer, level)
    return get_logger()


def _route_stdlib(add_static: Any, renderer: Any, level: str) -> None:
    """Send the standard library's records (grpc's Python layer, transformers, asyncio)
    through the same renderer, with ``component``, ``identity`` and ``logger``, so no line
    of the process lacks them. Libraries speak at WARNING and above unless the process
    logs at debug. (gRPC's C core writes to stderr directly; nothing in Python sees it.)"""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                add_static,
                structlog.stdlib.add_logger_name,
                structlog.stdlib.add_log_level,
                structlog.processors.TimeStamper(fmt="iso", utc=True),
            ],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if level == "debug" else logging.WARNING)
    logging.captureWarnings(True)


def get_logger(**bind: Any) -> Any:
    """A structlog logger with ``bind`` fields attached."""
    return structlog.get_logger().bind(**bind)
