"""Event streams that survive a dropped connection, across real gateway processes.

A fake LLM (``TokenUpstream``) streams one SSE event per token at the pace the test releases
them. Two gateway processes share PostgreSQL and Redis, and two more share only PostgreSQL.
While the first execution of a key streams, a duplicate (same client, same request) through
any process of the Redis pair gets the events so far and follows the rest, after its
``Last-Event-ID`` when it sends one; without Redis only the owner's own process can follow.
The upstream runs once for every key.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from idempotency_gateway.config import StoreConfig
from idempotency_gateway.idempotency.keys import tenant_of
from idempotency_gateway.idempotency.streams import CUT_NOTICE
from idempotency_gateway.storage import open_store
from idempotency_gateway.storage.records import RecordKey
from tests.support import GatewayProcess, eventually, write_config
from tests.support.event_stream_client import RawEventStream
from tests.support.llm_upstream import TokenUpstream, chat, whole_output
from tests.support.redis_nodes import RedisNode
from tests.support.servers import TEST_SCOPE_SECRET

pytestmark = [pytest.mark.multiprocess, pytest.mark.asyncio(loop_scope="module")]

CHAT = "/v1/chat"
# A route whose record keeps a body of at most SMALL bytes.
SMALL_CHAT, SMALL = "/v1/small/chat", 1024
# A route whose followers are cut after a second without an event.
IDLE_CHAT = "/v1/idle/chat"
# A route whose lease runs out a second after its owner dies, and whose next request with
# the key then executes again.
BRIEF_CHAT = "/v1/brief/chat"
# Room for the slow follower's stream, far more than any socket buffer holds.
BIG_STREAM = 16 * 1024 * 1024


def config(upstream_url: str) -> dict[str, Any]:
    return {
        "upstreams": {
            "llm": {
                "url": upstream_url,
                "timeouts": {"connect": "1s", "per_try": "120s", "total": "120s"},
            }
        },
        "routes": [
            {
                "name": "small",
                "match": {"path_prefix": "/v1/small/"},
                "upstream": "llm",
                "idempotency": {"max_stored_body": SMALL, "streaming": {"follow": True}},
            },
            {
                "name": "idle",
                "match": {"path_prefix": "/v1/idle/"},
                "upstream": "llm",
                "idempotency": {"streaming": {"follow": True, "idle": "1s"}},
            },
            {
                "name": "brief",
                "match": {"path_prefix": "/v1/brief/"},
                "upstream": "llm",
                "idempotency": {
                    "lease": "1s",
                    "on_ambiguous": "retry",
                    "streaming": {"follow": True},
                },
            },
            {
                "name": "chat",
                "match": {"path_prefix": "/"},
                "upstream": "llm",
                "idempotency": {
                    "key": "required",
                    "lease": "30s",
                    "max_stored_body": BIG_STREAM,
                    "streaming": {"follow": True},
                },
            },
        ],
        "lifecycle": {"drain_grace": "0s"},
    }


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def llm() -> AsyncIterator[TokenUpstream]:
    async with TokenUpstream() as upstream:
        yield upstream


async def _gateways(
    tmp_path: Path, llm: TokenUpstream, env: dict[str, str], names: tuple[str, str]
) -> AsyncIterator[tuple[GatewayProcess, GatewayProcess]]:
    path = write_config(tmp_path, config(llm.url), name=f"{names[0]}.yaml")
    pair = tuple(GatewayProcess(path, env=env, log_dir=tmp_path, name=name) for name in names)
    try:
        await asyncio.gather(*(gateway.start() for gateway in pair))
        yield pair[0], pair[1]
    finally:
        await asyncio.gather(*(gateway.stop() for gateway in pair), return_exceptions=True)
        for gateway in pair:
            print(f"--- {gateway.name} log tail ---\n{gateway.log_tail()}")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def with_redis(
    tmp_path_factory: pytest.TempPathFactory, llm: TokenUpstream, postgres_url: str, redis_url: str
) -> AsyncIterator[tuple[GatewayProcess, GatewayProcess]]:
    env = {"GATEWAY_DATABASE_URL": postgres_url, "GATEWAY_REDIS_URL": redis_url}
    async for pair in _gateways(tmp_path_factory.mktemp("redis"), llm, env, ("ra", "rb")):
        yield pair


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def without_redis(
    tmp_path_factory: pytest.TempPathFactory, llm: TokenUpstream, postgres_url: str
) -> AsyncIterator[tuple[GatewayProcess, GatewayProcess]]:
    env = {"GATEWAY_DATABASE_URL": postgres_url}
    async for pair in _gateways(tmp_path_factory.mktemp("local"), llm, env, ("la", "lb")):
        yield pair


def keyed(key: str, last_event_id: bytes | None = None) -> list[tuple[bytes, bytes]]:
    headers = [
        (b"Authorization", b"Bearer sk_streams"),
        (b"Idempotency-Key", key.encode()),
        (b"Content-Type", b"application/json"),
    ]
    if last_event_id is not None:
        headers.append((b"Last-Event-ID", last_event_id))
    return headers


class Clients:
    """Opens keyed streams to a gateway; closes every one of them when the test ends."""

    def __init__(self) -> None:
        self.opened: list[RawEventStream] = []

    async def post(
        self,
        gateway: GatewayProcess,
        key: str,
        body: bytes,
        *,
        last_event_id: bytes | None = None,
        receive_buffer: int | None = None,
        path: str = CHAT,
    ) -> RawEventStream:
        stream = await RawEventStream.open(
            gateway.port, path, keyed(key, last_event_id), body, receive_buffer=receive_buffer
        )
        self.opened.append(stream)
        return stream

    async def follow(
        self, gateway: GatewayProcess, key: str, body: bytes, **options: Any
    ) -> RawEventStream:
        """A duplicate that follows (``options`` as ``post`` takes them): through Redis the
        stream's first append may still be on its way (a 409, the contract says), so it
        retries as a client would."""

        async def followed() -> RawEventStream | None:
            stream = await self.post(gateway, key, body, **options)
            return None if stream.status == 409 else stream

        return await eventually(followed, timeout=10.0, message="a follower's answer")


@pytest_asyncio.fixture(loop_scope="module")
async def clients() -> AsyncIterator[Clients]:
    opened = Clients()
    try:
        yield opened
    finally:
        for stream in opened.opened:
            await stream.close()


@dataclass(frozen=True)
class Fleet:
    """Two gateway processes, the upstream behind them and the test's clients."""

    first: GatewayProcess
    other: GatewayProcess
    llm: TokenUpstream
    clients: Clients


