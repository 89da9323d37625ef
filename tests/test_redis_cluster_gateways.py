"""Gateway processes sharing one Redis Cluster: the replay cache and wake-ups end to end.

Two real gateway processes on the test PostgreSQL database and a private three-node cluster
(``GATEWAY_REDIS_URL=redis+cluster://...``). An answer executed through gateway A is replayed
by gateway B from the cache, for keys on every node; a ``Prefer: wait`` duplicate on B is
woken by A's finalize through the sharded channel on each node; and a node killed with
SIGKILL under load, then restarted, costs no client an error or a second execution while
``/readyz`` names it and the live nodes keep replaying their entries, then says ``ok`` again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import redis.asyncio
from prometheus_client.parser import text_string_to_metric_families
from redis.asyncio import RedisCluster

from idempotency_gateway.replay.cache import cache_key
from idempotency_gateway.replay.redis_connection import cluster_client
from idempotency_gateway.replay.wakeups import channel_for
from tests.support import GatewayProcess, RecordingUpstream, eventually, write_config
from tests.support.gateway import route
from tests.support.keyed import (
    PREFERENCE_APPLIED,
    is_replay,
    keyed_gateway_config,
    record_key,
    send_keyed,
)
from tests.support.redis_nodes import RedisClusterNodes, RedisNode, tolerates_dead_node_leaks

pytestmark = pytest.mark.multiprocess

KEYS_PER_NODE = 3
# Far longer than the test's own deadline: a waiter that answers within WAKE_DEADLINE was
# woken by the owner's finalize, not by the end of its wait.
WAIT = 30
WAKE_DEADLINE = 10.0
LOAD_WORKERS = 6
# Bounds the load loop whatever happens to the phases that stop it.
MAX_ROUNDS_PER_WORKER = 300
CACHE_HITS = "idempotency_gateway_cache_lookups"
# Two gateway processes import and start at once; a loaded machine takes its time.
STARTUP_TIMEOUT = 60.0


@dataclass(frozen=True)
class Member:
    """One gateway process of the pair, with a client on its traffic port."""

    process: GatewayProcess
    client: httpx.AsyncClient

    async def readiness(self) -> dict[str, str]:
        async with httpx.AsyncClient(trust_env=False, timeout=10.0) as admin:
            response = await admin.get(f"{self.process.admin_url}/readyz")
        checks: dict[str, str] = response.json()
        return checks

    async def cache_hits(self) -> float:
        async with httpx.AsyncClient(trust_env=False, timeout=10.0) as admin:
            text = (await admin.get(f"{self.process.admin_url}/metrics")).text
        return sum(
            sample.value
            for family in text_string_to_metric_families(text)
            if family.name == CACHE_HITS
            for sample in family.samples
            if sample.name.endswith("_total") and sample.labels.get("result") == "hit"
        )


@pytest.fixture
async def cluster() -> AsyncIterator[RedisClusterNodes]:
    async with RedisClusterNodes(3) as nodes:
        yield nodes


@pytest.fixture
async def inspector(cluster: RedisClusterNodes) -> AsyncIterator[RedisCluster]:
    """A client of the test's own, to see which node owns a key and what it holds."""
    client = cluster_client(cluster.url, timeout=1.0, connect_timeout=1.0)
    await client.initialize()
    yield client
    await client.aclose()


@pytest.fixture
async def gateways(
    tmp_path: Path, postgres_url: str, cluster: RedisClusterNodes, upstream: RecordingUpstream
) -> AsyncIterator[tuple[Member, Member]]:
    config = keyed_gateway_config(
        upstream.url,
        routes=[route("/", key="required", wait_max=WAIT)],
        # The default 50 ms budget per Redis call is for production latency; on a loaded test
        # machine it would turn slow replies into misses and lost wake-ups, which these tests
        # would read as faults of the cluster handling.
        cache={"timeout": "1s"},
    )
    config_path = write_config(tmp_path, config.model_dump(mode="json"))
    env = {"GATEWAY_DATABASE_URL": postgres_url, "GATEWAY_REDIS_URL": cluster.url}
    processes = [
        GatewayProcess(
            config_path, env=env, log_dir=tmp_path, name=name, startup_timeout=STARTUP_TIMEOUT
        )
        for name in ("a", "b")
    ]
    async with contextlib.AsyncExitStack() as stack:
        try:
            await asyncio.gather(*(stack.enter_async_context(p) for p in processes))
            clients = [
                await stack.enter_async_context(
                    httpx.AsyncClient(base_url=p.url, timeout=30.0, trust_env=False)
                )
                for p in processes
            ]
            yield Member(processes[0], clients[0]), Member(processes[1], clients[1])
        finally:
            for process in processes:
                print(f"--- gateway {process.name} log tail ---\n{process.log_tail()}")


async def cache_hits(gateways: tuple[Member, Member]) -> float:
    return sum([await gateway.cache_hits() for gateway in gateways])


