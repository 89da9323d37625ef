"""The live tail of a stream still being executed, for duplicates that follow it.

The owner of a key publishes its answer's head and then each event as it comes; a duplicate
of the same request (same key, so the same client scope, and the same request hash) reads
what was published so far and then follows. Every follower reads the one recorded copy at its
own pace, so the owner never waits for a follower and a follower holds no more than the
event it is sending: a slow follower falls behind, never in front of the owner.

The copy is bounded by the route's ``max_stored_body``: a stream that outgrows it, or an
owner whose outcome is not recorded, ends ``CUT`` for its followers, as does a stream that
goes ``idle`` for too long. ``LocalLiveStreams`` keeps it in this process (other processes
cannot follow); ``RedisLiveStreams`` (``redis_live_streams``) in a Redis stream every process
reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from idempotency_gateway.asgi import Headers
from idempotency_gateway.replay.cache import cache_key
from idempotency_gateway.storage.records import RecordKey


class StreamEnd(StrEnum):
    RECORDED = "recorded"  # whole, and the key's record holds its outcome
    CUT = "cut"  # stops short: followers retry with Last-Event-ID for the answer of record


@dataclass(frozen=True, slots=True)
class StreamHead:
    request_hash: str
    status: int
    headers: Headers


class LivePublisher(Protocol):
    """The owner's side; neither call ever waits."""

    def event(self, raw: bytes) -> None: ...

    def end(self, how: StreamEnd) -> None: ...


class LiveFollower(Protocol):
    head: StreamHead
    ended: StreamEnd  # how the stream ended, once ``events`` is exhausted

    def events(self) -> AsyncGenerator[bytes]: ...


class LiveStreams(Protocol):
    def publish(
        self, key: RecordKey, head: StreamHead, *, max_bytes: int, idle: float
    ) -> LivePublisher:
        """Start the key's live stream; ``idle``: how long it may go without an event."""
        ...

    async def follow(
        self, key: RecordKey, request_hash: str, *, idle: float
    ) -> LiveFollower | None:
        """The key's live stream when it is this request's; ``None`` when there is none."""
        ...

    async def close(self) -> None: ...


def stream_name(key: RecordKey) -> str:
    """One name per key; the replay cache's hash tag, so it shares its Redis Cluster slot."""
    return cache_key(key, prefix="idgw:s:")


class _LocalStream:
    def __init__(self, head: StreamHead, max_bytes: int) -> None:
        self.head = head
        self.events: list[bytes] = []
        self.ended: StreamEnd | None = None
        self.news = asyncio.Event()
        self._room = max_bytes

    def event(self, raw: bytes) -> None:
        if self.ended is not None:
            return
        self._room -= len(raw)
        if self._room < 0:
            # The record keeps no body past this size either: followers retry for it.
            self.end(StreamEnd.CUT)
            return
        self.events.append(raw)
        self._wake()

    def end(self, how: StreamEnd) -> None:
        if self.ended is None:
            self.ended = how
            self._wake()

    def _wake(self) -> None:
        self.news.set()
        self.news = asyncio.Event()


class _LocalFollower:
    def __init__(self, stream: _LocalStream, idle: float) -> None:
        self.head = stream.head
        self.ended = StreamEnd.CUT
        self._stream = stream
        self._idle = idle

    async def events(self) -> AsyncGenerator[bytes]:
        stream, sent = self._stream, 0
        while True:
            while sent < len(stream.events):
                sent += 1
                yield stream.events[sent - 1]
            if stream.ended is not None:
                self.ended = stream.ended
                return
            try:
                async with asyncio.timeout(self._idle):
                    await stream.news.wait()
            except TimeoutError:
                return


class _LocalPublisher:
    def __init__(self, streams: LocalLiveStreams, name: str, stream: _LocalStream) -> None:
        self._streams, self._name, self._stream = streams, name, stream

    def event(self, raw: bytes) -> None:
        self._stream.event(raw)

    def end(self, how: StreamEnd) -> None:
        self._stream.end(how)
        self._streams.forget(self._name, self._stream)


class LocalLiveStreams:
    """Live streams within this process."""

    def __init__(self) -> None:
        self._streams: dict[str, _LocalStream] = {}

    def publish(
        self, key: RecordKey, head: StreamHead, *, max_bytes: int, idle: float
    ) -> LivePublisher:
        name = stream_name(key)
        # A takeover's owner replaces a stream its fenced-off predecessor left behind.
        self._streams[name] = stream = _LocalStream(head, max_bytes)
        return _LocalPublisher(self, name, stream)

    def forget(self, name: str, stream: _LocalStream) -> None:
        if self._streams.get(name) is stream:
            del self._streams[name]

    async def follow(
        self, key: RecordKey, request_hash: str, *, idle: float
    ) -> LiveFollower | None:
        stream = self._streams.get(stream_name(key))
        if stream is None or stream.head.request_hash != request_hash:
            return None
        return _LocalFollower(stream, idle)

    async def close(self) -> None:
        for stream in list(self._streams.values()):
            stream.end(StreamEnd.CUT)
        self._streams.clear()
