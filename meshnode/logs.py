"""Log output: human-readable lines, or one JSON object per line (``--log-format json``).

A JSON line carries ``ts`` (UTC, ISO 8601), ``level``, ``logger``, ``msg`` (the
formatted message), ``exc`` when an exception is attached, and any structured
fields passed with ``extra=`` (for example ``log.info("...", extra={"peer": id})``).

Configuring the log also turns on Python's fault handler: a fatal signal (a crash
in llama.cpp's C code) then leaves every thread's stack on stderr instead of nothing.
"""

from __future__ import annotations

import faulthandler
import json
import logging
import sys
import time
from typing import Any

# Attributes every LogRecord has; anything else came from ``extra=``.
_STANDARD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        event: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRIBUTES and not key.startswith("_"):
                event[key] = (
                    value if isinstance(value, str | int | float | bool | type(None)) else repr(value)
                )
        if record.exc_info:
            event["exc"] = self.formatException(record.exc_info)
        return json.dumps(event, ensure_ascii=False)


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def enable_crash_reports() -> None:
    """On SIGSEGV, SIGABRT, SIGBUS, SIGILL or SIGFPE, write every thread's Python stack to stderr
    before the process dies: a process killed by a signal in C code prints nothing by itself, and
    its exit looked silent (issue 14). Left as it is when already on (``python -X faulthandler``,
    ``PYTHONFAULTHANDLER``, pytest), so it never takes the report away from a file someone chose."""
    if not faulthandler.is_enabled():
        faulthandler.enable(sys.stderr, all_threads=True)


def configure_logging(level: str, log_format: str = "text") -> None:
    # Every meshnode command configures its log first thing, so this covers them all.
    enable_crash_reports()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    # aioquic's own loggers are chatty at debug level and say nothing we need.
    logging.getLogger("quic").setLevel(logging.WARNING)


def mib(count: int | float) -> str:
    """A byte count as log lines and messages print it: ``235.2 MiB``."""
    return f"{count / 2**20:.1f} MiB"
