"""The gateway's clocks, in one place, so every cache, store and breaker tells time alike.

Two kinds of time, never mixed:

- wall-clock UTC (``Clock``, ``utc_now``) for anything stored or compared with what is
  stored: record expiries, lease ends, override and invalidation timestamps. (The
  PostgreSQL store judges leases by the database's clock instead; a ``Clock`` pins it only
  for tests that move time by hand.)
- monotonic seconds (``Monotonic``, ``monotonic``) for durations inside one process:
  breaker windows, retry budgets, deadlines, guards. They never jump when the host's clock
  is set.
- the lease clock (``lease_clock``), monotonic seconds that keep counting while the host is
  suspended (``CLOCK_BOOTTIME`` on Linux): an owner judges how long it may trust its lease
  by it, so a frozen VM or a suspended host shows up as elapsed time, as any stall must. The
  replay caches count an entry's life on it too, from the same reading: the one taken before
  the statement that handed the record over.

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


def _boottime() -> float:
    return time.clock_gettime(time.CLOCK_BOOTTIME)


# ``time.monotonic`` stops while a Linux host is suspended; CLOCK_BOOTTIME does not. Elsewhere
# (macOS's monotonic clock already counts through sleep) the monotonic clock is the one.
lease_clock: Monotonic = _boottime if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic


def utc_now() -> datetime:
    return datetime.now(UTC)
