"""Log output: JSON lines for machines, plain text on a terminal."""

from __future__ import annotations

import logging
import sys
from datetime import UTC, datetime
from typing import Any, Literal

import orjson

LogFormat = Literal["auto", "json", "text"]

# Attributes every LogRecord has; anything else was passed with ``extra=`` and is data.
_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}
# uvicorn adds an ANSI-coloured copy of its messages; it has no place in a log line.
_STANDARD |= {"color_message"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        document: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name, value in vars(record).items():
            if name not in _STANDARD and not name.startswith("_"):
                document[name] = value
        if record.exc_info:
            document["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(document, default=str).decode()


class TextFormatter(logging.Formatter):
    """``time level logger message key=value ...``: readable in a terminal."""

    def format(self, record: logging.LogRecord) -> str:
        extras = {
            k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")
        }
        flat: dict[str, Any] = {}
        for name, value in extras.items():
            if isinstance(value, dict):
                flat.update({k: v for k, v in value.items() if v is not None})
            else:
                flat[name] = value
        line = (
            f"{datetime.fromtimestamp(record.created).strftime('%H:%M:%S.%f')[:-3]} "
            f"{record.levelname:<7} {record.name}: {record.getMessage()}"
        )
        if flat:
            line += " " + " ".join(f"{k}={v}" for k, v in flat.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def uvicorn_log_config(level: str, log_format: LogFormat) -> dict[str, Any]:
    """A ``logging.config`` dict for uvicorn and the gateway's own loggers."""
    use_json = log_format == "json" or (log_format == "auto" and not sys.stderr.isatty())
    formatter = (
        "idempotency_gateway.telemetry.logs.JsonFormatter"
        if use_json
        else "idempotency_gateway.telemetry.logs.TextFormatter"
    )
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"gateway": {"()": formatter}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "gateway",
                "stream": "ext://sys.stderr",
            }
        },
        "root": {"handlers": ["stderr"], "level": level.upper()},
        "loggers": {
            "uvicorn": {"handlers": [], "propagate": True},
            "uvicorn.error": {"handlers": [], "propagate": True},
            # The gateway writes its own access line, richer than uvicorn's.
            "uvicorn.access": {"handlers": [], "propagate": False},
            # Alembic narrates every plugin it loads at info; only its problems matter here.
            "alembic": {"level": "WARNING"},
        },
    }
