"""``RedisDeadline``: how long the cache waits for Redis, judged by Redis and not by the loop.

A deadline cancels the waiting task: no ``asyncio.timeout`` context, no task of its own.
Every deadline of one cache has the same timeout, so on one loop they fall due in the order
they were armed: they wait in a queue (``_Deadlines``) served by one timer at its head. Arming
and cancelling one is a queue append and a flag, where a timer of its own per Redis call was
a timer started and stopped on the loop each time (2.4 against 0.6 us, ``benchmarks/RESULTS.md``).

A timer's lateness is the event loop's, not Redis's: when the loop was stalled (a CPU burst
of other requests, a blocking call) the reply may already sit unread in the socket, and on
uvloop timers run before the loop reads its sockets. So a deadline found more than
``LATE_SHARE`` of the timeout past its due moment gives the call a further ``timeout`` from
now, at most ``MAX_EXTENSIONS`` times: Redis is judged slow only when a whole timeout passed
on a loop that was not late, or after ``1 + MAX_EXTENSIONS`` timeouts whatever the loop did.
"""

from __future__ import annotations

import asyncio
from collections import deque

LATE_SHARE = 0.1
MAX_EXTENSIONS = 2
# A loop may run a timer up to its clock's resolution early (uvloop's is a millisecond): a
# deadline this close to due is due.
_EARLY = 0.001


class RedisDeadline:
    """Armed for the current task by ``RedisDeadlines.arm``; ``cancel`` once the call ended,
    and ``expired`` to tell a ``CancelledError`` of the deadline from one of the caller."""

    __slots__ = ("_cancelled", "_due", "_extensions", "_fired", "_task")

    def __init__(self, task: asyncio.Task[object], due: float) -> None:
        self._task = task
        self._due = due
        self._extensions = 0
        self._fired = False
        self._cancelled = False

    def cancel(self) -> None:
        self._cancelled = True

    def expired(self) -> bool:
        """True when the cancellation being handled is this deadline's own (and takes it
        back from the task); False when someone else cancelled the task."""
        if not self._fired:
            return False
        # ``uncancel`` counts down the task's pending cancellations: any left are a caller's,
        # which must win, as ``asyncio.timeout`` does.
        return self._task.uncancel() == 0


class _Deadlines:
    """The armed deadlines of one loop, due in the order they were armed: one timer, at the
    first one not yet cancelled."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout: float) -> None:
        self._loop = loop
        self._timeout = timeout
        self._armed: deque[RedisDeadline] = deque()
        self._timer: asyncio.TimerHandle | None = None

    def __bool__(self) -> bool:
        return bool(self._armed)

    def arm(self, task: asyncio.Task[object]) -> RedisDeadline:
        deadline = RedisDeadline(task, self._loop.time() + self._timeout)
        self._armed.append(deadline)
        if self._timer is None:
            self._timer = self._loop.call_at(deadline._due, self._fire)
        return deadline

    def _fire(self) -> None:
        self._timer = None
        now = self._loop.time()
        armed = self._armed
        # The ones armed before now: an extended one goes to the back, for a later turn.
        for _ in range(len(armed)):
            deadline = armed[0]
            if deadline._cancelled:
                armed.popleft()
                continue
            if deadline._due > now + _EARLY:
                break
            armed.popleft()
            late = now - deadline._due > self._timeout * LATE_SHARE
            if late and deadline._extensions < MAX_EXTENSIONS:
                # Due a whole timeout from now: no sooner than any deadline armed before
                # now, so the queue stays in order.
                deadline._extensions += 1
                deadline._due = now + self._timeout
                armed.append(deadline)
                continue
            deadline._fired = True
            deadline._task.cancel()
        if armed:
            self._timer = self._loop.call_at(armed[0]._due, self._fire)


class RedisDeadlines:
    """Deadlines of ``timeout`` for the calls of one cache, on whichever loop each runs."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._by_loop: dict[asyncio.AbstractEventLoop, _Deadlines] = {}

    def arm(self) -> RedisDeadline:
        """A deadline for the current task, ``timeout`` from now."""
        loop = asyncio.get_running_loop()
        task = asyncio.current_task(loop)
        assert task is not None, "a Redis call runs in a task"
        deadlines = self._by_loop.get(loop)
        if deadlines is None:
            # A loop that closed leaves its queue behind: dropped here, when another loop
            # arms its first deadline and the closed one's queue holds nothing armed.
            self._by_loop = {other: queue for other, queue in self._by_loop.items() if queue}
            deadlines = self._by_loop[loop] = _Deadlines(loop, self.timeout)
        return deadlines.arm(task)
