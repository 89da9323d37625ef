"""The replay cache's direct command path holds no more Redis connections than its pool allows.

Against the real Redis: connections the direct path opens, busy or idle, count against the
client pool's ``max_connections`` (so the full client is refused too at the limit), at most
``max_idle`` stay open once a burst is over, and none stays idle past ``idle_timeout``. What
Redis itself sees (``CLIENT LIST``, by a client name unique to each test) is what is counted.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis
from redis.exceptions import MaxConnectionsError

from idempotency_gateway.replay.redis_direct import DirectCommands
from tests.support.waiting import eventually


@pytest.fixture
def client_name() -> str:
    return f"direct-{uuid.uuid4().hex}"


@pytest.fixture
async def limited(redis_url: str, client_name: str) -> AsyncIterator[Redis]:
    """A client of at most 3 connections, each named ``client_name`` on the server."""
    client = Redis.from_url(redis_url, max_connections=3, client_name=client_name)
    yield client
    await client.aclose()


async def open_on_server(observer: Redis, name: str, *, command: str | None = None) -> int:
    clients = await observer.client_list()
    return sum(
        1
        for client in clients
        if client["name"] == name and (command is None or client["cmd"] == command)
    )


async def holds(observer: Redis, name: str, count: int, *, command: str | None = None) -> bool:
    return await open_on_server(observer, name, command=command) == count


async def blocked_pops(
    direct: DirectCommands, observer: Redis, name: str, count: int
) -> tuple[list[str], list[asyncio.Task[list[object]]]]:
    """``count`` commands that hold a connection each until their list gets an item."""
    lists = [f"{name}-{index}" for index in range(count)]
    pops = [asyncio.create_task(direct.run(("BLPOP", key, 30))) for key in lists]
    await eventually(
        lambda: holds(observer, name, count, command="blpop"),
        message=f"{count} BLPOPs blocked on the server",
    )
    return lists, pops


async def release(observer: Redis, lists: list[str]) -> None:
    for key in lists:
        await observer.rpush(key, b"item")


async def test_direct_connections_count_against_the_pools_limit(
    limited: Redis, redis_client: Redis, client_name: str
) -> None:
    direct = DirectCommands(limited)
    lists, pops = await blocked_pops(direct, redis_client, client_name, 3)

    with pytest.raises(MaxConnectionsError):
        await direct.run(("GET", f"{client_name}-other"))
    with pytest.raises(MaxConnectionsError):
        await limited.get(f"{client_name}-other")  # the client's own commands share the limit

    await release(redis_client, lists)
    replies = await asyncio.gather(*pops)
    assert [reply[0] for reply in replies] == [[key.encode(), b"item"] for key in lists]
    # Done, the connections are idle and used again: no new one, and no refusal.
    assert await direct.run(("GET", f"{client_name}-other")) == [None]
    assert await open_on_server(redis_client, client_name) == 3
    await direct.close()
    await eventually(lambda: holds(redis_client, client_name, 0))


async def test_at_most_max_idle_connections_stay_open_after_a_burst(
    limited: Redis, redis_client: Redis, client_name: str
) -> None:
    direct = DirectCommands(limited, max_idle=1)
    lists, pops = await blocked_pops(direct, redis_client, client_name, 3)

    await release(redis_client, lists)
    await asyncio.gather(*pops)

    assert direct.idle == 1
    await eventually(
        lambda: holds(redis_client, client_name, 1),
        message="the connections over max_idle closed on the server",
    )
    # The closed ones went back to the pool: the limit has room for a full burst again.
    lists, pops = await blocked_pops(direct, redis_client, client_name, 3)
    await release(redis_client, lists)
    await asyncio.gather(*pops)
    await direct.close()


async def test_no_connection_stays_idle_past_the_idle_timeout(
    limited: Redis, redis_client: Redis, client_name: str
) -> None:
    direct = DirectCommands(limited, idle_timeout=0.2)
    ((connection_id,),) = [await direct.run(("CLIENT", "ID"))]
    assert direct.idle == 1

    async def closed() -> bool:
        clients = await redis_client.client_list()
        return all(client["id"] != str(connection_id) for client in clients)

    await eventually(closed, message="the idle connection closed on the server")

    assert direct.idle == 0
    # The next command connects afresh.
    assert await direct.run(("CLIENT", "ID")) != [connection_id]
    await direct.close()


async def test_by_default_a_burst_as_wide_as_a_busy_worker_reuses_its_connections(
    redis_url: str, redis_client: Redis, client_name: str
) -> None:
    """32 requests of one worker asking Redis at once, burst after burst: the connections of
    the first burst serve the next ones, none is closed and opened again (a reconnect costs
    the worker several times the command itself)."""
    client = Redis.from_url(redis_url, client_name=client_name)
    direct = DirectCommands(client)
    try:
        for burst in range(3):
            lists, pops = await blocked_pops(direct, redis_client, client_name, 32)
            ids = await redis_client.client_list()
            opened = {c["id"] for c in ids if c["name"] == client_name}
            if burst == 0:
                first = opened
            assert opened == first, f"burst {burst} opened connections of its own"
            await release(redis_client, lists)
            await asyncio.gather(*pops)
        assert direct.idle == 32
    finally:
        await direct.close()
        await client.aclose()
