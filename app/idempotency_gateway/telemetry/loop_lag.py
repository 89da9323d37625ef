"""The ``event_loop_lag_seconds`` histogram: how late this worker's event loop runs a timer.

One timer per worker, re-armed each time it fires. It is due every ``every`` seconds; when it
runs, the time past its due moment is how long the loop was busy with something that did not
yield (a request's CPU work, a blocking call) or the whole process did not run (CPU
starvation, a frozen VM, SIGSTOP). While the lag stays near zero every request on the worker
is served as soon as its bytes arrive; a lag of seconds means leases and deadlines of every
request on it were eaten by that stall. No task and no await per sample: one handle and one
histogram observation every ``every`` seconds.

A stall shorter than ``every`` may fall between two timers and be seen shorter than it was,
or not at all; one longer than ``every`` is always seen at least ``every`` short of its length.
"""

from __future__ import annotations

import asyncio

from idempotency_gateway.telemetry.metrics import EVENT_LOOP_LAG

SAMPLE_EVERY = 0.1


class LoopLagMonitor:
    def __init__(self, *, every: float = SAMPLE_EVERY) -> None:
        self.every = every
        self._timer: asyncio.TimerHandle | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._arm(loop, loop.time() + self.every)

    def _arm(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        self._timer = loop.call_at(due, self._fired, loop, due)

    def _fired(self, loop: asyncio.AbstractEventLoop, due: float) -> None:
        now = loop.time()
        EVENT_LOOP_LAG.observe(now - due)
        # Due again one interval from now, not from ``due``: after a stall the next sample
        # measures the loop afresh instead of a burst of timers that all fire late at once.
        self._arm(loop, now + self.every)

    def stop(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
