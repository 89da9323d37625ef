"""Wake-ups on a Redis Cluster: a dead primary delays only the wake-ups of the keys it serves.

A private three-primary cluster; ``ClusterWakeups`` parks waiters for keys chosen so that
every primary serves some (each key's channel slot is computed with ``redis.crc.key_slot`` and
looked up in the cluster's own slot map, ``CLUSTER SLOTS``: nothing rests on random keys
spreading). One primary is killed with SIGKILL: the waiters of keys on the live primaries,
parked before the kill and after it, are woken at once by an owner's SPUBLISH; the dead
primary's waiter is not, until the node is back and its listener has been rebuilt.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator

import pytest
import redis.asyncio
from redis.crc import key_slot

from idempotency_gateway.replay.redis_connect import connect_redis
from idempotency_gateway.replay.wakeups import channel_for
from idempotency_gateway.storage.records import RecordKey
from tests.support.redis_nodes import RedisClusterNodes, RedisNode, tolerates_dead_node_leaks
from tests.support.waiting import eventually

# A three-primary Redis Cluster: seconds. test_redis_round_trips keeps the wake-ups in
# the fast loop.
pytestmark = pytest.mark.slow

# Far longer than the test's own deadlines: a waiter that returns within WAKE_DEADLINE was
# woken by a message, not by the end of its wait.
WAIT = 120.0
WAKE_DEADLINE = 10.0
# Deterministic key names tried in order; three primaries serve a third of the slots each,
# so a handful suffices. The bound only turns a broken slot map into a clear failure.
CANDIDATES = 10_000


@pytest.fixture
async def cluster() -> AsyncIterator[RedisClusterNodes]:
    async with RedisClusterNodes(3) as nodes:
        yield nodes


async def slot_owners(cluster: RedisClusterNodes) -> dict[int, str]:
    """Slot -> ``host:port`` of the primary serving it, as the cluster itself says."""
    client = redis.asyncio.Redis.from_url(cluster.nodes[0].url, socket_timeout=2.0)
    try:
        ranges = await client.execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
    finally:
        await client.aclose()
    owners: dict[int, str] = {}
    for first, last, primary, *_replicas in ranges:
        host, port = primary[0], primary[1]
        address = f"{host.decode() if isinstance(host, bytes) else host}:{port}"
        owners |= dict.fromkeys(range(first, last + 1), address)
    return owners


def keys_per_primary(
    cluster: RedisClusterNodes, owners: dict[int, str], *, per_primary: int
) -> dict[str, list[RecordKey]]:
    """``per_primary`` keys whose wake-up channel each primary serves, by ``host:port``."""
    chosen: dict[str, list[RecordKey]] = {node.address: [] for node in cluster.nodes}
    for index in range(CANDIDATES):
        key = RecordKey("scope", "POST /v1/charges", f"wake-{index}")
        owned = chosen[owners[key_slot(channel_for(key).encode())]]
        if len(owned) < per_primary:
            owned.append(key)
        if all(len(keys) == per_primary for keys in chosen.values()):
            return chosen
    raise AssertionError(f"no {per_primary} keys on every primary among {CANDIDATES}: {chosen}")


async def wake(node: RedisNode, key: RecordKey) -> None:
    """What an owner in another process does once the key's answer is recorded."""
    await node.command("SPUBLISH", channel_for(key), "1")


async def wait_subscribed(nodes: dict[str, RedisNode], keys: dict[str, RecordKey]) -> None:
    async def listening() -> bool:
        return all(
            [
                await nodes[address].shard_subscribers(channel_for(key)) == 1
                for address, key in keys.items()
            ]
        )

    await eventually(listening, timeout=20.0, message=f"subscribed on {sorted(keys)}")


async def woken(waiters: dict[str, asyncio.Task[bool]]) -> dict[str, bool]:
    async with asyncio.timeout(WAKE_DEADLINE):
        return {address: await waiter for address, waiter in waiters.items()}


@tolerates_dead_node_leaks
async def test_a_dead_primary_delays_only_the_wakeups_of_the_keys_it_serves(
    cluster: RedisClusterNodes,
) -> None:
    nodes = {node.address: node for node in cluster.nodes}
    chosen = keys_per_primary(cluster, await slot_owners(cluster), per_primary=2)
    victim = cluster.nodes[2]
    before = {address: keys[0] for address, keys in chosen.items()}
    after = {address: keys[1] for address, keys in chosen.items() if address != victim.address}
    assert len(after) == 2, "keys on two live primaries"

    redis = connect_redis(cluster.url, timeout=1.0, connect_timeout=1.0)
    wakeups = redis.wakeups(timeout=1.0)
    await wakeups.start()
    waiters = {
        address: asyncio.create_task(wakeups.wait(key, WAIT)) for address, key in before.items()
    }
    try:
        await wait_subscribed(nodes, before)
        await victim.kill()

        # Parked before the kill, on the live primaries: woken at once.
        for address in after:
            await wake(nodes[address], before[address])
        assert await woken({address: waiters.pop(address) for address in after}) == dict.fromkeys(
            after, True
        )
        # Parked after the kill: subscribed and woken while the victim is still dead.
        late = {
            address: asyncio.create_task(wakeups.wait(key, WAIT)) for address, key in after.items()
        }
        await wait_subscribed(nodes, after)
        for address, key in after.items():
            await wake(nodes[address], key)
        assert await woken(late) == dict.fromkeys(after, True)
        assert not waiters[victim.address].done()

        # The victim returns: its own listener is rebuilt and its key wakes again.
        await victim.start()
        await cluster.wait_healthy()
        await wait_subscribed(nodes, {victim.address: before[victim.address]})
        await wake(victim, before[victim.address])
        assert await woken(waiters) == {victim.address: True}
        assert wakeups.degradation.failures >= 1
    finally:
        for waiter in waiters.values():
            waiter.cancel()
        await wakeups.close()
        # Closed while the loop runs, the seed nodes' own connections too.
        await redis.close()
        gc.collect()
