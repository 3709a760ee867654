"""Structured logs (structlog): key=value on stderr, one line per event."""

from __future__ import annotations

import logging
import os
import sys

import structlog

from pitstop.errors import InvalidRequest

LEVELS = ("debug", "info", "warning", "error")


def setup(level: str | None = None, json: bool = False) -> None:
    """Logging for a service or the CLI; the level from `level`, else PITSTOP_LOG_LEVEL, else info."""
    level = (level or os.environ.get("PITSTOP_LOG_LEVEL") or "info").lower()
    if level not in LEVELS:
        raise InvalidRequest(f"PITSTOP_LOG_LEVEL={level!r} is not one of {', '.join(LEVELS)}",
                             action="set PITSTOP_LOG_LEVEL to debug, info, warning or error")
    lvl = getattr(logging, level.upper())
    logging.basicConfig(level=lvl, stream=sys.stderr, format="%(message)s")
    for noisy in ("httpx", "httpcore"):  # one line per request drowns what matters
        logging.getLogger(noisy).setLevel(logging.WARNING)
    structlog.configure(
        processors=[structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                    structlog.processors.TimeStamper(fmt="iso", utc=True),
                    structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True)
