"""``Prefer: wait=N`` (RFC 7240): a duplicate may wait for the owner instead of taking a 409.

Proves how the header is read; that a waiting duplicate parks while the owner runs (no 409),
is woken by the owner's finalize and gets the replay with ``Preference-Applied``, while a
duplicate without the preference still gets its 409 at once; that the wait ends in a 409 when
the owner outlasts it, and is capped by the route's ``wait_max``; that many waiters wake
together to one answer and one execution; that a waiter on another gateway process is woken
through Redis pub/sub, long before its wait runs out; and that parked waiters hold no database
connection.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import pytest
import redis.asyncio

from idempotency_gateway.asgi import Headers
from idempotency_gateway.idempotency.prefer import requested_wait
from idempotency_gateway.replay.wakeups import LocalWakeups, channel_for
from tests.support import RecordingUpstream, eventually
from tests.support.gateway import RunningGateway, StartGateway, route
from tests.support.keyed import (
    PREFERENCE_APPLIED,
    is_replay,
    keyed_gateway_config,
    record_key,
    send_keyed,
)
from tests.support.servers import StartGatewayProcess

# Shorter than every wait a woken waiter asks for (5 s and 10 s here): a waiter that answers
# within it was woken by the owner's finalize, not by its own timeout.
WAKE_DEADLINE = 4.0
# Longer than the waits that must run out (1 s), far shorter than an uncapped wait=30.
GIVE_UP_DEADLINE = 8.0


@pytest.mark.parametrize(
    ("fields", "seconds"),
    [
        ([b"wait=5"], 5),
        ([b"respond-async, wait=10"], 10),
        ([b'wait="3"'], 3),
        ([b"wait=5;x=y"], 5),
        ([b"WAIT=7"], 7),
        ([b"respond-async", b"wait=2"], 2),
        pytest.param([b"wait=" + b"9" * 5000], 10**9, id="5000-digits"),
        pytest.param([b"wait=" + b"0" * 5000 + b"4"], 4, id="5000-leading-zeros"),
        ([b"wait=abc"], None),
        ([b"wait=1.5"], None),
        ([b"wait=-3"], None),
        ([b"wait="], None),
        ([b"wait"], None),
        ([b"handling=lenient"], None),
        ([], None),
    ],
    ids=lambda value: repr(value) if isinstance(value, list) else str(value),
)
def test_requested_wait_reads_prefer_wait_seconds(fields: list[bytes], seconds: int | None) -> None:
    headers: Headers = [(b"content-type", b"application/json")]
    headers += [(b"prefer", field) for field in fields]

    assert requested_wait(headers) == seconds


# ------------------------------------------------------------------ one gateway process


@pytest.fixture
async def gateway(start_gateway: StartGateway, database_url: str) -> RunningGateway:
    """The default gateway (one key-required route) on each store."""
    return await start_gateway(database_url, keyed=True)


def parked_waiters(gateway: RunningGateway) -> int:
    """Duplicates of this gateway parked on a wake-up right now."""
    wakeups = gateway.app.wakeups
    assert isinstance(wakeups, LocalWakeups)
    return wakeups.parked


async def owner_held_at_gate(
    gateway: RunningGateway, upstream: RecordingUpstream, key: str, gate: str
) -> asyncio.Task[httpx.Response]:
    """The first request with ``key``, started and held at the upstream's ``gate``."""
    owner = asyncio.create_task(send_keyed(gateway.client, key, behavior=f"gate={gate}"))
    await upstream.wait_arrived(gate)
    return owner


async def park_waiters(
    gateway: RunningGateway, key: str, count: int, *, prefer: str
) -> list[asyncio.Task[httpx.Response]]:
    """``count`` duplicates sending ``Prefer: prefer``, returned once all are parked."""
    waiters = [
        asyncio.create_task(send_keyed(gateway.client, key, prefer=prefer)) for _ in range(count)
    ]
    await eventually(lambda: parked_waiters(gateway) == count, message=f"{count} parked")
    return waiters


def assert_replay_after_wait(
    replay: httpx.Response, original: httpx.Response, *, applied: str
) -> None:
    assert (original.status_code, is_replay(original)) == (201, False)
    assert (replay.status_code, is_replay(replay)) == (201, True)
    assert replay.headers.get(PREFERENCE_APPLIED) == applied
    assert replay.content == original.content


async def test_duplicate_with_prefer_wait_gets_the_replay_one_without_gets_409_at_once(
    gateway: RunningGateway,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
) -> None:
    key = unique("wait")
    owner = await owner_held_at_gate(gateway, upstream, key, "owner")

    [waiter] = await park_waiters(gateway, key, 1, prefer="wait=5")
    impatient = await send_keyed(gateway.client, key)
    waiter_answered_early = waiter.done()
    upstream.release("owner")
    original = await owner
    replay = await asyncio.wait_for(waiter, WAKE_DEADLINE)

    assert impatient.status_code == 409
    assert "retry-after" in impatient.headers
    assert not waiter_answered_early
    assert_replay_after_wait(replay, original, applied="wait=5")
    assert upstream.count(key) == 1


