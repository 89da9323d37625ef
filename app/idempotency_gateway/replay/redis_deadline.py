"""``RedisDeadline``: how long the cache waits for Redis, judged by Redis and not by the loop.

A deadline is one timer callback on the running loop that cancels the waiting task: no
``asyncio.timeout`` context, no task of its own, one handle to cancel when Redis answered.

A timer's lateness is the event loop's, not Redis's: when the loop was stalled (a CPU burst
of other requests, a blocking call) the reply may already sit unread in the socket, and on
uvloop timers run before the loop reads its sockets. So a timer that runs more than
``LATE_SHARE`` of the timeout past its due moment gives the call a further ``timeout`` from
now, at most ``MAX_EXTENSIONS`` times: Redis is judged slow only when a whole timeout passed
on a loop that was not late, or after ``1 + MAX_EXTENSIONS`` timeouts whatever the loop did.
"""

from __future__ import annotations

import asyncio

LATE_SHARE = 0.1
MAX_EXTENSIONS = 2


class RedisDeadline:
    """Armed for the current task at construction; ``cancel`` once the call ended, and
    ``expired`` to tell a ``CancelledError`` of the deadline from one of the caller."""

    __slots__ = ("_due", "_extensions", "_fired", "_handle", "_loop", "_task", "_timeout")

    def __init__(self, timeout: float) -> None:
        self._loop = asyncio.get_running_loop()
        task = asyncio.current_task(self._loop)
        assert task is not None, "a Redis call runs in a task"
        self._task = task
        self._timeout = timeout
        self._extensions = 0
        self._fired = False
        self._due = self._loop.time() + timeout
        self._handle = self._loop.call_at(self._due, self._fire)

    def _fire(self) -> None:
        now = self._loop.time()
        if now - self._due > self._timeout * LATE_SHARE and self._extensions < MAX_EXTENSIONS:
            self._extensions += 1
            self._due = now + self._timeout
            self._handle = self._loop.call_at(self._due, self._fire)
            return
        self._fired = True
        self._task.cancel()

    def cancel(self) -> None:
        self._handle.cancel()

    def expired(self) -> bool:
        """True when the cancellation being handled is this deadline's own (and takes it
        back from the task); False when someone else cancelled the task."""
        if not self._fired:
            return False
        # ``uncancel`` counts down the task's pending cancellations: any left are a caller's,
        # which must win, as ``asyncio.timeout`` does.
        return self._task.uncancel() == 0