@pytest_asyncio.fixture(loop_scope="module")
async def fleet(
    with_redis: tuple[GatewayProcess, GatewayProcess], llm: TokenUpstream, clients: Clients
) -> Fleet:
    return Fleet(*with_redis, llm, clients)


@pytest_asyncio.fixture(loop_scope="module")
async def local(
    without_redis: tuple[GatewayProcess, GatewayProcess], llm: TokenUpstream, clients: Clients
) -> Fleet:
    return Fleet(*without_redis, llm, clients)


@pytest.mark.parametrize(("ids", "last_event_id"), [(True, b"2"), (False, b"3")])
async def test_a_dropped_client_resumes_through_another_process(
    fleet: Fleet, unique: Any, ids: bool, last_event_id: bytes
) -> None:
    """By the upstream's ids (the third event is ``id: 2``), or by count without them."""
    key, body = unique("resume"), chat(8, ids=ids)
    first = await fleet.clients.post(fleet.first, key, body)
    fleet.llm.release(key, 3)
    seen = await first.events(3)
    first.drop()

    retry = await fleet.clients.follow(fleet.other, key, body, last_event_id=last_event_id)
    assert (retry.status, retry.headers["idempotent-replayed"]) == (200, "true")
    assert retry.headers["content-type"].startswith("text/event-stream")
    fleet.llm.release(key, 5)
    rest = await retry.rest()
    assert retry.whole
    assert b"".join(seen) + rest == b"".join(whole_output(8, ids=ids))
    assert fleet.llm.calls[key] == 1


async def test_a_late_follower_gets_the_stream_from_its_start(fleet: Fleet, unique: Any) -> None:
    key, body, expected = unique("late"), chat(6), b"".join(whole_output(6))
    first = await fleet.clients.post(fleet.first, key, body)
    fleet.llm.release(key, 2)
    await first.events(2)
    follower = await fleet.clients.follow(fleet.other, key, body)
    same_process = await fleet.clients.post(fleet.first, key, body)
    fleet.llm.release(key, 4)
    assert await follower.rest() == expected
    assert await same_process.rest() == expected
    assert follower.whole
    assert same_process.whole
    await first.rest()
    assert first.whole
    assert fleet.llm.calls[key] == 1