@pytest.mark.parametrize(
    ("wait_max", "prefer"),
    [("10s", "wait=1"), ("1s", "wait=30")],
    ids=["owner-outlasts-the-wait", "wait-capped-by-wait-max"],
)
async def test_waiter_gets_409_when_the_owner_outlasts_its_wait(
    start_gateway: StartGateway,
    database_url: str,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
    wait_max: str,
    prefer: str,
) -> None:
    gateway = await start_gateway(
        database_url, keyed=True, routes=[route("/", key="required", wait_max=wait_max)]
    )
    key = unique("gives-up")
    owner = await owner_held_at_gate(gateway, upstream, key, "slow-owner")

    [waiter] = await park_waiters(gateway, key, 1, prefer=prefer)
    gave_up = await asyncio.wait_for(waiter, GIVE_UP_DEADLINE)
    owner_still_held = not owner.done() and upstream.inflight == 1
    upstream.release("slow-owner")
    original = await owner

    assert owner_still_held
    assert gave_up.status_code == 409
    assert not is_replay(gave_up)
    assert original.status_code == 201
    assert upstream.count(key) == 1


async def test_many_waiters_wake_together_to_the_same_answer(
    gateway: RunningGateway,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
) -> None:
    key = unique("many-waiters")
    owner = await owner_held_at_gate(gateway, upstream, key, "popular")

    waiters = await park_waiters(gateway, key, 20, prefer="wait=10")
    upstream.release("popular")
    original = await owner
    replays = await asyncio.wait_for(asyncio.gather(*waiters), WAKE_DEADLINE)

    for replay in replays:
        assert_replay_after_wait(replay, original, applied="wait=10")
    assert upstream.count(key) == 1


async def test_parked_waiters_hold_no_database_connection(
    start_gateway: StartGateway,
    postgres_url: str,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
) -> None:
    """One pooled connection: a new key goes through while ten waiters are parked."""
    gateway = await start_gateway(postgres_url, keyed=True, store={"pool_size": 1})
    key, new_key = unique("parked"), unique("parked-new")
    owner = await owner_held_at_gate(gateway, upstream, key, "one-connection")
    waiters = await park_waiters(gateway, key, 10, prefer="wait=10")

    new = await send_keyed(gateway.client, new_key)
    still_parked = parked_waiters(gateway)
    upstream.release("one-connection")
    original = await owner
    replays = await asyncio.wait_for(asyncio.gather(*waiters), WAKE_DEADLINE)

    assert (new.status_code, is_replay(new)) == (201, False)
    assert still_parked == 10
    for replay in replays:
        assert_replay_after_wait(replay, original, applied="wait=10")
    assert (upstream.count(key), upstream.count(new_key)) == (1, 1)


# ------------------------------------------------------------------ two gateway processes


@pytest.mark.multiprocess
async def test_waiter_on_another_gateway_process_is_woken_through_redis(
    upstream: RecordingUpstream,
    start_gateway_process: StartGatewayProcess,
    postgres_url: str,
    redis_url: str,
    redis_client: redis.asyncio.Redis,
    unique: Callable[[str], str],
) -> None:
    config = keyed_gateway_config(upstream.url).model_dump(mode="json")
    env = {"GATEWAY_DATABASE_URL": postgres_url, "GATEWAY_REDIS_URL": redis_url}
    gateway_a, gateway_b = await asyncio.gather(
        start_gateway_process(config, env=env), start_gateway_process(config, env=env)
    )
    key = unique("cross-process")
    channel = channel_for(record_key(key))

    async def waiter_subscribed() -> bool:
        [(_, subscribers)] = await redis_client.pubsub_numsub(channel)
        return subscribers == 1

    async with (
        httpx.AsyncClient(base_url=gateway_a.url, timeout=30.0, trust_env=False) as on_a,
        httpx.AsyncClient(base_url=gateway_b.url, timeout=30.0, trust_env=False) as on_b,
    ):
        owner = asyncio.create_task(send_keyed(on_a, key, behavior="gate=across"))
        await upstream.wait_arrived("across")
        waiter = asyncio.create_task(send_keyed(on_b, key, prefer="wait=10"))
        await eventually(waiter_subscribed, message="gateway b waits on the key's channel")
        upstream.release("across")
        original = await owner
        replay = await asyncio.wait_for(waiter, WAKE_DEADLINE)

    assert_replay_after_wait(replay, original, applied="wait=10")
    assert upstream.count(key) == 1
