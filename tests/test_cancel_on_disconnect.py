"""``cancel_on_disconnect``: the upstream wait ends when the client goes, and only then.

The work runs in the caller's task and a watcher cancels it at ``http.disconnect``; these
tests pin what that must never change: a disconnect ends the work with
``ClientDisconnected``, a finished work leaves no cancellation behind, and a cancellation
from anyone else stays a cancellation.
"""

from __future__ import annotations

import asyncio

import pytest

from idempotency_gateway.asgi import ClientDisconnected, Message, cancel_on_disconnect


class Client:
    """An ASGI ``receive`` whose disconnect the test decides."""

    def __init__(self) -> None:
        self.gone = asyncio.Event()

    async def receive(self) -> Message:
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def test_a_disconnect_cancels_the_work_and_says_so() -> None:
    client = Client()
    started, cancelled = asyncio.Event(), asyncio.Event()

    async def upstream() -> str:
        started.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return "never"

    async def request() -> str:
        return await cancel_on_disconnect(client.receive, upstream())

    task = asyncio.ensure_future(request())
    await started.wait()
    client.gone.set()
    with pytest.raises(ClientDisconnected):
        await task
    assert cancelled.is_set()
    assert task.cancelling() == 0


async def test_finished_work_leaves_no_cancellation_behind() -> None:
    client = Client()

    async def upstream() -> str:
        await asyncio.sleep(0)
        return "answer"

    assert await cancel_on_disconnect(client.receive, upstream()) == "answer"
    current = asyncio.current_task()
    assert current is not None
    assert current.cancelling() == 0
    # A deadline later in the same task still expires as a timeout, not as a cancellation.
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0):
            await asyncio.Event().wait()


async def test_work_that_absorbs_the_cancellation_returns_its_answer_cleanly() -> None:
    client = Client()
    waiting = asyncio.Event()

    async def upstream() -> str:
        waiting.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return "cleaned up"
        return "never"

    async def request() -> tuple[str, int]:
        answer = await cancel_on_disconnect(client.receive, upstream())
        current = asyncio.current_task()
        assert current is not None
        return answer, current.cancelling()

    task = asyncio.ensure_future(request())
    await waiting.wait()
    client.gone.set()
    assert await task == ("cleaned up", 0)


async def test_someone_elses_cancellation_stays_a_cancellation() -> None:
    client = Client()
    started = asyncio.Event()

    async def upstream() -> str:
        started.set()
        await asyncio.Event().wait()
        return "never"

    async def request() -> str:
        return await cancel_on_disconnect(client.receive, upstream())

    task = asyncio.ensure_future(request())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()
