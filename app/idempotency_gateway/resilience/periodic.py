"""The shape of every background loop: one step, again and again, through any outage.

The sweeper, the breaker-override sync, the cache-invalidation poll and the stuck-record
sampler each do one step against the database every few seconds. A step that fails is
logged through the loop's ``DegradationLog`` (once per interval, with a count of the rest)
and never ends the task: a loop that died would stop syncing breakers for good, silently.
Failures in a row lengthen the pause by full jitter, so the workers of a fleet do not all
knock at once on a database that is coming back.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable

from idempotency_gateway.resilience.backoff import full_jitter
from idempotency_gateway.telemetry.degradation import DegradationLog

# The most a run of failures adds to a loop's pause.
BACKOFF_CAP = 30.0


async def repeat(
    step: Callable[[], Awaitable[object]],
    *,
    every: float,
    degradation: DegradationLog,
    on_failure: Callable[[], object] | None = None,
    wait_first: bool = False,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    uniform: Callable[[float, float], float] = random.uniform,
) -> None:
    """Run ``step`` every ``every`` seconds until cancelled (after a first pause when
    ``wait_first``). ``on_failure``: what a failed step leaves to undo."""
    if wait_first:
        await sleep(every)
    failures = 0
    while True:
        try:
            await step()
        except Exception as exc:
            failures += 1
            degradation.failed(exc)
            if on_failure is not None:
                on_failure()
        else:
            failures = 0
        backoff = (
            full_jitter(failures - 1, base=every, cap=BACKOFF_CAP, uniform=uniform)
            if failures
            else 0.0
        )
        await sleep(every + backoff)