async def test_a_finished_stream_replays_after_last_event_id(fleet: Fleet, unique: Any) -> None:
    key, body, events = unique("finished"), chat(5, ids=True), whole_output(5, ids=True)
    first = await fleet.clients.post(fleet.first, key, body)
    fleet.llm.release(key, 5)
    assert await first.rest() == b"".join(events)
    assert first.whole

    resumed = await fleet.clients.post(fleet.other, key, body, last_event_id=b"1")
    assert (resumed.status, resumed.headers["idempotent-replayed"]) == (200, "true")
    assert await resumed.events(3) == events[2:]
    assert await resumed.rest() == b""
    assert resumed.whole
    whole = await fleet.clients.post(fleet.other, key, body)
    assert await whole.rest() == b"".join(events)
    assert fleet.llm.calls[key] == 1


async def test_a_different_request_with_the_key_gets_422_while_it_streams(
    fleet: Fleet, unique: Any
) -> None:
    key = unique("mismatch")
    first = await fleet.clients.post(fleet.first, key, chat(3))
    fleet.llm.release(key, 1)
    await first.events(1)
    for gateway in (fleet.first, fleet.other):
        other = await fleet.clients.post(gateway, key, chat(4), last_event_id=b"1")
        assert other.status == 422
        assert b"token" not in await other.rest()
    fleet.llm.release(key, 2)
    assert len(await first.events(2)) == 2
    assert fleet.llm.calls[key] == 1


async def test_without_redis_only_the_owners_process_follows(local: Fleet, unique: Any) -> None:
    key, body, events = unique("local"), chat(4), whole_output(4)
    first = await local.clients.post(local.first, key, body)
    local.llm.release(key, 1)
    seen = await first.events(1)
    first.drop()

    elsewhere = await local.clients.post(local.other, key, body, last_event_id=b"1")
    assert elsewhere.status == 409
    assert elsewhere.headers["retry-after"] == "1"
    await elsewhere.rest()
    retry = await local.clients.post(local.first, key, body, last_event_id=b"1")
    assert retry.status == 200
    local.llm.release(key, 3)
    assert [*seen, await retry.rest()] == [events[0], b"".join(events[1:])]
    assert retry.whole
    assert local.llm.calls[key] == 1


async def _a_stalled_follower_never_stalls_the_first_client(
    fleet: Fleet, key: str, follower_gateway: GatewayProcess
) -> None:
    """Eight megabytes of events, far beyond what the stalled follower's socket and the
    gateway's write buffer hold: the first client still gets every one of them."""
    tokens, padding = 2000, 4096
    body = chat(tokens, padding=padding)
    expected = b"".join(whole_output(tokens, padding=padding))
    first = await fleet.clients.post(fleet.first, key, body)
    fleet.llm.release(key, 1)
    await first.events(1)
    stalled = await fleet.clients.follow(follower_gateway, key, body, receive_buffer=4096)
    assert stalled.status == 200
    fleet.llm.release(key, tokens - 1)
    rest = await first.rest()
    assert first.whole
    assert len(rest) == len(expected) - len(expected.partition(b"\n\n")[0]) - 2
    # Read at last, the follower's copy is whole as well: it was read from the recorded part.
    late = await stalled.rest()
    assert late == expected
    assert stalled.whole
    assert fleet.llm.calls[key] == 1


async def test_a_follower_that_stops_reading_never_stalls_the_first_client(
    fleet: Fleet, unique: Any
) -> None:
    """Through Redis, from another process."""
    await _a_stalled_follower_never_stalls_the_first_client(fleet, unique("slow"), fleet.other)


async def test_a_follower_in_the_owners_process_that_stops_reading_never_stalls_it(
    local: Fleet, unique: Any
) -> None:
    """Without Redis, in the owner's own process."""
    await _a_stalled_follower_never_stalls_the_first_client(
        local, unique("slow-local"), local.first
    )


