"""Live streams through Redis: one Redis stream per key, which every gateway process reads.

The owner appends the head, then one entry per event, then the end (XADD), each batch
refreshing the stream's expiry (``idle``). Its appends go to the process's ``Appender``,
which sends every stream's waiting entries in one pipelined round trip, so Redis never sets
the owner's pace; what waits is bounded by the stream's own cap (the route's
``max_stored_body``), as the owner's captured answer is. A follower reads the entries from
the head on and then blocks for new ones (XREAD BLOCK), a batch at a time, on the adapter's
connection whose reads may wait. Redis is reached only through a ``RedisAdapter`` of the live
streams' own, one node or a cluster alike.

Fail soft, as the replay cache does: Redis down means no follower finds the stream (a 409,
as without the feature) or a follower's stream is cut; the owner's answer never notices.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import AsyncGenerator

import orjson

from idempotency_gateway.replay.live_streams import (
    LiveFollower,
    LivePublisher,
    StreamEnd,
    StreamHead,
    stream_name,
)
from idempotency_gateway.replay.redis_adapter import Fields, RedisAdapter
from idempotency_gateway.replay.redis_appends import Appender
from idempotency_gateway.replay.redis_connect import connect_redis
from idempotency_gateway.replay.redis_unavailable import RedisUnavailable
from idempotency_gateway.storage.records import RecordKey
from idempotency_gateway.telemetry.degradation import DegradationLog

# A batch of appends and a follower's first look. Longer than the replay cache's: appends
# are off the owner's path (a slow Redis only delays followers, and a failed batch is sent
# again), and a follower that gives up gets a 409 and comes back a second later.
LIVE_STREAM_TIMEOUT = 1.0
# Entries a follower takes per read: what one follower holds at most.
_FOLLOW_BATCH = 64
_HEAD, _EVENT, _END = b"h", b"e", b"x"
# Every entry names the execution that wrote it. An owner that dies mid-stream leaves its
# followers blocked after its last entry; the next owner of the key replaces the stream
# with entries numbered from the start, and the ones past that point would otherwise
# reach those followers as the rest of the first execution's answer.
_WRITER = b"w"


def _encode_head(head: StreamHead) -> bytes:
    return orjson.dumps(
        {
            "r": head.request_hash,
            "s": head.status,
            "h": [
                [name.decode("latin-1"), value.decode("latin-1")] for name, value in head.headers
            ],
        }
    )


def _decode_head(fields: Fields) -> StreamHead | None:
    try:
        data = orjson.loads(fields[_HEAD])
        return StreamHead(
            data["r"],
            int(data["s"]),
            [(name.encode("latin-1"), value.encode("latin-1")) for name, value in data["h"]],
        )
    except (KeyError, TypeError, ValueError):
        return None  # not a head this gateway wrote: nothing to follow


class _RedisPublisher:
    def __init__(
        self, appender: Appender, name: str, head: StreamHead, *, max_bytes: int, idle: float
    ) -> None:
        self._appender, self._name, self._idle = appender, name, idle
        self._entries = 1
        self._room = max_bytes
        self._ended = False
        self._writer = secrets.token_bytes(8)
        appender.add(
            name, "0-1", {_HEAD: _encode_head(head), _WRITER: self._writer}, idle=idle, first=True
        )

    def event(self, raw: bytes) -> None:
        if self._ended:
            return
        self._room -= len(raw)
        if self._room < 0:
            self.end(StreamEnd.CUT)
            return
        self._append({_EVENT: raw})

    def end(self, how: StreamEnd) -> None:
        if not self._ended:
            self._append({_END: how.value.encode()})
            self._ended = True

    def _append(self, fields: Fields) -> None:
        self._entries += 1
        fields[_WRITER] = self._writer
        self._appender.add(self._name, f"0-{self._entries}", fields, idle=self._idle)


class _RedisFollower:
    def __init__(
        self,
        redis: RedisAdapter,
        name: str,
        after: bytes,
        head: StreamHead,
        *,
        writer: bytes | None,
        idle: float,
    ) -> None:
        self.head = head
        self.ended = StreamEnd.CUT
        self._redis, self._name, self._after, self._idle = redis, name, after, idle
        self._writer = writer

    async def events(self) -> AsyncGenerator[bytes]:
        after = self._after
        while True:
            try:
                entries = await self._redis.read_stream(
                    self._name, after, count=_FOLLOW_BATCH, block_ms=int(self._idle * 1000)
                )
            except RedisUnavailable:
                return
            if not entries:
                return  # idle for too long: cut
            for entry_id, fields in entries:
                if fields.get(_WRITER) != self._writer:
                    return  # another execution's entries: this one was cut short
                after = entry_id
                if _EVENT in fields:
                    yield fields[_EVENT]
                elif _END in fields:
                    self.ended = StreamEnd(fields[_END].decode())
                    return


class RedisLiveStreams:
    """Live streams every gateway process sharing the Redis can follow."""

    def __init__(self, *, redis: RedisAdapter, timeout: float) -> None:
        """``redis``: an adapter of their own, closed with them; its quick calls (appends, the
        first look) under ``timeout``, followers' reads on its blocking connection."""
        self.redis, self.timeout = redis, timeout
        self.degradation = DegradationLog("Redis live streams", fallback="duplicates get a 409")
        self.appender = Appender(redis, timeout=timeout, degradation=self.degradation)

    def publish(
        self, key: RecordKey, head: StreamHead, *, max_bytes: int, idle: float
    ) -> LivePublisher:
        return _RedisPublisher(
            self.appender, stream_name(key), head, max_bytes=max_bytes, idle=idle
        )

    async def follow(
        self, key: RecordKey, request_hash: str, *, idle: float
    ) -> LiveFollower | None:
        name = stream_name(key)
        try:
            async with asyncio.timeout(self.timeout):
                first = await self.redis.first_entry(name)
        except (RedisUnavailable, TimeoutError) as exc:
            self.degradation.failed(exc)
            return None
        if not first:
            return None
        entry_id, fields = first[0]
        head = _decode_head(fields)
        if head is None or head.request_hash != request_hash:
            return None
        return _RedisFollower(
            self.redis, name, entry_id, head, writer=fields.get(_WRITER), idle=idle
        )

    async def close(self) -> None:
        # Appends still waiting go out: followers in other processes get their end.
        await self.appender.close()
        with contextlib.suppress(RedisUnavailable):
            await self.redis.close()


def redis_live_streams(redis_url: str) -> RedisLiveStreams:
    timeout = LIVE_STREAM_TIMEOUT
    return RedisLiveStreams(
        redis=connect_redis(redis_url, timeout=timeout, connect_timeout=timeout), timeout=timeout
    )
