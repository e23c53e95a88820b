"""Logging for the `prefixswarm` command: UTC timestamps, one format, quiet libraries."""

from __future__ import annotations

import logging
import sys
import time

# py-libp2p logs every failed TCP dial at ERROR, and the DHT warns about a departed peer
# at each provide (every 30 s: three lines, measured); discovery says once itself that
# a peer is unreachable, so below `debug` py-libp2p speaks only at ERROR, dials excepted.
DIAL_NOISE = ("libp2p.transport", "Failed to open TCP stream")
LIBRARY_LEVEL = logging.ERROR
LOG_FORMAT = "%(asctime)s.%(msecs)03dZ %(levelname)s %(name)s: %(message)s"
DATE_FORMAT = "%Y-%m-%dT%H:%M:%S"


def setup_logging(level: str) -> None:
    """Log to stderr at `level` (any case of debug/info/warning/error/critical)."""
    formatter = logging.Formatter(LOG_FORMAT, DATE_FORMAT)
    formatter.converter = time.gmtime
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter)
    if level.lower() != "debug":  # a filter on our handler: libp2p resets its loggers' levels
        handler.addFilter(_drop_library_noise)
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def _drop_library_noise(record: logging.LogRecord) -> bool:
    if not record.name.startswith("libp2p"):
        return True
    prefix, message = DIAL_NOISE
    dial = record.name.startswith(prefix) and str(record.msg).startswith(message)
    return record.levelno >= LIBRARY_LEVEL and not dial


def root_cause(exc: BaseException) -> str:
    """The innermost error under libp2p's wrappers, e.g. 'Connection refused'."""
    seen: set[int] = set()
    current: BaseException | None = exc
    last = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        last = current
        inner = getattr(current, "exceptions", None) or getattr(current, "errors", None)
        nested = inner[0] if isinstance(inner, list | tuple) and inner else None
        current = current.__cause__ or current.__context__ or nested
    if isinstance(last, OSError) and last.strerror:
        return last.strerror
    return str(last) or type(last).__name__