async def test_a_stream_beyond_the_record_limit_is_cut_for_followers(
    fleet: Fleet, unique: Any
) -> None:
    """The follower sees the cut (an SSE comment, no end of body); the first client gets the
    whole stream, and the record says its body was too large to keep, as without followers."""
    key, body = unique("large"), chat(100)
    events = whole_output(100)
    assert len(b"".join(events)) > SMALL
    first = await fleet.clients.post(fleet.first, key, body, path=SMALL_CHAT)
    fleet.llm.release(key, 2)
    await first.events(2)
    follower = await fleet.clients.follow(fleet.other, key, body, path=SMALL_CHAT)
    fleet.llm.release(key, 98)
    assert await first.rest() == b"".join(events[2:])
    assert first.whole
    cut = await follower.rest()
    assert not follower.whole
    assert cut.endswith(CUT_NOTICE)
    assert b"".join(events).startswith(cut.removesuffix(CUT_NOTICE))

    of_record = await fleet.clients.post(fleet.other, key, body, path=SMALL_CHAT)
    assert (of_record.status, of_record.headers["idempotency-body-omitted"]) == (200, "true")
    assert await of_record.rest() == b""
    assert fleet.llm.calls[key] == 1


async def test_a_follower_is_cut_when_the_stream_goes_idle(fleet: Fleet, unique: Any) -> None:
    """The follower is cut once the upstream has been silent for the route's ``idle``; the
    owner's client still gets the whole stream, and the cut follower's retry with its
    ``Last-Event-ID`` gets the rest from the record."""
    key, body, events = unique("idle"), chat(3), whole_output(3)
    first = await fleet.clients.post(fleet.first, key, body, path=IDLE_CHAT)
    fleet.llm.release(key, 1)
    await first.events(1)
    follower = await fleet.clients.follow(fleet.other, key, body, path=IDLE_CHAT)
    assert await follower.rest() == events[0] + CUT_NOTICE
    assert not follower.whole

    fleet.llm.release(key, 2)
    assert await first.rest() == b"".join(events[1:])
    assert first.whole
    resumed = await fleet.clients.post(fleet.other, key, body, path=IDLE_CHAT, last_event_id=b"1")
    assert await resumed.rest() == b"".join(events[1:])
    assert resumed.whole
    assert fleet.llm.calls[key] == 1


# Past Python's 4300-digit cap on int(): a count no stream reaches, never a failed answer.
HUGE_LAST_EVENT_ID = b"9" * 5000


async def test_a_huge_numeric_last_event_id_skips_the_stream_live_and_finished(
    fleet: Fleet, unique: Any
) -> None:
    key, body = unique("huge-id"), chat(3)
    first = await fleet.clients.post(fleet.first, key, body)
    fleet.llm.release(key, 1)
    await first.events(1)
    follower = await fleet.clients.follow(fleet.other, key, body, last_event_id=HUGE_LAST_EVENT_ID)
    assert follower.status == 200
    fleet.llm.release(key, 2)
    assert await follower.rest() == b""
    assert follower.whole
    await first.rest()

    replayed = await fleet.clients.post(fleet.other, key, body, last_event_id=HUGE_LAST_EVENT_ID)
    assert (replayed.status, replayed.headers["idempotent-replayed"]) == (200, "true")
    assert await replayed.rest() == b""
    assert replayed.whole
    assert fleet.llm.calls[key] == 1


async def test_another_client_with_the_key_never_follows_the_stream(
    fleet: Fleet, unique: Any
) -> None:
    """Same key, same body, another credential: its own execution, never the first's events."""
    key, body = unique("tenant"), chat(2)
    first = await fleet.clients.post(fleet.first, key, body)
    fleet.llm.release(key, 1)
    await first.events(1)
    stranger = await RawEventStream.open(
        fleet.other.port,
        CHAT,
        [(b"Authorization", b"Bearer sk_stranger"), *keyed(key)[1:]],
        body,
    )
    fleet.clients.opened.append(stranger)
    assert "idempotent-replayed" not in stranger.headers
    fleet.llm.release(key, 3)
    assert await stranger.rest() == b"".join(whole_output(2))
    assert stranger.whole
    await first.rest()
    assert fleet.llm.calls[key] == 2


