"""The Redis cache's deadlines: one timer per loop serves them all, in the order they fall due;
a cancelled one never fires, a live one behind cancelled ones does, a late loop extends."""

from __future__ import annotations

import asyncio
import time

import pytest

from idempotency_gateway.replay.redis_deadline import LATE_SHARE, RedisDeadline, RedisDeadlines

TIMEOUT = 0.05
# A deadline that never fired would leave its wait hanging: bounded, the test fails instead.
BOUND = 5.0


async def wait_under(deadlines: RedisDeadlines, done: asyncio.Event) -> tuple[bool, RedisDeadline]:
    """Wait for ``done`` under a deadline: ``(True, deadline)`` if it came first, ``(False,
    deadline)`` if the deadline cancelled the wait."""
    deadline = deadlines.arm()
    try:
        await done.wait()
    except asyncio.CancelledError:
        if not deadline.expired():
            raise
        return False, deadline
    finally:
        deadline.cancel()
    return True, deadline


async def test_a_deadline_cancels_the_wait_once_its_timeout_passed() -> None:
    deadlines = RedisDeadlines(TIMEOUT)
    loop = asyncio.get_running_loop()
    started = loop.time()

    answered, _ = await asyncio.wait_for(wait_under(deadlines, asyncio.Event()), BOUND)

    assert not answered
    assert loop.time() - started >= TIMEOUT - 0.002


async def test_a_live_deadline_behind_cancelled_ones_still_fires() -> None:
    deadlines = RedisDeadlines(TIMEOUT)
    answered = asyncio.Event()
    quick = [asyncio.create_task(wait_under(deadlines, answered)) for _ in range(5)]
    await asyncio.sleep(0)  # every quick wait is armed
    answered.set()
    # Not a wait for anything: the slow deadline falls due half a timeout after the quick
    # ones, so the timer set for them must be set again for it.
    await asyncio.sleep(TIMEOUT / 2)
    slow = asyncio.create_task(wait_under(deadlines, asyncio.Event()))

    results = await asyncio.gather(*quick)
    slow_answered, _ = await asyncio.wait_for(slow, BOUND)

    assert all(answered for answered, _ in results)
    assert not slow_answered


async def test_a_callers_cancellation_is_the_callers() -> None:
    deadlines = RedisDeadlines(TIMEOUT)
    waiting = asyncio.create_task(wait_under(deadlines, asyncio.Event()))
    await asyncio.sleep(0)
    waiting.cancel()

    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_a_loop_late_by_more_than_a_share_of_the_timeout_extends_the_deadline() -> None:
    deadlines = RedisDeadlines(TIMEOUT)
    answered = asyncio.Event()
    loop = asyncio.get_running_loop()
    waiting = asyncio.create_task(wait_under(deadlines, answered))
    await asyncio.sleep(0)  # armed
    # Blocks the loop on purpose, well past the due moment: the timer runs late.
    time.sleep(TIMEOUT * (2 + LATE_SHARE))  # noqa: ASYNC251
    # The answer arrives in the iteration the late timer runs in: the extension lets it win.
    loop.call_soon(answered.set)

    came_first, _ = await waiting

    assert came_first


def test_each_loop_gets_its_own_timer() -> None:
    deadlines = RedisDeadlines(TIMEOUT)

    async def one() -> bool:
        answered, _ = await asyncio.wait_for(wait_under(deadlines, asyncio.Event()), BOUND)
        return answered

    assert asyncio.run(one()) is False
    assert asyncio.run(one()) is False  # a second loop, after the first closed
