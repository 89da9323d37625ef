"""``GroupCommit``: the statements of one event-loop iteration sent as one.

The first caller of an iteration starts a flush task; its first step runs once the loop has
run every task that was ready, so whatever they asked for goes out together, and a lone
request waits for nothing. One batch of a kind is in flight per store (per worker process):
what arrives meanwhile forms the next batch, sent as soon as the one in flight answers, so
batches grow with load instead of statements. A batch holds at most ``max_batch`` items and
each key at most once: a second item with the same key waits for the next batch, so two
requests with one key behave as two statements in a row would.

The batch runs as one statement; its failure is every caller's ``StoreUnavailable``.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Generic, TypeVar

from idempotency_gateway.errors import StoreUnavailable

Item = TypeVar("Item")
Result = TypeVar("Result")


class GroupCommit(Generic[Item, Result]):
    """Runs ``run(items)`` for the items submitted in one iteration; ``run`` answers one
    result (or ``StoreUnavailable``) per item, in order."""

    def __init__(
        self,
        run: Callable[[Sequence[Item]], Awaitable[Sequence[Result | StoreUnavailable]]],
        *,
        key: Callable[[Item], Hashable],
        max_batch: int,
    ) -> None:
        self._run = run
        self._key = key
        self._max_batch = max_batch
        self._pending: list[tuple[Item, asyncio.Future[Result]]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def submit(self, item: Item) -> Result:
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush())
        return await future

    def _take_batch(self) -> list[tuple[Item, asyncio.Future[Result]]]:
        batch: list[tuple[Item, asyncio.Future[Result]]] = []
        later: list[tuple[Item, asyncio.Future[Result]]] = []
        keys: set[Hashable] = set()
        for entry in self._pending:
            key = self._key(entry[0])
            if entry[1].done():
                continue  # its caller was cancelled before the batch went out
            if len(batch) < self._max_batch and key not in keys:
                keys.add(key)
                batch.append(entry)
            else:
                later.append(entry)
        self._pending = later
        return batch

    async def _flush(self) -> None:
        try:
            while batch := self._take_batch():
                await self._send(batch)
        finally:
            self._flusher = None
            if self._pending:
                # Submitted after the last batch was taken, while this task was ending.
                self._flusher = asyncio.create_task(self._flush())

    async def _send(self, batch: list[tuple[Item, asyncio.Future[Result]]]) -> None:
        try:
            answers = await self._run([item for item, _ in batch])
        except StoreUnavailable as error:
            for _, future in batch:
                _answer(future, error)
            return
        except BaseException as error:
            # Cancelled (the loop is closing) or a bug: no caller waits forever for it.
            for _, future in batch:
                if future.done():
                    continue
                if isinstance(error, asyncio.CancelledError):
                    future.cancel()
                else:
                    future.set_exception(error)
            raise
        for (_, future), answer in zip(batch, answers, strict=True):
            _answer(future, answer)


def _answer(future: asyncio.Future[Result], answer: Result | StoreUnavailable) -> None:
    if future.done():
        return  # the caller was cancelled; what its item did is the store's to tell later
    if isinstance(answer, StoreUnavailable):
        # Each caller raises an error of its own: one shared instance would collect every
        # caller's traceback.
        own = copy.copy(answer)
        own.__cause__ = answer.__cause__
        future.set_exception(own)
    else:
        future.set_result(answer)
