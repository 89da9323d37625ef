"""What the Redis fast path costs, and that its breaker never wedges.

On a private redis-server (so its command statistics are this test's alone) a replay is one
GET in one round trip, and a new key is a GET miss plus one pipelined SET + PUBLISH: two round
trips, counted at the client's socket writes and at the server's command statistics; the
lookups or the writes of one loop iteration share one pipeline, each caller with its replies
(and only its own error reply). A half-open probe that is cancelled while Redis hangs (SIGSTOP)
gives its permit back, so the cache finds Redis again once it answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis.asyncio
from redis.asyncio.connection import AbstractConnection

from idempotency_gateway.config import BreakerConfig
from idempotency_gateway.replay.cache import CachedAnswer, cache_key
from idempotency_gateway.replay.redis_cache import RedisCache
from idempotency_gateway.replay.redis_connect import connect_redis
from idempotency_gateway.replay.redis_direct import MAX_BATCH, BatchFailed, DirectCommands
from idempotency_gateway.resilience.breaker import BreakerState, CircuitBreaker
from idempotency_gateway.storage.records import RecordKey, Status, StoredResponse
from tests.support.clock import ManualClock, state_of
from tests.support.redis_nodes import RedisNode
from tests.support.waiting import eventually

ONE_HOUR = 3600.0


def answer_for(key: RecordKey) -> CachedAnswer:
    response = StoredResponse(
        status=201, headers=[("content-type", "text/plain")], body=b"x" * 1024
    )
    expires_at = time.monotonic() + ONE_HOUR
    return CachedAnswer(key, "hash-1", Status.SUCCEEDED, response, expires_at)


class WriteCounter:
    """Counts the packets redis-py writes: one per round trip (a pipeline is one write)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.writes = 0
        original = AbstractConnection.send_packed_command

        async def counted(connection: AbstractConnection, *args: Any, **kwargs: Any) -> None:
            self.writes += 1
            await original(connection, *args, **kwargs)

        monkeypatch.setattr(AbstractConnection, "send_packed_command", counted)


async def command_counts(url: str) -> dict[str, int]:
    client = redis.asyncio.Redis.from_url(url)
    try:
        stats: dict[str, dict[str, Any]] = await client.info("commandstats")
    finally:
        await client.aclose()
    return {name.removeprefix("cmdstat_"): int(row["calls"]) for name, row in stats.items()}


# What the measuring client itself sends (it connects afresh for each reading).
MEASURING = {"info", "hello", "client|setinfo"}


def delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    changed = {name: after[name] - before.get(name, 0) for name in after}
    return {name: count for name, count in changed.items() if count and name not in MEASURING}


@pytest.fixture
async def node() -> AsyncIterator[RedisNode]:
    async with RedisNode() as server:
        yield server


@pytest.fixture
def fresh_key(unique: Callable[[str], str]) -> RecordKey:
    return RecordKey("scope-round-trips", "POST /v1/charges", unique("round-trip"))


def cache_on(node: RedisNode) -> RedisCache:
    return RedisCache(
        connect_redis(node.url, timeout=2.0, connect_timeout=2.0),
        timeout=2.0,
        max_entry_bytes=4096,
    )


