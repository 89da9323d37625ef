"""The replay cache is a fast path that never decides, and never fails a request.

Proves that cache entries survive the trip through their byte format and that anything that is
not a well-formed entry for exactly the key asked for (garbage, truncated, another version,
another key's entry, an in-flight status) reads as a miss; that the in-process LRU keeps its
bounds; that Redis entries never outlive their record, are written only for finished answers,
are backfilled from PostgreSQL, and that a poisoned entry never replays a wrong answer. Over
real HTTP it shows the fast path at work (replays and 422s with PostgreSQL unreachable) and
that a dead Redis, at start or killed under load, costs no answer and no second execution,
is logged once, stops being asked, and is found again when it returns.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import signal
import time
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from typing import Any

import httpx
import orjson
import pytest
import redis.asyncio
from redis.exceptions import RedisError

from idempotency_gateway.replay.cache import (
    INVALIDATION_GUARD,
    CachedAnswer,
    InProcessCache,
    cache_key,
    decode,
    encode,
)
from idempotency_gateway.replay.redis_adapter import INVALIDATED
from idempotency_gateway.replay.redis_cache import RedisCache
from idempotency_gateway.replay.redis_connect import connect_redis
from idempotency_gateway.resilience.breaker import BreakerState
from idempotency_gateway.storage.records import RecordKey, Status, StoredResponse
from tests.support import RecordingUpstream, eventually, free_port
from tests.support.charges import CHARGE
from tests.support.clock import ManualClock
from tests.support.gateway import (
    RunningGateway,
    StartGateway,
    route,
    unreachable_database_url,
)
from tests.support.keyed import is_replay, record_key, send_keyed

# Gateways restarted around Redis: seconds. test_replay_headers, test_redis_round_trips and
# test_gateway_behaviour keep replays in the fast loop.
pytestmark = pytest.mark.slow

BINARY_BODY = b'{"id": "ch_1"}\n\x00\x01 line two\r\n\x00\xff\xfe trailing\n'
ONE_HOUR = 3600.0


def answer_for(
    key: RecordKey,
    *,
    body: bytes = BINARY_BODY,
    status: Status = Status.SUCCEEDED,
    response_status: int = 201,
    body_omitted: bool = False,
    expires_in: float = ONE_HOUR,
    request_hash: str = "a" * 64,
) -> CachedAnswer:
    response = StoredResponse(
        response_status,
        [("content-type", "application/json"), ("x-charge", "ch_1; v=2")],
        body,
        body_omitted,
    )
    return CachedAnswer(key, request_hash, status, response, time.monotonic() + expires_in)


def entry_with(answer: CachedAnswer, **meta_changes: Any) -> bytes:
    """``answer`` encoded, with fields of its JSON metadata replaced (or removed, with None)."""
    meta, _, body = encode(answer).partition(b"\n")
    fields = orjson.loads(meta) | meta_changes
    kept = {name: value for name, value in fields.items() if value is not None}
    return orjson.dumps(kept) + b"\n" + body


KEY = RecordKey("scope-1", "POST /v1/charges", "key-1")
OTHER_KEY = RecordKey("scope-1", "POST /v1/charges", "key-2")


# ------------------------------------------------------------------ the byte format


@pytest.mark.parametrize("body_omitted", [False, True], ids=["with-body", "body-omitted"])
def test_encoded_entry_decodes_to_the_same_answer(body_omitted: bool) -> None:
    answer = answer_for(
        KEY,
        body=b"" if body_omitted else BINARY_BODY,
        status=Status.FAILED_FINAL,
        response_status=409,
        body_omitted=body_omitted,
    )

    assert decode(encode(answer), KEY, expires_at=answer.expires_at) == answer


MALFORMED_ENTRIES: dict[str, Callable[[CachedAnswer], bytes]] = {
    "empty": lambda _: b"",
    "garbage": lambda _: b"\x00\x9f\x92\x96 not an entry\n\xff\xfe",
    "no-separator": lambda _: b"just some words",
    "truncated-json": lambda answer: encode(answer)[:40] + b"\n",
    "json-array": lambda _: b'["v", 1]\n',
    "json-null": lambda _: b"null\n",
    "older-format-version": lambda answer: entry_with(answer, v=1),
    "foreign-entry": lambda _: encode(answer_for(OTHER_KEY)),
    "key-of-wrong-shape": lambda answer: entry_with(answer, k=["scope-1", "POST /v1/charges"]),
    "in-progress": lambda answer: entry_with(answer, s=Status.IN_PROGRESS.value),
    "failed-retryable": lambda answer: entry_with(answer, s=Status.FAILED_RETRYABLE.value),
    "unknown-status": lambda answer: entry_with(answer, s="MAYBE"),
    "headers-not-pairs": lambda answer: entry_with(answer, rh=[["content-type"]]),
    "status-not-a-number": lambda answer: entry_with(answer, rs="created"),
}


@pytest.mark.parametrize("make_entry", MALFORMED_ENTRIES.values(), ids=MALFORMED_ENTRIES.keys())
def test_decode_turns_anything_but_an_entry_for_this_key_into_a_miss(
    make_entry: Callable[[CachedAnswer], bytes],
) -> None:
    assert decode(make_entry(answer_for(KEY)), KEY, expires_at=time.monotonic()) is None


# ------------------------------------------------------------------ in-process LRU


def keys(count: int) -> list[RecordKey]:
    return [RecordKey("scope-1", "POST /v1/charges", f"key-{index}") for index in range(count)]


async def cached(cache: InProcessCache, selection: list[RecordKey]) -> list[RecordKey]:
    return [key for key in selection if await cache.get(key) is not None]


async def test_in_process_cache_evicts_the_least_recently_used_entry_past_max_entries() -> None:
    cache = InProcessCache(max_entries=3, max_bytes=1024 * 1024)
    a, b, c, d = keys(4)
    for key in (a, b, c):
        await cache.put(answer_for(key))
    assert await cache.get(a) is not None  # a is now the most recently used

    await cache.put(answer_for(d))

    assert len(cache) == 3
    assert await cached(cache, [a, b, c, d]) == [a, c, d]


async def test_in_process_cache_total_body_bytes_never_exceed_max_bytes() -> None:
    cache = InProcessCache(max_entries=1000, max_bytes=100)
    sizes = [40, 30, 20, 50, 10, 100, 5, 60]
    stored = keys(len(sizes))
    for index, (key, size) in enumerate(zip(stored, sizes, strict=True)):
        await cache.put(answer_for(key, body=bytes([index]) * size))
        assert cache.size_bytes <= 100

    # Oldest first out: the 100-byte entry took all the room, then 5 + 60 bytes came after it.
    remaining = await cached(cache, stored)
    assert remaining == stored[-2:]
    assert cache.size_bytes == 5 + 60


async def test_in_process_cache_refuses_an_entry_larger_than_max_bytes() -> None:
    cache = InProcessCache(max_entries=1000, max_bytes=100)
    small, huge = keys(2)
    await cache.put(answer_for(small, body=b"s" * 60))

    await cache.put(answer_for(huge, body=b"h" * 101))

    assert await cache.get(huge) is None
    assert await cache.get(small) is not None
    assert cache.size_bytes == 60


async def test_in_process_cache_treats_an_expired_entry_as_a_miss_and_drops_it() -> None:
    cache = InProcessCache(max_entries=10, max_bytes=1024)
    expired, live = keys(2)
    await cache.put(answer_for(expired, body=b"e" * 10, expires_in=-1.0))
    await cache.put(answer_for(live, body=b"l" * 10))

    assert await cache.get(expired) is None
    assert await cache.get(live) is not None
    assert (len(cache), cache.size_bytes) == (1, 10)


# ------------------------------------------------------------------ RedisCache itself

MAX_ENTRY_BYTES = 1024
# Redis keeps time in whole, cached milliseconds and starts a TTL when the SET arrives.
REDIS_CLOCK_SLACK_MS = 50


def assert_ttl_follows_remaining_life(ttl_ms: int, remaining_seconds: float) -> None:
    """The Redis TTL is the record's remaining life: never longer, and not far shorter."""
    remaining_ms = remaining_seconds * 1000
    assert remaining_ms - 1000 < ttl_ms <= remaining_ms + REDIS_CLOCK_SLACK_MS


