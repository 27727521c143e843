"""Logging for ``kvroute serve``: one handler on stderr, text or JSON, for every logger.

The router's records, its access log, uvicorn's records (through ``uvicorn_log_config``)
and Python warnings all reach the root handler, so one ``--log-format`` covers them.
JSON lines come from python-json-logger: ``time``, ``level``, ``logger``, ``message``,
and a record's own fields (the access log's request ID, status, timings...).
"""

from __future__ import annotations

import logging
import time
from typing import Any

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class TextFormatter(logging.Formatter):
    """``logging.Formatter`` whose timestamp text is worked out once a second (the
    access log writes a line per request; ``strftime`` was a seventh of a line's cost)."""

    _cached: tuple[int, str] = (-1, "")

    def formatTime(self, record: logging.LogRecord, datefmt: str | None = None) -> str:
        if datefmt is not None:
            return super().formatTime(record, datefmt)
        second = int(record.created)
        cached_second, text = self._cached
        if second != cached_second:
            text = time.strftime(self.default_time_format, self.converter(record.created))
            self._cached = (second, text)  # one reference swap: safe across threads
        return f"{text},{int(record.msecs):03d}"  # logging's default "%s,%03d"


def formatter(log_format: str) -> logging.Formatter:
    if log_format == "json":
        from pythonjsonlogger.orjson import OrjsonFormatter

        json_formatter: logging.Formatter = OrjsonFormatter(
            "%(asctime)s %(levelname)s %(name)s %(message)s",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
        )
        return json_formatter
    return TextFormatter(TEXT_FORMAT)


def setup_logging(level: str, log_format: str) -> None:
    """Route every record to one stderr handler in ``log_format`` at ``level``."""
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(log_format))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # httpx logs every upstream request at info: the access log says it once per request.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.captureWarnings(True)
    from kvroute.service import accesslog

    # The access log's fields as record attributes are read by the JSON format only.
    accesslog.FIELDS = log_format == "json"
    # No format here uses the caller's file and line, thread or process: skip collecting
    # them for every record (the logging manual's "Optimization" advice). A quarter of
    # an access log record's cost.
    logging._srcfile = None
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False


def uvicorn_log_config(level: str) -> dict[str, Any]:
    """uvicorn's loggers without handlers of their own: their records propagate to the
    root handler and so share its format."""
    quiet = {"handlers": [], "propagate": True, "level": level.upper()}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "loggers": {name: dict(quiet) for name in ("uvicorn", "uvicorn.error", "uvicorn.access")},
    }
