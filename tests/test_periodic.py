"""``repeat``: the background loops' one shape, told apart only by their step.

Time is injected: ``sleep`` records each pause and, after a given number, stops the loop the
way shutdown does (cancellation), so each test reads the exact pauses taken.
"""

from __future__ import annotations

import asyncio

import pytest

from idempotency_gateway.errors import StoreUnavailable
from idempotency_gateway.resilience.periodic import BACKOFF_CAP, repeat
from idempotency_gateway.telemetry.degradation import DegradationLog

EVERY = 2.0


class Steps:
    """A step that fails as scripted, and a sleep that records pauses then cancels."""

    def __init__(self, script: list[bool], *, pauses: int) -> None:
        self.script = list(script)  # True: the step succeeds
        self.ran = 0
        self.pauses: list[float] = []
        self.limit = pauses

    async def step(self) -> None:
        self.ran += 1
        if not self.script.pop(0):
            raise StoreUnavailable("the database does not answer")

    async def sleep(self, seconds: float) -> None:
        self.pauses.append(seconds)
        if len(self.pauses) >= self.limit:
            raise asyncio.CancelledError


def _highest(low: float, high: float) -> float:
    return high


async def _run(steps: Steps, degradation: DegradationLog, **options: object) -> None:
    with pytest.raises(asyncio.CancelledError):
        await repeat(
            steps.step,
            every=EVERY,
            degradation=degradation,
            sleep=steps.sleep,
            uniform=_highest,
            **options,  # type: ignore[arg-type]
        )


async def test_failures_are_logged_and_lengthen_the_pause_until_a_step_succeeds() -> None:
    steps = Steps([False, False, False, True, False], pauses=5)
    degradation = DegradationLog("store", fallback="nothing")

    await _run(steps, degradation)

    assert steps.ran == 5
    assert degradation.failures == 4
    # Full jitter at its highest: every, doubling per failure in a row; a success resets it.
    assert steps.pauses == [EVERY + 2.0, EVERY + 4.0, EVERY + 8.0, EVERY, EVERY + 2.0]


async def test_the_backoff_is_capped() -> None:
    steps = Steps([False] * 8, pauses=8)

    await _run(steps, DegradationLog("store", fallback="nothing"))

    assert steps.pauses[-1] == EVERY + BACKOFF_CAP
    assert max(steps.pauses) == EVERY + BACKOFF_CAP


async def test_a_failure_runs_what_it_leaves_to_undo_and_a_loop_may_wait_first() -> None:
    steps = Steps([False, True], pauses=3)
    undone: list[int] = []

    await _run(
        steps,
        DegradationLog("store", fallback="nothing"),
        on_failure=lambda: undone.append(steps.ran),
        wait_first=True,
    )

    assert undone == [1]
    assert steps.ran == 2
    assert steps.pauses == [EVERY, EVERY + 2.0, EVERY]