@pytest.fixture
async def redis_cache(redis_url: str) -> AsyncIterator[RedisCache]:
    client = connect_redis(redis_url, timeout=1.0, connect_timeout=1.0)
    cache = RedisCache(client, timeout=1.0, max_entry_bytes=MAX_ENTRY_BYTES)
    yield cache
    await cache.close()


@pytest.fixture
def fresh_key(unique: Callable[[str], str]) -> RecordKey:
    return RecordKey("scope-redis", "POST /v1/charges", unique("redis-cache"))


async def test_redis_cache_returns_what_was_put_and_expires_it_with_the_record(
    redis_cache: RedisCache, redis_client: redis.asyncio.Redis, fresh_key: RecordKey
) -> None:
    answer = answer_for(fresh_key, expires_in=1.5)

    await redis_cache.put(answer)
    looked_at = time.monotonic()
    ttl_ms = await redis_client.pttl(cache_key(fresh_key))
    found = await redis_cache.get(fresh_key)

    assert found is not None
    assert (found.key, found.request_hash, found.response) == (
        answer.key,
        answer.request_hash,
        answer.response,
    )
    assert_ttl_follows_remaining_life(ttl_ms, answer.expires_at - looked_at)


@pytest.mark.parametrize(
    "answer_options",
    [{"expires_in": -0.5}, {"body": b"x" * (MAX_ENTRY_BYTES + 1)}],
    ids=["past-its-expiry", "over-max-entry-size"],
)
async def test_redis_cache_does_not_store(
    redis_cache: RedisCache,
    redis_client: redis.asyncio.Redis,
    fresh_key: RecordKey,
    answer_options: dict[str, Any],
) -> None:
    await redis_cache.put(answer_for(fresh_key, **answer_options))

    assert await redis_client.exists(cache_key(fresh_key)) == 0


