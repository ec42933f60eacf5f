"""Structured logs: one JSON object per line (time, level, component, message, exception), to stderr."""

from __future__ import annotations

import json
import logging
import sys
import time


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


def configure(**fields: object) -> None:
    """Send every log record of this process to stderr as JSON lines carrying ``fields`` (e.g. node=3)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines(fields))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