def node_of(inspector: RedisCluster, key: str) -> str:
    """``host:port`` of the primary that owns the key's cache entry and wake-up channel."""
    node = inspector.get_node_from_key(cache_key(record_key(key)))
    assert node is not None
    return str(node.name)


KeysByNode = Callable[[int], dict[str, list[str]]]


@pytest.fixture
def keys_by_node(
    inspector: RedisCluster, cluster: RedisClusterNodes, unique: Callable[[str], str]
) -> KeysByNode:
    """``keys_by_node(n)``: ``n`` fresh keys owned by each primary, by ``host:port``."""

    def choose(per_node: int) -> dict[str, list[str]]:
        chosen: dict[str, list[str]] = {node.address: [] for node in cluster.nodes}
        for index in itertools.count():
            key = unique(f"spread-{index}")
            owned = chosen[node_of(inspector, key)]
            if len(owned) < per_node:
                owned.append(key)
            if all(len(keys) == per_node for keys in chosen.values()):
                return chosen
        raise AssertionError("unreachable: itertools.count never ends")

    return choose


def assert_replay_of(replay: httpx.Response, original: httpx.Response) -> None:
    assert original.status_code == 201, original.text
    assert (replay.status_code, replay.content) == (original.status_code, original.content)
    assert is_replay(replay), replay.headers


async def test_an_answer_executed_through_a_is_replayed_by_b_from_every_cluster_node(
    gateways: tuple[Member, Member],
    keys_by_node: KeysByNode,
    inspector: RedisCluster,
    upstream: RecordingUpstream,
) -> None:
    gateway_a, gateway_b = gateways
    keys = [key for owned in keys_by_node(KEYS_PER_NODE).values() for key in owned]
    originals = {key: await send_keyed(gateway_a.client, key) for key in keys}

    async def every_entry_stored() -> bool:
        return all([await inspector.exists(cache_key(record_key(key))) for key in keys])

    await eventually(every_entry_stored, message="A stored every answer on its node")
    hits_before = await gateway_b.cache_hits()
    replays = {key: await send_keyed(gateway_b.client, key) for key in keys}

    for key in keys:
        assert_replay_of(replays[key], originals[key])
        assert upstream.count(key) == 1
    # Every replay through B was a cache hit: none needed the store.
    assert await gateway_b.cache_hits() - hits_before == len(keys)


async def test_a_waiter_on_b_is_woken_by_a_through_each_nodes_sharded_channel(
    gateways: tuple[Member, Member],
    keys_by_node: KeysByNode,
    inspector: RedisCluster,
    upstream: RecordingUpstream,
) -> None:
    gateway_a, gateway_b = gateways
    keys = {owned[0]: node for node, owned in keys_by_node(1).items()}
    owners = {
        key: asyncio.create_task(send_keyed(gateway_a.client, key, behavior=f"gate={key}"))
        for key in keys
    }
    for key in keys:
        await upstream.wait_arrived(key)
    waiters = {
        key: asyncio.create_task(send_keyed(gateway_b.client, key, prefer=f"wait={WAIT}"))
        for key in keys
    }

    async def b_listens_on_every_channel() -> bool:
        for key, node in keys.items():
            [(_, subscribers)] = await inspector.pubsub_shardnumsub(
                channel_for(record_key(key)), target_nodes=inspector.get_node(node_name=node)
            )
            if subscribers != 1:
                return False
        return True

    await eventually(b_listens_on_every_channel, message="B subscribed on each key's node")
    for key in keys:
        upstream.release(key)
    originals = {key: await owner for key, owner in owners.items()}
    async with asyncio.timeout(WAKE_DEADLINE):
        replays = {key: await waiter for key, waiter in waiters.items()}

    for key in keys:
        assert_replay_of(replays[key], originals[key])
        assert replays[key].headers.get(PREFERENCE_APPLIED) == f"wait={WAIT}"
        assert upstream.count(key) == 1