@pytest.mark.parametrize(
    "make_entry",
    [
        MALFORMED_ENTRIES["garbage"],
        lambda _: encode(answer_for(OTHER_KEY)),
        lambda answer: entry_with(answer, v=1),
    ],
    ids=["garbage", "foreign-entry", "older-format-version"],
)
async def test_redis_cache_reads_a_bad_entry_as_a_miss(
    redis_cache: RedisCache,
    redis_client: redis.asyncio.Redis,
    fresh_key: RecordKey,
    make_entry: Callable[[CachedAnswer], bytes],
) -> None:
    await redis_client.set(cache_key(fresh_key), make_entry(answer_for(fresh_key)), ex=60)

    assert await redis_cache.get(fresh_key) is None
    assert not redis_cache.degraded  # a bad entry is not a sick Redis


async def test_an_answer_read_before_an_operators_delete_is_not_put_back_after_it(
    redis_cache: RedisCache, redis_client: redis.asyncio.Redis, fresh_key: RecordKey
) -> None:
    """A replay that read the record just before an operator deleted or expired it stores
    its answer after the operator's last delete of the entry: refused, for
    ``INVALIDATION_GUARD``, as in each process's own copies. Before, the old answer went
    back into Redis for the rest of the record's life and was replayed for it."""
    answer = answer_for(fresh_key, expires_in=3600)
    name = cache_key(fresh_key)
    await redis_cache.put(answer)

    assert await redis_cache.delete(fresh_key) is True  # the operator's
    await redis_cache.put(answer)  # the replay that read the record before the change

    assert await redis_cache.get(fresh_key) is None
    assert not redis_cache.degraded  # the marker is a miss, not a bad entry
    assert await redis_client.get(name) == INVALIDATED
    assert 0 < await redis_client.pttl(name) <= INVALIDATION_GUARD * 1000

    # Once the guard is over, answers are stored again (the key executed anew).
    await redis_client.pexpire(name, 1)

    async def marker_gone() -> bool:
        return await redis_client.exists(name) == 0

    await eventually(marker_gone, timeout=5.0, message="the marker gone")
    await redis_cache.put(answer)
    found = await redis_cache.get(fresh_key)
    assert found is not None
    assert found.response == answer.response


# ------------------------------------------------------------------ through the gateway


@pytest.fixture
async def cached_gateway(
    start_gateway: StartGateway, postgres_url: str, redis_url: str
) -> RunningGateway:
    """PostgreSQL decides, the test Redis caches, and no in-process tier sits in front of
    Redis (``max_entries: 0``): every replay shows what Redis holds."""
    return await start_gateway(
        postgres_url, keyed=True, redis_url=redis_url, cache={"max_entries": 0}
    )


def entry_name(key: str) -> str:
    return cache_key(record_key(key))


async def stored_entry(redis_client: redis.asyncio.Redis, key: str) -> CachedAnswer | None:
    """The Redis entry under ``key``'s name, decoded for exactly that key (``None``: absent
    or not a well-formed entry of this key)."""
    raw = await redis_client.get(entry_name(key))
    assert raw is None or isinstance(raw, bytes), raw
    # What Redis holds, compared as stored: Redis's TTL, not the entry, says how long it lives.
    return decode(raw or b"", record_key(key), expires_at=0.0)


