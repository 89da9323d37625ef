"""A logging handler that keeps the records it is given, for tests of what a logger emits."""

from __future__ import annotations

import logging


class Capture(logging.Handler):
    """Keeps every record at info or above that reaches it."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
