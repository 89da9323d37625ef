"""The live streams on their own: in process and through a real Redis.

What the gateway tests cannot force: a batch of appends sent twice (as after a timeout that
came once Redis had applied it) lands once; a new owner's stream replaces what an earlier
owner of the key left; a stream past its size is cut for followers; a follower sees only
the stream of its own request; with Redis away nothing waits for it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable

import pytest
import redis.asyncio

from idempotency_gateway.replay.live_streams import (
    LiveStreams,
    LocalLiveStreams,
    StreamEnd,
    StreamHead,
    stream_name,
)
from idempotency_gateway.replay.redis_appends import Append, Appender
from idempotency_gateway.replay.redis_connect import connect_redis
from idempotency_gateway.replay.redis_live_streams import RedisLiveStreams
from idempotency_gateway.storage.records import RecordKey
from idempotency_gateway.telemetry.degradation import DegradationLog
from tests.support import free_port

HEAD = StreamHead("hash-a", 200, [(b"content-type", b"text/event-stream")])


@pytest.fixture(params=["in-process", "redis"])
async def live(request: pytest.FixtureRequest, redis_url: str) -> AsyncIterator[LiveStreams]:
    streams: LiveStreams
    if request.param == "redis":
        streams = RedisLiveStreams(
            redis=connect_redis(redis_url, timeout=1.0, connect_timeout=1.0), timeout=1.0
        )
    else:
        streams = LocalLiveStreams()
    yield streams
    await streams.close()


@pytest.fixture
def key(unique: Callable[[str], str]) -> RecordKey:
    return RecordKey("scope", "POST /v1/chat", unique("live"))


async def sent(live: LiveStreams) -> None:
    """Through Redis, until the appends so far are there (in process they are at once)."""
    if isinstance(live, RedisLiveStreams):
        await live.appender.flushed()


async def followed(
    live: LiveStreams, key: RecordKey, request_hash: str
) -> tuple[list[bytes], StreamEnd] | None:
    follower = await live.follow(key, request_hash, idle=5.0)
    if follower is None:
        return None
    return [raw async for raw in follower.events()], follower.ended


async def test_a_follower_gets_every_event_and_the_end(live: LiveStreams, key: RecordKey) -> None:
    publisher = live.publish(key, HEAD, max_bytes=1024, idle=5.0)
    for index in range(3):
        publisher.event(b"data: %d\n\n" % index)
    publisher.end(StreamEnd.RECORDED)
    events = [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    if isinstance(live, LocalLiveStreams):
        # In process a stream is forgotten at its end: the record answers from then on.
        assert await followed(live, key, "hash-a") is None
        return
    await sent(live)
    assert await followed(live, key, "hash-a") == (events, StreamEnd.RECORDED)


async def test_only_the_same_request_follows(live: LiveStreams, key: RecordKey) -> None:
    publisher = live.publish(key, HEAD, max_bytes=1024, idle=5.0)
    publisher.event(b"data: 0\n\n")
    await sent(live)
    assert await followed(live, key, "hash-b") is None
    other_key = RecordKey("other-scope", key.operation, key.idempotency_key)
    assert await followed(live, other_key, "hash-a") is None
    publisher.end(StreamEnd.RECORDED)


async def test_a_stream_past_its_size_is_cut(live: LiveStreams, key: RecordKey) -> None:
    publisher = live.publish(key, HEAD, max_bytes=20, idle=5.0)
    follower = (
        await live.follow(key, "hash-a", idle=5.0) if isinstance(live, LocalLiveStreams) else None
    )
    publisher.event(b"data: 0123456789\n\n")  # 18 bytes: fits
    publisher.event(b"data: 0123456789\n\n")  # past 20: the stream ends here
    publisher.event(b"data: never\n\n")
    publisher.end(StreamEnd.RECORDED)  # too late: it is cut already
    if isinstance(live, RedisLiveStreams):
        await sent(live)
        assert await followed(live, key, "hash-a") == ([b"data: 0123456789\n\n"], StreamEnd.CUT)
        return
    assert follower is not None
    assert [raw async for raw in follower.events()] == [b"data: 0123456789\n\n"]
    assert follower.ended is StreamEnd.CUT


async def test_a_batch_sent_twice_lands_once(
    redis_client: redis.asyncio.Redis, redis_url: str, key: RecordKey
) -> None:
    client = connect_redis(redis_url, timeout=1.0, connect_timeout=1.0)
    appender = Appender(
        client, timeout=1.0, degradation=DegradationLog("test appends", fallback="none")
    )
    name = stream_name(key)
    await redis_client.xadd(name, {b"e": b"left by an earlier owner"}, id="0-9")
    batch = [
        Append(name, "0-1", {b"h": b"head"}, 5.0, 0.0, first=True),
        Append(name, "0-2", {b"e": b"one"}, 5.0, 0.0),
    ]
    try:
        assert await appender._send(batch)
        assert await appender._send(batch)
        assert await appender._send([Append(name, "0-3", {b"e": b"two"}, 5.0, 0.0)])
    finally:
        await appender.close()
        await client.close()
    assert await redis_client.xrange(name) == [
        (b"0-1", {b"h": b"head"}),
        (b"0-2", {b"e": b"one"}),
        (b"0-3", {b"e": b"two"}),
    ]
    assert 0 < await redis_client.ttl(name) <= 5


async def test_with_redis_away_the_owner_goes_on_and_nobody_follows(key: RecordKey) -> None:
    """Redis refusing every connection: publishing never fails or waits, a duplicate finds
    no stream (it gets the 409), and the entries are given up once their stream is idle."""
    nowhere = f"redis://127.0.0.1:{free_port()}/0"
    live = RedisLiveStreams(
        redis=connect_redis(nowhere, timeout=0.5, connect_timeout=0.5), timeout=0.5
    )
    try:
        publisher = live.publish(key, HEAD, max_bytes=1024, idle=0.5)
        publisher.event(b"data: 0\n\n")
        publisher.end(StreamEnd.RECORDED)
        assert await live.follow(key, "hash-a", idle=0.5) is None
        await live.appender.flushed()  # given up: nothing waits for Redis any more
    finally:
        await live.close()
