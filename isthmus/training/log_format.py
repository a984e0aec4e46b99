"""``isthmus site --log-format json``: every line a site prints, as one JSON object.

Log shippers (Fluent Bit, Vector, Loki's agents) parse a JSON object a line
without rules of their own. In this format every line ``isthmus site`` and its
ranks print (log records, warnings, progress, the one-line errors) is
``{"time", "level", "logger", "site", "rank", "message"}``, with the record's
figures beside them where it has some. The choice travels to the ranks torchrun
starts in ``ISTHMUS_LOG_FORMAT``.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
from typing import IO, Any

LOG_FORMAT = "ISTHMUS_LOG_FORMAT"
"""``json``: this process and those it starts print JSON lines."""
LOG_SITE = "ISTHMUS_LOG_SITE"
"""The site named in each line (a launched rank also has ``ISTHMUS_SITE``)."""
FORMATS = ("text", "json")


def json_logs() -> bool:
    return os.environ.get(LOG_FORMAT) == "json"


def line(level: str, message: str, logger: str = "isthmus.site", **fields: Any) -> str:
    """One JSON line: when, how grave, who (site and rank from the environment the
    launcher gives every rank), what."""
    record = {
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="milliseconds"),
        "level": level,
        "logger": logger,
        "site": os.environ.get(LOG_SITE) or os.environ.get("ISTHMUS_SITE"),
        "rank": int(os.environ.get("RANK", "0")),
        "message": message,
        **fields,
    }
    return json.dumps(record, default=str)


def say(
    message: str,
    level: str = "INFO",
    *,
    prefix: str = "",
    stream: IO[str] | None = None,
    **fields: Any,
) -> None:
    """Print ``message`` as this process's format says: as text after ``prefix``
    (``"isthmus site: error: "``), or a JSON line of ``level`` (``fields`` go into
    the object)."""
    stream = stream if stream is not None else sys.stderr
    text = line(level, message, **fields) if json_logs() else prefix + message
    print(text, file=stream, flush=True)


class JsonLines(logging.Formatter):
    """A logging record as a JSON line (with its traceback, if any, in ``exc_info``)."""

    def format(self, record: logging.LogRecord) -> str:
        extra = {"exc_info": self.formatException(record.exc_info)} if record.exc_info else {}
        return line(record.levelname, record.getMessage(), record.name, **extra)


def use(log_format: str, site: str) -> None:
    """Set this process (and the ranks it starts) to ``log_format``, or to JSON when
    the process that started this one chose it (torchrun's ranks of ``isthmus site``)."""
    if log_format != "json" and not json_logs():
        return
    os.environ[LOG_FORMAT] = "json"
    os.environ[LOG_SITE] = site
    logging.captureWarnings(True)  # Python's warnings (torch's among them) as records
    for handler in logging.getLogger().handlers:
        handler.setFormatter(JsonLines())
