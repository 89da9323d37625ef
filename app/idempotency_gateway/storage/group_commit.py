"""``GroupCommit``: the statements of one event-loop iteration sent as one.

The first caller of an iteration starts a flush task; its first step runs once the loop has
run every task that was ready, so whatever they asked for goes out together, and a lone
request waits for nothing. One batch of a kind is in flight per store (per worker process):
what arrives meanwhile forms the next batch, sent as soon as the one in flight answers, so
batches grow with load instead of statements. A batch holds at most ``max_batch`` keys and
each key once. A second item with a key already in the batch waits for the next batch, so two
requests with one key behave as two statements in a row would; or, where the store says what
a second statement right after the first would answer (``follow``: a reserve sees the row the
first left), it rides along and gets that answer, with no statement of its own. A burst of
one key (a client's retries, a storm of duplicates) then costs one statement, not one each,
one after the other.

The batch runs as one statement; its failure is every caller's ``StoreUnavailable``.
"""

from __future__ import annotations

import asyncio
import copy
from collections.abc import Awaitable, Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from idempotency_gateway.errors import StoreUnavailable

Item = TypeVar("Item")
Result = TypeVar("Result")

_Entry = tuple[Item, "asyncio.Future[Result]"]


@dataclass
class _Batch(Generic[Item, Result]):
    """One statement's entries, one per key, and the entries that ride along with one of
    them (by its index in ``own``)."""

    own: list[_Entry[Item, Result]] = field(default_factory=list)
    followers: list[tuple[int, _Entry[Item, Result]]] = field(default_factory=list)

    def futures(self) -> list[asyncio.Future[Result]]:
        return [future for _, future in self.own] + [f for _, (_, f) in self.followers]


class GroupCommit(Generic[Item, Result]):
    """Runs ``run(items)`` for the items submitted in one iteration; ``run`` answers one
    result (or ``StoreUnavailable``) per item, in order."""

    def __init__(
        self,
        run: Callable[[Sequence[Item]], Awaitable[Sequence[Result | StoreUnavailable]]],
        *,
        key: Callable[[Item], Hashable],
        max_batch: int,
        follow: Callable[[Item, Result], Result] | None = None,
    ) -> None:
        """``follow(item, first)``: the answer of ``item`` had it run right after the item
        with its key whose answer was ``first``; ``None``: it waits for the next batch."""
        self._run = run
        self._key = key
        self._max_batch = max_batch
        self._follow = follow
        self._pending: list[_Entry[Item, Result]] = []
        self._flusher: asyncio.Task[None] | None = None

    async def submit(self, item: Item) -> Result:
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        self._pending.append((item, future))
        if self._flusher is None:
            self._flusher = asyncio.create_task(self._flush())
        return await future

    def _take_batch(self) -> _Batch[Item, Result]:
        batch: _Batch[Item, Result] = _Batch()
        later: list[_Entry[Item, Result]] = []
        index_of: dict[Hashable, int] = {}
        for entry in self._pending:
            if entry[1].done():
                continue  # its caller was cancelled before the batch went out
            key = self._key(entry[0])
            first = index_of.get(key)
            if first is not None and self._follow is not None:
                batch.followers.append((first, entry))
            elif first is None and len(batch.own) < self._max_batch:
                index_of[key] = len(batch.own)
                batch.own.append(entry)
            else:
                later.append(entry)
        self._pending = later
        return batch

    async def _flush(self) -> None:
        try:
            while (batch := self._take_batch()).own:
                await self._send(batch)
        finally:
            self._flusher = None
            if self._pending:
                # Submitted after the last batch was taken, while this task was ending.
                self._flusher = asyncio.create_task(self._flush())

    async def _send(self, batch: _Batch[Item, Result]) -> None:
        try:
            answers = await self._run([item for item, _ in batch.own])
            if len(answers) != len(batch.own):
                # Checked before any is handed out: a miscounted answer is another's.
                raise RuntimeError(f"{len(answers)} answers to a batch of {len(batch.own)}")
            for (_, future), answer in zip(batch.own, answers, strict=True):
                _answer(future, answer)
            follow = self._follow
            for first, (item, future) in batch.followers:
                assert follow is not None  # followers are taken only for a store that says how
                answer = answers[first]
                _answer(
                    future, answer if isinstance(answer, StoreUnavailable) else follow(item, answer)
                )
        except StoreUnavailable as error:
            for future in batch.futures():
                _answer(future, error)
        except BaseException as error:
            # Cancelled (the loop is closing) or a bug (in the statement or in handing out its
            # answers): no caller waits forever for it.
            for future in batch.futures():
                if future.done():
                    continue
                if isinstance(error, asyncio.CancelledError):
                    future.cancel()
                else:
                    future.set_exception(error)
            raise


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
