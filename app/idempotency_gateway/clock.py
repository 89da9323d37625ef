"""The gateway's clocks, in one place, so every cache, store and breaker tells time alike.

Two kinds of time, never mixed:

- wall-clock UTC (``Clock``, ``utc_now``) for anything stored or compared with what is
  stored: record expiries, lease ends, override and invalidation timestamps. (The
  PostgreSQL store judges leases by the database's clock instead; a ``Clock`` pins it only
  for tests that move time by hand.)
- monotonic seconds (``Monotonic``, ``monotonic``) for durations inside one process:
  breaker windows, retry budgets, deadlines, guards. They never jump when the host's clock
  is set.

Every component that reads the time takes one of these as a keyword argument defaulting to
the real one, so tests inject a clock they move themselves.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

Clock = Callable[[], datetime]
Monotonic = Callable[[], float]

monotonic: Monotonic = time.monotonic


def utc_now() -> datetime:
    return datetime.now(UTC)