async def test_a_replay_is_one_get_and_a_new_key_two_round_trips(
    node: RedisNode, fresh_key: RecordKey, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = cache_on(node)
    try:
        # The connections are open (and their handshakes sent) before counting starts.
        assert await cache.ping()
        assert await cache.get(RecordKey("scope-round-trips", "warm-up", "warm-up")) is None
        counter = WriteCounter(monkeypatch)

        before = await command_counts(node.url)
        writes = counter.writes
        assert await cache.get(fresh_key) is None
        assert await cache.put(answer_for(fresh_key)) is True
        assert counter.writes - writes == 2
        # The SET is a script's (``SET_UNLESS_INVALIDATED``): one EVAL, its STRLEN and SET.
        assert delta(before, await command_counts(node.url)) == {
            "get": 1,
            "eval": 1,
            "strlen": 1,
            "set": 1,
            "publish": 1,
        }

        before = await command_counts(node.url)
        writes = counter.writes
        replayed = await cache.get(fresh_key)
        assert replayed is not None
        assert replayed.response.body == b"x" * 1024
        assert counter.writes - writes == 1
        assert delta(before, await command_counts(node.url)) == {"get": 1}
    finally:
        await cache.close()


# One failure opens the breaker (min_calls=1) and one probe settles it: each step shows.
ONE_FAILURE_OPENS = BreakerConfig(
    window=10.0, min_calls=1, failure_rate=0.5, slow_call=60.0, open_for=2.0, half_open_calls=1
)


def cache_that_stays_closed(
    node: RedisNode, *, timeout: float, socket_timeout: float | None
) -> RedisCache:
    """A cache whose breaker stays closed through the few failures a test provokes, so each
    command really reaches Redis."""
    return RedisCache(
        connect_redis(node.url, timeout=socket_timeout, connect_timeout=2.0),
        timeout=timeout,
        max_entry_bytes=4096,
        breaker=CircuitBreaker(
            "redis-cache", ONE_FAILURE_OPENS.model_copy(update={"min_calls": 100})
        ),
    )


@contextlib.asynccontextmanager
async def half_open_cache(
    node: RedisNode, key: RecordKey, *, command_timeout: float
) -> AsyncIterator[tuple[RedisCache, CircuitBreaker, ManualClock]]:
    """A cache holding ``key``'s entry whose breaker one failure opened and whose open time
    has passed: the next call is the one half-open probe."""
    clock = ManualClock()
    breaker = CircuitBreaker("redis-cache", ONE_FAILURE_OPENS, clock=clock)
    cache = RedisCache(
        connect_redis(node.url, timeout=command_timeout, connect_timeout=command_timeout),
        timeout=command_timeout,
        max_entry_bytes=4096,
        breaker=breaker,
    )
    try:
        assert await cache.put(answer_for(key))
        breaker.record(breaker.acquire(), failure=True)
        assert state_of(breaker) is BreakerState.OPEN
        clock.advance(ONE_FAILURE_OPENS.open_for)
        assert state_of(breaker) is BreakerState.HALF_OPEN
        yield cache, breaker, clock
    finally:
        await cache.close()


async def test_a_cancelled_half_open_probe_gives_its_permit_back(
    node: RedisNode, fresh_key: RecordKey, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with half_open_cache(node, fresh_key, command_timeout=30.0) as (cache, breaker, clock):
        counter = WriteCounter(monkeypatch)
        node.pause()
        probe = asyncio.create_task(cache.get(fresh_key))
        await eventually(lambda: counter.writes >= 1, message="the probe's GET was sent")
        probe.cancel()
        with pytest.raises(asyncio.CancelledError):
            await probe
        node.resume()

        # The cancelled probe counted as a failure: open again, then a new probe is admitted.
        assert state_of(breaker) is BreakerState.OPEN
        clock.advance(ONE_FAILURE_OPENS.open_for)
        found = await cache.get(fresh_key)
        assert found is not None
        assert found.response.body == b"x" * 1024
        assert state_of(breaker) is BreakerState.CLOSED


async def test_a_probe_failing_with_an_error_reply_reports_and_recovers(
    node: RedisNode, fresh_key: RecordKey
) -> None:
    async with half_open_cache(node, fresh_key, command_timeout=2.0) as (cache, breaker, clock):
        # A probe that fails with an error reply (WRONGTYPE) rather than a dead connection.
        client = redis.asyncio.Redis.from_url(node.url)
        try:
            await client.delete(cache_key(fresh_key))
            await client.lpush(cache_key(fresh_key), b"not a string")
        finally:
            await client.aclose()
        assert await cache.get(fresh_key) is None
        assert state_of(breaker) is BreakerState.OPEN  # the probe reported, it did not vanish
        clock.advance(ONE_FAILURE_OPENS.open_for)
        assert await cache.put(answer_for(fresh_key)) is True  # SET replaces the list
        assert state_of(breaker) is BreakerState.CLOSED


async def test_a_client_library_failure_of_any_kind_degrades_and_never_reaches_the_caller(
    node: RedisNode, fresh_key: RecordKey, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What redis-py's cluster client raised in a fault run when a node's connection was
    # dropped by a concurrent reconnect: not a RedisError, and it cut a client's answer short.
    cache = cache_on(node)
    redis = connect_redis(node.url, timeout=2.0, connect_timeout=2.0)
    wakeups = redis.wakeups(timeout=2.0)
    try:
        assert await cache.ping()

        async def torn(connection: AbstractConnection, *args: Any, **kwargs: Any) -> None:
            raise AttributeError("'NoneType' object has no attribute 'writelines'")

        monkeypatch.setattr(AbstractConnection, "send_packed_command", torn)

        assert await cache.get(fresh_key) is None
        assert await cache.put(answer_for(fresh_key)) is False
        await wakeups.notify(fresh_key)  # must not raise
        assert wakeups.degradation.failures >= 1

        monkeypatch.undo()
        assert await cache.put(answer_for(fresh_key)) is True
        assert await cache.get(fresh_key) is not None
    finally:
        await wakeups.close()
        # The wake-ups do not own their adapter (the gateway shares the cache's).
        await redis.close()
        await cache.close()


async def test_a_reply_that_came_too_late_is_never_read_as_another_keys_answer(
    node: RedisNode, unique: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GET that times out while Redis hangs leaves its reply on the way: the connection
    it was sent on must not serve the next GET, or that GET would read the late reply."""
    first = RecordKey("scope-round-trips", "POST /v1/charges", unique("late-first"))
    second = RecordKey("scope-round-trips", "POST /v1/charges", unique("late-second"))
    cache = cache_that_stays_closed(node, timeout=0.2, socket_timeout=None)
    try:
        assert await cache.put(answer_for(first))
        assert await cache.put(answer_for(second))
        counter = WriteCounter(monkeypatch)
        node.pause()
        assert await cache.get(first) is None  # timed out: a miss, never an error
        assert counter.writes == 1
        node.resume()
        # The late reply to the first GET is in flight; the second GET gets its own answer.
        found = await cache.get(second)
        assert found is not None
        assert found.key == second
    finally:
        await cache.close()


async def test_redis_dropping_every_client_costs_one_failed_command_not_one_per_idle_connection(
    node: RedisNode, fresh_key: RecordKey
) -> None:
    """A burst leaves connections idle; Redis then drops them all (a restart, CLIENT KILL).
    The first command finds its connection dead; the next one connects afresh instead of
    finding the next dead one (behind a half-open breaker that would be the next probe)."""
    cache = cache_that_stays_closed(node, timeout=2.0, socket_timeout=2.0)
    try:
        assert await cache.put(answer_for(fresh_key))
        # Lookups of one loop iteration share a pipeline of at most MAX_BATCH: eight full
        # pipelines go out at once, on eight connections.
        burst = await asyncio.gather(*(cache.get(fresh_key) for _ in range(8 * MAX_BATCH)))
        assert all(found is not None for found in burst)
        client = redis.asyncio.Redis.from_url(node.url)
        try:
            assert await client.client_kill_filter(_type="normal", skipme=True) >= 8
        finally:
            await client.aclose()

        assert await cache.get(fresh_key) is None  # its connection was dropped: a miss
        found = await cache.get(fresh_key)
        assert found is not None
        assert found.key == fresh_key
    finally:
        await cache.close()


BATCHED = 5


async def test_answers_stored_in_one_loop_iteration_are_one_pipeline(
    node: RedisNode, unique: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = cache_on(node)
    keys = [
        RecordKey("scope-round-trips", "POST /v1/charges", unique(f"b{n}")) for n in range(BATCHED)
    ]
    try:
        assert await cache.put(answer_for(RecordKey("scope-round-trips", "warm-up", "warm-up")))
        counter = WriteCounter(monkeypatch)
        before = await command_counts(node.url)
        writes = counter.writes

        stored = await asyncio.gather(*(cache.put(answer_for(key)) for key in keys))

        assert stored == [True] * BATCHED
        assert counter.writes - writes == 1
        assert delta(before, await command_counts(node.url)) == {
            "eval": BATCHED,
            "strlen": BATCHED,
            "set": BATCHED,
            "publish": BATCHED,
        }
        for key in keys:
            found = await cache.get(key)
            assert found is not None
            assert found.key == key
    finally:
        await cache.close()


async def test_lookups_of_one_loop_iteration_are_one_pipeline_each_with_its_own_reply(
    node: RedisNode, unique: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    cache = cache_on(node)
    stored = [
        RecordKey("scope-round-trips", "POST /v1/charges", unique(f"hit{n}")) for n in range(3)
    ]
    missing = [
        RecordKey("scope-round-trips", "POST /v1/charges", unique(f"miss{n}")) for n in range(2)
    ]
    try:
        for key in stored:
            assert await cache.put(answer_for(key))
        counter = WriteCounter(monkeypatch)
        before = await command_counts(node.url)
        writes = counter.writes
        asked = [stored[0], missing[0], stored[1], missing[1], stored[2]]

        found = await asyncio.gather(*(cache.get_with_expiry(key) for key in asked))

        assert counter.writes - writes == 1
        assert delta(before, await command_counts(node.url)) == {"get": 5, "pttl": 5}
        assert [answer.key if answer else None for answer in found] == [
            stored[0], None, stored[1], None, stored[2]
        ]  # fmt: skip
        # Each copy lives no longer than its own entry in Redis (an hour, less the wait).
        for answer in (found[0], found[2], found[4]):
            assert answer is not None
            assert 0 < answer.expires_at - time.monotonic() <= ONE_HOUR
    finally:
        await cache.close()


async def test_a_cancelled_batch_sender_fails_the_others_instead_of_leaving_them_waiting(
    node: RedisNode,
) -> None:
    client = redis.asyncio.Redis.from_url(node.url)
    direct = DirectCommands(client)
    try:
        sender = asyncio.create_task(direct.run_batched(("PING",)))
        others = [asyncio.create_task(direct.run_batched(("ECHO", b"x"))) for _ in range(2)]
        # Runs after every task's first step: the sender is then waiting for its batch.
        asyncio.get_running_loop().call_soon(sender.cancel)
        outcomes = await asyncio.gather(sender, *others, return_exceptions=True)

        assert isinstance(outcomes[0], asyncio.CancelledError)
        assert all(isinstance(outcome, BatchFailed) for outcome in outcomes[1:])
        assert await direct.run_batched(("ECHO", b"after")) == [b"after"]
    finally:
        await direct.close()
        await client.aclose()


async def test_a_command_refused_in_a_shared_pipeline_fails_only_its_own_caller(
    node: RedisNode, unique: Callable[[str], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A full Redis (``maxmemory`` reached, ``noeviction``) refuses the SET of an answer
    while it still serves reads: the lookups that shared that SET's pipeline get their
    entries, and the connection, still in step, serves the next call."""
    cache = cache_that_stays_closed(node, timeout=2.0, socket_timeout=2.0)
    stored = [
        RecordKey("scope-round-trips", "POST /v1/charges", unique(f"full{n}")) for n in range(2)
    ]
    refused = RecordKey("scope-round-trips", "POST /v1/charges", unique("refused"))
    client = redis.asyncio.Redis.from_url(node.url)
    try:
        for key in stored:
            assert await cache.put(answer_for(key))
        await client.config_set("maxmemory-policy", "noeviction")
        await client.config_set("maxmemory", 1)
        counter = WriteCounter(monkeypatch)
        writes = counter.writes

        outcomes = await asyncio.gather(
            cache.get(stored[0]), cache.put(answer_for(refused)), cache.get(stored[1])
        )

        assert counter.writes - writes == 1  # the three shared one pipeline
        found_first, put, found_second = outcomes
        assert put is False
        assert [found.key if found else None for found in (found_first, found_second)] == stored
        assert await client.exists(cache_key(refused)) == 0
        direct = DirectCommands(client)
        try:
            with pytest.raises(redis.exceptions.OutOfMemoryError):
                await direct.run(("SET", cache_key(refused), b"x"), ("ECHO", b"read"))
            assert direct.idle == 1  # kept: the error was a whole reply, and so was the echo
            assert await direct.run(("ECHO", b"after")) == [b"after"]
        finally:
            await direct.close()
    finally:
        await client.config_set("maxmemory", 0)
        await client.aclose()
        await cache.close()