async def cached_after_answer(redis_client: redis.asyncio.Redis, key: str) -> None:
    """The owner warms the cache just after its client has the answer: wait for that."""
    await eventually(lambda: redis_client.exists(entry_name(key)), message=f"{key} cached")


def assert_replay_of(replay: httpx.Response, original: httpx.Response) -> None:
    assert original.status_code == 201
    assert not is_replay(original)
    assert (replay.status_code, is_replay(replay)) == (201, True)
    assert replay.content == original.content


async def test_finished_answer_is_cached_no_longer_than_its_record_lives(
    start_gateway: StartGateway,
    postgres_url: str,
    redis_url: str,
    redis_client: redis.asyncio.Redis,
    unique: Callable[[str], str],
) -> None:
    gateway = await start_gateway(
        postgres_url,
        keyed=True,
        redis_url=redis_url,
        routes=[route("/", key="required", ttl="30s", lease="5s")],
    )
    key = unique("ttl")

    original = await send_keyed(gateway.client, key)
    await cached_after_answer(redis_client, key)
    record = await gateway.app.store.get(record_key(key))
    looked_at = datetime.now(UTC)
    ttl_ms = await redis_client.pttl(entry_name(key))

    assert original.status_code == 201
    assert record is not None
    assert_ttl_follows_remaining_life(ttl_ms, (record.expires_at - looked_at).total_seconds())
    entry = await stored_entry(redis_client, key)
    assert entry is not None
    assert entry.response.body == original.content


async def test_in_flight_request_is_never_cached(
    cached_gateway: RunningGateway,
    upstream: RecordingUpstream,
    redis_client: redis.asyncio.Redis,
    unique: Callable[[str], str],
) -> None:
    key = unique("in-flight")
    owner = asyncio.create_task(send_keyed(cached_gateway.client, key, behavior="gate=held"))
    await upstream.wait_arrived("held")

    absent_while_held = await redis_client.exists(entry_name(key))
    duplicate = await send_keyed(cached_gateway.client, key)
    absent_after_409 = await redis_client.exists(entry_name(key))
    upstream.release("held")
    original = await owner

    assert (absent_while_held, absent_after_409) == (0, 0)
    assert duplicate.status_code == 409
    assert original.status_code == 201
    assert await redis_client.exists(entry_name(key)) == 1
    assert upstream.count(key) == 1


async def test_replay_from_postgres_backfills_a_missing_redis_entry(
    cached_gateway: RunningGateway,
    upstream: RecordingUpstream,
    redis_client: redis.asyncio.Redis,
    unique: Callable[[str], str],
) -> None:
    key = unique("backfill")
    original = await send_keyed(cached_gateway.client, key)
    await cached_after_answer(redis_client, key)
    assert await redis_client.delete(entry_name(key)) == 1

    replay = await send_keyed(cached_gateway.client, key)

    assert_replay_of(replay, original)
    entry = await stored_entry(redis_client, key)
    assert entry is not None
    assert entry.response.body == original.content
    assert upstream.count(key) == 1


async def poison_with_another_keys_entry(
    redis_client: redis.asyncio.Redis, key: str, true_entry: CachedAnswer
) -> None:
    """A well-formed entry of another key, with this request's hash, under this key's name."""
    foreign = CachedAnswer(
        record_key(key + "-other"),
        true_entry.request_hash,
        Status.SUCCEEDED,
        StoredResponse(200, [("content-type", "application/json")], b'{"wrong": true}'),
        true_entry.expires_at,
    )
    await redis_client.set(entry_name(key), encode(foreign), ex=60)


async def poison_with_garbage(
    redis_client: redis.asyncio.Redis, key: str, _true_entry: CachedAnswer
) -> None:
    await redis_client.set(entry_name(key), b"\x00garbage\n{not json", ex=60)


