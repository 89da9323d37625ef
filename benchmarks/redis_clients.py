"""Client CPU per replay-cache operation, for each candidate Redis client.

    .venv/bin/python -m benchmarks.redis_clients [--redis-url URL] [--operations N]

The gateway's two Redis patterns, as it issues them on its hot path:

- replay: one GET that hits a ~1 KiB entry;
- new key: a GET that misses, then SET with a TTL and PUBLISH of the key's wake-up channel
  (as three calls, or with the last two pipelined into one round trip).

What is measured is the CPU time of this process (``time.process_time``: every thread,
so a client that does its work on threads of its own is charged for it) per operation, not
wall time: the machine is shared and wall time says more about the neighbours than about the
client. Clients that are not installed are skipped; ``coredis`` and ``valkey-glide`` are not
dependencies of the gateway (``pip install coredis valkey-glide`` to include them).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any
from urllib.parse import urlsplit

import uvloop

VALUE = b"x" * 1024
TTL_MS = 60_000
CHANNEL = "idgw:bench:w"

Operation = Callable[[int], Awaitable[None]]


async def _command_operations(client: Any, new_key_pipelined: Operation) -> dict[str, Operation]:
    """The operations of a client with redis-py's command methods (redis-py, coredis): the
    same calls for both, only their pipelines differ."""

    async def replay(i: int) -> None:
        await client.get("idgw:bench:hit")

    async def new_key_three_calls(i: int) -> None:
        await client.get(f"idgw:bench:k{i}")
        await client.set(f"idgw:bench:k{i}", VALUE, px=TTL_MS)
        await client.publish(CHANNEL, b"1")

    await client.set("idgw:bench:hit", VALUE)
    return {
        "replay (GET hit)": replay,
        "new key: GET, SET, PUBLISH (3 round trips)": new_key_three_calls,
        "new key: GET, pipeline SET+PUBLISH (2 round trips)": new_key_pipelined,
    }


async def redis_py(url: str, stack: AsyncExitStack) -> dict[str, Operation]:
    from redis.asyncio import Redis

    client = Redis.from_url(url)
    stack.push_async_callback(client.aclose)

    async def new_key_pipelined(i: int) -> None:
        await client.get(f"idgw:bench:k{i}")
        async with client.pipeline(transaction=False) as pipe:
            pipe.set(f"idgw:bench:k{i}", VALUE, px=TTL_MS)
            pipe.publish(CHANNEL, b"1")
            await pipe.execute()

    return await _command_operations(client, new_key_pipelined)


async def redis_py_connection(url: str, stack: AsyncExitStack) -> dict[str, Operation]:
    """redis-py's connection object used directly: no pool checkout, no command layer."""
    from redis.asyncio import Redis

    client = Redis.from_url(url)
    stack.push_async_callback(client.aclose)
    connection = await client.connection_pool.get_connection()  # type: ignore[no-untyped-call]

    async def call(*args: Any) -> Any:
        await connection.send_command(*args)
        return await connection.read_response()

    async def replay(i: int) -> None:
        await call("GET", "idgw:bench:hit")

    async def new_key_pipelined(i: int) -> None:
        await call("GET", f"idgw:bench:k{i}")
        await connection.send_packed_command(
            connection.pack_commands(
                [("SET", f"idgw:bench:k{i}", VALUE, "PX", TTL_MS), ("PUBLISH", CHANNEL, b"1")]
            )
        )
        await connection.read_response()
        await connection.read_response()

    await call("SET", "idgw:bench:hit", VALUE)
    return {
        "replay (GET hit)": replay,
        "new key: GET, pipeline SET+PUBLISH (2 round trips)": new_key_pipelined,
    }


async def coredis_client(url: str, stack: AsyncExitStack) -> dict[str, Operation]:
    import coredis

    parts = urlsplit(url)
    client: Any = coredis.Redis(
        host=parts.hostname or "127.0.0.1", port=parts.port or 6379, db=int(parts.path[1:] or 0)
    )
    # coredis 6 runs its pool in a task group that only an entered client has.
    await stack.enter_async_context(client)

    async def new_key_pipelined(i: int) -> None:
        await client.get(f"idgw:bench:k{i}")
        async with client.pipeline(transaction=False) as pipe:
            pipe.set(f"idgw:bench:k{i}", VALUE, px=TTL_MS)
            pipe.publish(CHANNEL, b"1")

    return await _command_operations(client, new_key_pipelined)


async def glide_client(url: str, stack: AsyncExitStack) -> dict[str, Operation]:
    from glide import (
        Batch,
        ExpirySet,
        ExpiryType,
        GlideClient,
        GlideClientConfiguration,
        NodeAddress,
    )

    parts = urlsplit(url)
    client = await GlideClient.create(
        GlideClientConfiguration(
            [NodeAddress(parts.hostname or "127.0.0.1", parts.port or 6379)],
            database_id=int(parts.path[1:] or 0),
        )
    )
    stack.push_async_callback(client.close)
    expiry = ExpirySet(ExpiryType.MILLSEC, TTL_MS)

    async def replay(i: int) -> None:
        await client.get("idgw:bench:hit")

    async def new_key_three_calls(i: int) -> None:
        await client.get(f"idgw:bench:k{i}")
        await client.set(f"idgw:bench:k{i}", VALUE, expiry=expiry)
        await client.publish(b"1", CHANNEL)

    async def new_key_pipelined(i: int) -> None:
        await client.get(f"idgw:bench:k{i}")
        batch = Batch(is_atomic=False)
        batch.set(f"idgw:bench:k{i}", VALUE, expiry=expiry)
        batch.publish(b"1", CHANNEL)
        await client.exec(batch, raise_on_error=True)

    await client.set("idgw:bench:hit", VALUE)
    return {
        "replay (GET hit)": replay,
        "new key: GET, SET, PUBLISH (3 round trips)": new_key_three_calls,
        "new key: GET, pipeline SET+PUBLISH (2 round trips)": new_key_pipelined,
    }


CLIENTS: dict[str, Callable[[str, AsyncExitStack], Awaitable[dict[str, Operation]]]] = {
    "redis-py": redis_py,
    "redis-py, bare connection": redis_py_connection,
    "coredis": coredis_client,
    "valkey-glide": glide_client,
}


async def cpu_per_operation(operation: Operation, count: int) -> float:
    """Microseconds of this process's CPU per operation, after a warm-up."""
    for i in range(count // 10):
        await operation(-i - 1)
    started = time.process_time()
    for i in range(count):
        await operation(i)
    return (time.process_time() - started) / count * 1e6


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    parser.add_argument("--operations", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3, help="best of N rounds is reported")
    args = parser.parse_args()
    print(f"| client | pattern | client CPU per operation (us, best of {args.rounds}) |")
    print("|---|---|---|")
    for name, build in CLIENTS.items():
        async with AsyncExitStack() as stack:
            try:
                operations = await build(args.redis_url, stack)
            except ImportError:
                print(f"| {name} | (not installed) | |")
                continue
            for pattern, operation in operations.items():
                rounds = [
                    await cpu_per_operation(operation, args.operations) for _ in range(args.rounds)
                ]
                print(f"| {name} | {pattern} | {min(rounds):.0f} |", flush=True)


if __name__ == "__main__":
    uvloop.run(main())
