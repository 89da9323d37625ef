"""Logging a failing dependency without flooding the log."""

from __future__ import annotations

import logging
import time

log = logging.getLogger(__name__)

_LOG_EVERY = 30.0


class DegradationLog:
    """Logs a failing dependency once per interval, with how many failures it skipped."""

    def __init__(self, what: str, *, fallback: str, every: float = _LOG_EVERY) -> None:
        self.what = what
        self.fallback = fallback
        self.every = every
        self.failures = 0
        self._unlogged = 0
        self._last_logged = float("-inf")

    def failed(self, exc: BaseException) -> None:
        self.failures += 1
        now = time.monotonic()
        if now - self._last_logged < self.every:
            self._unlogged += 1
            return
        log.warning(
            "%s unavailable (%s: %s); %s (%d failures not logged)",
            self.what,
            type(exc).__name__,
            exc,
            self.fallback,
            self._unlogged,
        )
        self._unlogged = 0
        self._last_logged = now