@pytest.mark.parametrize(
    "poison", [poison_with_garbage, poison_with_another_keys_entry], ids=["garbage", "foreign"]
)
async def test_poisoned_redis_entry_falls_back_to_the_true_answer_and_is_repaired(
    cached_gateway: RunningGateway,
    upstream: RecordingUpstream,
    redis_client: redis.asyncio.Redis,
    unique: Callable[[str], str],
    poison: Callable[[redis.asyncio.Redis, str, CachedAnswer], Any],
) -> None:
    key = unique("poisoned")
    original = await send_keyed(cached_gateway.client, key)
    await cached_after_answer(redis_client, key)
    true_entry = await stored_entry(redis_client, key)
    assert true_entry is not None
    await poison(redis_client, key, true_entry)

    replay = await send_keyed(cached_gateway.client, key)

    assert_replay_of(replay, original)
    assert await stored_entry(redis_client, key) == true_entry
    assert upstream.count(key) == 1


async def start_gateway_without_postgres(
    start_gateway: StartGateway, redis_url: str
) -> RunningGateway:
    """A gateway sharing the test Redis whose PostgreSQL refuses every connection."""
    return await start_gateway(
        unreachable_database_url(),
        keyed=True,
        redis_url=redis_url,
        store={"connect_timeout": "300ms"},
    )


async def test_replay_is_served_from_redis_while_postgres_is_unreachable(
    start_gateway: StartGateway,
    cached_gateway: RunningGateway,
    upstream: RecordingUpstream,
    redis_url: str,
    unique: Callable[[str], str],
) -> None:
    key, new_key = unique("fast-path"), unique("fast-path-new")
    original = await send_keyed(cached_gateway.client, key)
    without_postgres = await start_gateway_without_postgres(start_gateway, redis_url)

    replay = await send_keyed(without_postgres.client, key)
    new = await send_keyed(without_postgres.client, new_key)

    assert_replay_of(replay, original)
    assert new.status_code == 503  # fail closed: a new key needs the durable record
    assert (upstream.count(key), upstream.count(new_key)) == (1, 0)


async def test_key_reused_for_a_different_request_gets_422_from_redis_without_postgres(
    start_gateway: StartGateway,
    cached_gateway: RunningGateway,
    upstream: RecordingUpstream,
    redis_url: str,
    unique: Callable[[str], str],
) -> None:
    """The engine trusts a well-formed entry for exactly this key: its request hash decides
    a mismatch as the record would, with no SQL (the other gateway has no PostgreSQL)."""
    key = unique("mismatch")
    original = await send_keyed(cached_gateway.client, key)
    without_postgres = await start_gateway_without_postgres(start_gateway, redis_url)

    reused = await send_keyed(without_postgres.client, key, json={**CHARGE, "amount": 2000})

    assert original.status_code == 201
    assert reused.status_code == 422
    assert upstream.count(key) == 1


# ------------------------------------------------------------------ Redis down


def redis_warnings(caplog: pytest.LogCaptureFixture, what: str) -> int:
    return sum(
        1
        for record in caplog.records
        if record.levelno == logging.WARNING and record.getMessage().startswith(what)
    )


