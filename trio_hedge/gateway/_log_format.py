"""How ``trio-hedge serve`` writes its logs to stderr: plain text (the default) or one JSON
object per line (``--log-format json``, ``[server] log_format = "json"``), for a log
collector that parses them (Loki, Elasticsearch, CloudWatch).

A JSON line has ``time`` (UTC, ISO 8601), ``level``, ``logger`` and ``message``, and the
record's structured fields when it has them (the health log's, `LoggingHook`'s: the
``trio_hedge`` attribute of the record). The access log's lines are JSON objects already and
are written as they are.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import datetime, timezone
from typing import TextIO

from ._metrics import ACCESS_LOGGER

__all__ = ["LOG_FORMATS", "JsonLines", "configure_logging"]

#: The values of ``--log-format`` and ``[server] log_format``.
LOG_FORMATS = ("text", "json")

#: Libraries that log a line per request: kept at WARNING and above.
#: A line per request (httpx, …), or per retry of an unreachable Redis (coredis).
_NOISY = ("httpx", "httpcore", "trio_hedge.gateway.server", "coredis")


class JsonLines(logging.Formatter):
    """One JSON object per record (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        if record.name == ACCESS_LOGGER.name:
            return record.getMessage()  # a JSON object already
        stamp = datetime.fromtimestamp(record.created, timezone.utc)
        out: dict[str, object] = {
            "time": stamp.isoformat(timespec="milliseconds")[:-6] + "Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": getattr(record, "trio_hedge_summary", None) or record.getMessage(),
        }
        fields = getattr(record, "trio_hedge", None)
        if isinstance(fields, dict):
            for key, value in fields.items():
                if value is not None and key not in out:
                    out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure_logging(level: str, log_format: str, stream: TextIO | None = None) -> None:
    """Send the gateway's logs to ``stream`` (default stderr) at ``level`` (``"info"``…), as
    ``log_format`` (``"text"`` or ``"json"``), replacing the root logger's handlers."""
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(JsonLines() if log_format == "json" else logging.Formatter("%(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(getattr(logging, level.upper()))
    for noisy in _NOISY:
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