@tolerates_dead_node_leaks
async def test_a_dead_primary_delays_only_the_wakeups_of_the_keys_it_serves(
    gateways: tuple[Member, Member],
    keys_by_node: KeysByNode,
    cluster: RedisClusterNodes,
    upstream: RecordingUpstream,
) -> None:
    gateway_a, gateway_b = gateways
    victim = cluster.nodes[2]
    nodes = {node.address: node for node in cluster.nodes}
    # One key per primary, chosen by the slot map (never left to chance).
    keys = {node: owned[0] for node, owned in keys_by_node(1).items()}
    live = {node: key for node, key in keys.items() if node != victim.address}
    assert len(live) == 2
    owners = {
        key: asyncio.create_task(send_keyed(gateway_a.client, key, behavior=f"gate={key}"))
        for key in keys.values()
    }
    for key in keys.values():
        await upstream.wait_arrived(key)
    waiters = {
        key: asyncio.create_task(send_keyed(gateway_b.client, key, prefer=f"wait={WAIT}"))
        for key in keys.values()
    }

    async def b_listens(on: dict[str, str]) -> bool:
        return all(
            [
                await nodes[node].shard_subscribers(channel_for(record_key(key))) == 1
                for node, key in on.items()
            ]
        )

    await eventually(lambda: b_listens(keys), message="B subscribed on each key's primary")
    await victim.kill()

    # The live primaries' keys finish while the victim is dead: their waiters wake at once.
    for key in live.values():
        upstream.release(key)
    originals = {key: await owners[key] for key in live.values()}
    async with asyncio.timeout(WAKE_DEADLINE):
        replays = {key: await waiters[key] for key in live.values()}
    dead_key = keys[victim.address]
    assert not waiters[dead_key].done()

    # The victim returns: B's listener for it is rebuilt, and its key's waiter wakes too.
    await victim.start()
    await cluster.wait_healthy()
    await eventually(
        lambda: b_listens({victim.address: dead_key}),
        timeout=20.0,
        message="B subscribed on the restarted primary again",
    )

    async def a_reaches_every_primary() -> bool:
        # Readiness pings each primary on A's own client, reconnecting it to the victim.
        return (await gateway_a.readiness())["cache"] == "ok"

    await eventually(a_reaches_every_primary, timeout=20.0, message="A's cache ok again")
    upstream.release(dead_key)
    originals[dead_key] = await owners[dead_key]
    async with asyncio.timeout(WAKE_DEADLINE):
        replays[dead_key] = await waiters[dead_key]

    for key, replay in replays.items():
        assert_replay_of(replay, originals[key])
        assert replay.headers.get(PREFERENCE_APPLIED) == f"wait={WAIT}"
    assert {key: upstream.count(key) for key in keys.values()} == dict.fromkeys(keys.values(), 1)


@dataclass
class Load:
    """Concurrent clients, each sending a new key to one gateway and replaying it through the
    other, until stopped: every answer is checked as it comes back."""

    gateways: tuple[Member, Member]
    unique: Callable[[str], str]
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    keys: list[str] = field(default_factory=list)
    completed: int = 0
    _running: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._running = asyncio.create_task(self._run())

    async def finish(self) -> None:
        """Stop and wait: raises the first wrong answer or client-visible error, if any."""
        assert self._running is not None
        self.stop.set()
        await self._running

    async def _run(self) -> None:
        async with asyncio.TaskGroup() as workers:
            for worker in range(LOAD_WORKERS):
                workers.create_task(self._client(worker))

    async def _client(self, worker: int) -> None:
        first, second = self.gateways if worker % 2 else self.gateways[::-1]
        for round_number in range(MAX_ROUNDS_PER_WORKER):
            if self.stop.is_set():
                return
            key = self.unique(f"load-{worker}-{round_number}")
            self.keys.append(key)
            original = await send_keyed(first.client, key)
            assert (original.status_code, is_replay(original)) == (201, False), original.text
            assert_replay_of(await send_keyed(second.client, key), original)
            self.completed += 1

    async def rounds_pass(self, count: int) -> None:
        """Return once ``count`` more rounds have completed."""
        target = self.completed + count

        def done() -> bool:
            if self._running is not None and self._running.done():
                self._running.result()  # a failed client fails the test now, not at a deadline
                raise AssertionError("the load stopped before the rounds passed")
            return self.completed >= target

        await eventually(done, timeout=30.0)


@tolerates_dead_node_leaks
async def test_a_node_killed_and_restarted_under_load_costs_no_error_and_no_second_execution(
    gateways: tuple[Member, Member],
    cluster: RedisClusterNodes,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
) -> None:
    gateway_a, _ = gateways
    victim: RedisNode = cluster.nodes[2]
    load = Load(gateways, unique)
    load.start()
    try:
        await load.rounds_pass(LOAD_WORKERS)
        await victim.kill()

        async def victim_named() -> bool:
            return (await gateway_a.readiness())["cache"] == (
                f"degraded: {victim.address} not answering"
            )

        await eventually(victim_named, timeout=20.0, message="readyz names the dead node")
        hits_when_named = await cache_hits(gateways)

        async def live_nodes_still_replay() -> bool:
            return await cache_hits(gateways) > hits_when_named

        # Served with the node down; the live nodes' entries are still replayed from them.
        await load.rounds_pass(LOAD_WORKERS)
        await eventually(live_nodes_still_replay, timeout=20.0, message="hits on live nodes")

        await victim.start()
        await cluster.wait_healthy()

        async def cache_ok() -> bool:
            return (await gateway_a.readiness())["cache"] == "ok"

        await eventually(cache_ok, timeout=20.0, message="readyz says ok again")
        restarted = redis.asyncio.Redis.from_url(victim.url, socket_timeout=1.0)
        try:
            # The node came back empty: an entry on it was written by the gateways since.
            await eventually(restarted.dbsize, timeout=30.0, message="answers cached on it again")
        finally:
            await restarted.aclose()
    finally:
        await load.finish()

    assert load.keys
    assert {key: upstream.count(key) for key in load.keys} == dict.fromkeys(load.keys, 1)