async def test_gateway_with_redis_down_answers_from_postgres_and_stops_asking_redis(
    start_gateway: StartGateway,
    postgres_url: str,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    gateway = await start_gateway(
        postgres_url,
        keyed=True,
        redis_url=f"redis://127.0.0.1:{free_port()}/0",
        cache={"timeout": "50ms", "max_entries": 0},
    )
    cache = gateway.app.cache
    assert isinstance(cache, RedisCache)
    answers: dict[str, list[httpx.Response]] = {}

    for index in range(10):  # 30 requests: each key once, then twice more
        key = unique(f"redis-down-{index}")
        answers[key] = [await send_keyed(gateway.client, key) for _ in range(3)]

    for key, (original, *replays) in answers.items():
        for replay in replays:
            assert_replay_of(replay, original)
        assert upstream.count(key) == 1
    assert cache.degraded
    assert cache.breaker.state in (BreakerState.OPEN, BreakerState.HALF_OPEN)
    # Each request makes a get and a put: some 60 calls without the breaker.
    assert cache.degradation.failures < 10
    assert redis_warnings(caplog, "Redis cache unavailable") == 1
    assert redis_warnings(caplog, "Redis wake-ups unavailable") <= 1


class RedisServer:
    """A redis-server of the test's own, on a loopback port: killed and restarted at will."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"redis://127.0.0.1:{port}/0"
        self._proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        self._proc = await asyncio.create_subprocess_exec(
            *("redis-server", "--port", str(self.port), "--bind", "127.0.0.1"),
            *("--save", "", "--appendonly", "no", "--daemonize", "no"),
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        client = redis.asyncio.Redis.from_url(self.url)
        try:
            await eventually(self._answers_ping(client), message=f"redis-server on {self.port}")
        finally:
            await client.aclose()

    def _answers_ping(self, client: redis.asyncio.Redis) -> Callable[[], Any]:
        async def ping() -> bool:
            assert self._proc is not None
            assert self._proc.returncode is None, "redis-server exited before answering"
            try:
                return bool(await client.ping())
            except (RedisError, OSError):
                return False

        return ping

    async def kill(self) -> None:
        if self._proc is not None and self._proc.returncode is None:
            self._proc.send_signal(signal.SIGKILL)
            await self._proc.wait()


@pytest.fixture
async def own_redis() -> AsyncIterator[RedisServer]:
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed: this test kills and restarts its own Redis")
    server = RedisServer(free_port())
    await server.start()
    try:
        yield server
    finally:
        await server.kill()


DUPLICATES_PER_KEY = 5


async def test_redis_killed_under_duplicate_load_costs_no_answer_and_no_second_execution(
    start_gateway: StartGateway,
    postgres_url: str,
    upstream: RecordingUpstream,
    own_redis: RedisServer,
    unique: Callable[[str], str],
) -> None:
    gateway = await start_gateway(
        postgres_url,
        keyed=True,
        redis_url=own_redis.url,
        cache={"timeout": "250ms", "max_entries": 0},
    )
    cache = gateway.app.cache
    assert isinstance(cache, RedisCache)
    finished = [unique(f"finished-{index}") for index in range(3)]
    in_flight = [unique(f"in-flight-{index}") for index in range(3)]
    originals = {key: await send_keyed(gateway.client, key) for key in finished}
    owners = {
        key: asyncio.create_task(send_keyed(gateway.client, key, behavior="gate=redis-dies"))
        for key in in_flight
    }
    await eventually(lambda: upstream.arrivals("redis-dies") == len(in_flight))

    def wave_of_duplicates() -> list[tuple[str, asyncio.Task[httpx.Response]]]:
        return [
            (key, asyncio.create_task(send_keyed(gateway.client, key)))
            for key in finished + in_flight
            for _ in range(DUPLICATES_PER_KEY)
        ]

    async def assert_answers(
        wave: list[tuple[str, asyncio.Task[httpx.Response]]], *, running: list[str]
    ) -> None:
        for key, task in wave:
            answer = await task
            if key in running:
                assert answer.status_code == 409, answer.text
            else:
                assert_replay_of(answer, originals[key])

    wave = wave_of_duplicates()
    # Kill Redis once the first answers are back, while the rest are on their way.
    await eventually(lambda: sum(task.done() for _, task in wave) >= DUPLICATES_PER_KEY)
    await own_redis.kill()
    await assert_answers(wave, running=in_flight)
    await assert_answers(wave_of_duplicates(), running=in_flight)  # Redis dead
    upstream.release("redis-dies")
    originals |= {key: await owner for key, owner in owners.items()}
    # Redis dead, every key finished: replays from PostgreSQL.
    await assert_answers(wave_of_duplicates(), running=[])
    assert {key: upstream.count(key) for key in originals} == dict.fromkeys(originals, 1)

    await own_redis.start()
    checker = redis.asyncio.Redis.from_url(own_redis.url)
    attempt = iter(range(1000))

    async def new_finalize_is_cached_again() -> bool:
        key = unique(f"after-restart-{next(attempt)}")
        assert (await send_keyed(gateway.client, key)).status_code == 201
        return bool(await checker.exists(entry_name(key)))

    try:
        await eventually(new_finalize_is_cached_again, timeout=20.0, interval=0.2)
    finally:
        await checker.aclose()
    assert not cache.degraded


async def test_an_invalidated_key_stays_out_of_the_in_process_cache_for_its_guard() -> None:
    clock = ManualClock()
    cache = InProcessCache(max_entries=10, max_bytes=1 << 20, monotonic=clock)
    key, other = RecordKey("s", "POST /x", "k1"), RecordKey("s", "POST /x", "k2")
    await cache.put(answer_for(key))
    await cache.put(answer_for(other))

    cache.invalidate([key])
    # A replay that read the record just before the operator's change puts it back: refused.
    await cache.put(answer_for(key))

    assert await cache.get(key) is None
    assert await cache.get(other) is not None
    clock.advance(INVALIDATION_GUARD)
    await cache.put(answer_for(key))
    assert await cache.get(key) is not None
