"""Structured logs: one JSON object per line (time, level, component, message, exception), to stderr.

A process's stderr is usually its log file (``kvstore serve`` opens ``node.log`` for each node). A line that file
cannot take (its disk is full) goes to a fallback descriptor instead, if the process was given one (a node gets a
copy of its supervisor's stderr): what a node says about its full disk is not lost with it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time

STDERR_FD = 2


class JsonLines(logging.Formatter):
    def __init__(self, fields: dict[str, object]) -> None:
        super().__init__()
        self.fields = fields

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            **self.fields,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class LineWriter(logging.Handler):
    """Each record as one whole line written to stderr (unbuffered); one that stderr cannot take goes to
    ``fallback_fd`` (if any), after one line saying why."""

    def __init__(self, formatter: logging.Formatter, fallback_fd: int | None = None) -> None:
        super().__init__()
        self.setFormatter(formatter)
        self.fallback_fd = fallback_fd
        self.diverted = False

    def emit(self, record: logging.LogRecord) -> None:
        try:
            line = (self.format(record) + "\n").encode()
        except Exception:
            self.handleError(record)
            return
        try:
            os.write(STDERR_FD, line)
            return
        except OSError as exc:
            if self.fallback_fd is None:
                return
            why = exc.strerror or str(exc)
        if not self.diverted:
            self.diverted = True
            note = logging.makeLogRecord({"name": "kvtier.logs", "levelname": "WARNING", "levelno": logging.WARNING})
            note.msg = f"the log cannot be written ({why}): its lines come here"
            line = (self.format(note) + "\n").encode() + line
        with contextlib.suppress(OSError):
            os.write(self.fallback_fd, line)


def configure(fallback_fd: int | None = None, **fields: object) -> None:
    """Send every log record of this process to stderr as JSON lines carrying ``fields`` (e.g. node=3); lines stderr
    cannot take go to ``fallback_fd``."""
    handler = LineWriter(JsonLines(fields), fallback_fd)
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
