"""``cancel_on_disconnect``: the upstream wait ends when the client goes, and only then.

The work runs in the caller's task, cancelled at ``http.disconnect`` by a watcher task or by
the server's disconnect signal (both are run for every case here); these
tests pin what that must never change: a disconnect ends the work with
``ClientDisconnected``, a finished work leaves no cancellation behind, and a cancellation
from anyone else stays a cancellation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from idempotency_gateway.asgi import (
    DISCONNECT_EXTENSION,
    ClientDisconnected,
    Message,
    Receive,
    Scope,
    cancel_on_disconnect,
    replay_receive,
)


class Client:
    """An ASGI ``receive`` whose disconnect the test decides, reported either through
    ``receive`` (any server) or through the server's disconnect signal (the gateway's)."""

    def __init__(self, via_signal: bool) -> None:
        self.gone = asyncio.Event()
        self.callbacks: list[Callable[[], None]] = []
        self.scope: Scope = {}
        if via_signal:
            self.scope["extensions"] = {DISCONNECT_EXTENSION: {"signal": self}}

    async def receive(self) -> Message:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    def leave(self) -> None:
        self.gone.set()
        for callback in list(self.callbacks):
            callback()

    # DisconnectSignal
    def reports_for(self, receive: Receive) -> bool:
        return receive == self.receive

    def add(self, callback: Callable[[], None]) -> None:
        self.callbacks.append(callback)
        if self.gone.is_set():
            callback()

    def discard(self, callback: Callable[[], None]) -> None:
        if callback in self.callbacks:
            self.callbacks.remove(callback)


@pytest.fixture(params=[False, True], ids=["watcher", "signal"])
def client(request: pytest.FixtureRequest) -> Client:
    return Client(via_signal=request.param)


async def test_a_disconnect_cancels_the_work_and_says_so(client: Client) -> None:
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
        return await cancel_on_disconnect(client.scope, client.receive, upstream())

    task = asyncio.ensure_future(request())
    await started.wait()
    client.leave()
    with pytest.raises(ClientDisconnected):
        await task
    assert cancelled.is_set()
    assert task.cancelling() == 0


async def test_finished_work_leaves_no_cancellation_behind(client: Client) -> None:

    async def upstream() -> str:
        await asyncio.sleep(0)
        return "answer"

    assert await cancel_on_disconnect(client.scope, client.receive, upstream()) == "answer"
    current = asyncio.current_task()
    assert current is not None
    assert current.cancelling() == 0
    # A deadline later in the same task still expires as a timeout, not as a cancellation.
    with pytest.raises(TimeoutError):
        async with asyncio.timeout(0):
            await asyncio.Event().wait()


async def test_work_that_absorbs_the_cancellation_returns_its_answer_cleanly(
    client: Client,
) -> None:
    waiting = asyncio.Event()

    async def upstream() -> str:
        waiting.set()
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            return "cleaned up"
        return "never"

    async def request() -> tuple[str, int]:
        answer = await cancel_on_disconnect(client.scope, client.receive, upstream())
        current = asyncio.current_task()
        assert current is not None
        return answer, current.cancelling()

    task = asyncio.ensure_future(request())
    await waiting.wait()
    client.leave()
    assert await task == ("cleaned up", 0)


async def test_someone_elses_cancellation_stays_a_cancellation(client: Client) -> None:
    started = asyncio.Event()

    async def upstream() -> str:
        started.set()
        await asyncio.Event().wait()
        return "never"

    async def request() -> str:
        return await cancel_on_disconnect(client.scope, client.receive, upstream())

    task = asyncio.ensure_future(request())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled()


async def test_a_receive_the_signal_does_not_report_for_is_watched_by_receive() -> None:
    """A ``replay_receive`` (a keyed execution's) never disconnects: the server's signal
    speaks for its own ``receive`` only, so the connection's loss cannot cut such work."""
    client = Client(via_signal=True)
    other = Client(via_signal=False)
    started, finished = asyncio.Event(), asyncio.Event()

    async def upstream() -> str:
        started.set()
        await finished.wait()
        return "answer"

    task = asyncio.ensure_future(cancel_on_disconnect(client.scope, other.receive, upstream()))
    await started.wait()
    client.leave()
    assert client.callbacks == []
    finished.set()
    assert await task == "answer"


async def test_a_connection_already_lost_cancels_at_once() -> None:
    client = Client(via_signal=True)
    client.leave()

    async def upstream() -> str:
        await asyncio.Event().wait()
        return "never"

    with pytest.raises(ClientDisconnected):
        await cancel_on_disconnect(client.scope, client.receive, upstream())


@pytest.mark.parametrize("via_signal", [False, True], ids=["watcher", "signal"])
async def test_a_replayed_body_is_not_watched_at_all(via_signal: bool) -> None:
    """A keyed execution's ``replay_receive`` never reports a disconnect: no watcher task
    waits on it (one per keyed request, cancelled at its end, its traceback left for the
    collector), and the connection's loss leaves the work alone."""
    client = Client(via_signal=via_signal)
    receive = replay_receive(b"{}")
    assert await receive() == {"type": "http.request", "body": b"{}", "more_body": False}
    tasks_before = asyncio.all_tasks()
    tasks_during: set[asyncio.Task[object]] = set()
    waiting, finished = asyncio.Event(), asyncio.Event()

    async def upstream() -> str:
        tasks_during.update(asyncio.all_tasks())
        client.leave()
        waiting.set()
        await finished.wait()
        return "answer"

    task = asyncio.ensure_future(cancel_on_disconnect(client.scope, receive, upstream()))
    await waiting.wait()
    assert tasks_during - tasks_before == {task}
    assert client.callbacks == []
    finished.set()
    assert await task == "answer"