async def test_a_follower_of_a_killed_owner_never_gets_the_next_executions_events(
    fleet: Fleet, unique: Any, tmp_path: Path, postgres_url: str, redis_url: str
) -> None:
    """The owner's process is SIGKILLed three events in; once its lease is over a retry
    executes again, replacing the key's Redis stream. The follower still blocked after the
    third event is cut: the next execution's fourth event onwards is not the rest of the
    answer it has, and an answer joined from two executions must never look whole."""
    key, body, events = unique("killed"), chat(6), whole_output(6)
    env = {"GATEWAY_DATABASE_URL": postgres_url, "GATEWAY_REDIS_URL": redis_url}
    path = write_config(tmp_path, config(fleet.llm.url), name="victim.yaml")
    async with GatewayProcess(path, env=env, log_dir=tmp_path, name="victim") as victim:
        first = await fleet.clients.post(victim, key, body, path=BRIEF_CHAT)
        fleet.llm.release(key, 3)
        await first.events(3)
        follower = await fleet.clients.follow(fleet.other, key, body, path=BRIEF_CHAT)
        assert await follower.events(3) == events[:3]
        await victim.kill()

    store = open_store(postgres_url, StoreConfig())
    try:
        record_key = RecordKey(
            tenant_of(
                [(b"authorization", b"Bearer sk_streams")],
                (b"authorization",),
                secret=TEST_SCOPE_SECRET.encode(),
            ),
            f"POST {BRIEF_CHAT}",
            key,
        )

        async def lease_over() -> bool:
            record = await store.get(record_key)
            assert record is not None
            return record.lease_expires_at < datetime.now(UTC)

        # Before that a retry would follow the dead owner's stream until it went idle.
        await eventually(lease_over, message="the killed owner's lease running out")
    finally:
        await store.close()
    retry = await fleet.clients.post(fleet.first, key, body, path=BRIEF_CHAT)
    assert "idempotent-replayed" not in retry.headers
    # More than the retry needs: the killed owner's upstream call may take some before it
    # sees its connection gone.
    fleet.llm.release(key, 12)
    assert await retry.rest() == b"".join(events)
    assert retry.whole
    rest = await follower.rest()
    assert not follower.whole
    assert rest == CUT_NOTICE
    assert fleet.llm.calls[key] == 2


async def test_redis_killed_mid_stream_cuts_the_follower_and_not_the_first_client(
    llm: TokenUpstream, clients: Clients, unique: Any, tmp_path: Path, postgres_url: str
) -> None:
    key, body, events = unique("redis-killed"), chat(5), whole_output(5)
    async with RedisNode() as redis:
        env = {"GATEWAY_DATABASE_URL": postgres_url, "GATEWAY_REDIS_URL": redis.url}
        async for first_gateway, other_gateway in _gateways(
            tmp_path, llm, env, ("redis-owner", "redis-follower")
        ):
            first = await clients.post(first_gateway, key, body)
            llm.release(key, 2)
            await first.events(2)
            follower = await clients.follow(other_gateway, key, body)
            assert await follower.events(2) == events[:2]
            await redis.kill()
            llm.release(key, 3)
            assert await first.rest() == b"".join(events[2:])
            assert first.whole
            assert await follower.rest() == CUT_NOTICE
            assert not follower.whole
            resumed = await clients.post(other_gateway, key, body, last_event_id=b"2")
            assert (resumed.status, resumed.headers["idempotent-replayed"]) == (200, "true")
            assert await resumed.rest() == b"".join(events[2:])
            assert resumed.whole
    assert llm.calls[key] == 1


async def test_an_empty_last_event_id_is_no_last_event_id(fleet: Fleet, unique: Any) -> None:
    """An empty value is what the SSE standard's reset (``id:`` alone) leaves, and what a
    browser then does not send at all: the client has nothing yet, so it gets every event."""
    key, body, events = unique("empty-id"), chat(3, ids=True), whole_output(3, ids=True)
    first = await fleet.clients.post(fleet.first, key, body)
    fleet.llm.release(key, 1)
    await first.events(1)
    follower = await fleet.clients.follow(fleet.other, key, body, last_event_id=b" ")
    fleet.llm.release(key, 2)
    assert await follower.rest() == b"".join(events)
    assert follower.whole
    await first.rest()
    replayed = await fleet.clients.post(fleet.other, key, body, last_event_id=b"")
    assert await replayed.rest() == b"".join(events)
    assert fleet.llm.calls[key] == 1
