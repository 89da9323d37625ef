"""What the direct Redis path's idle bound costs a worker whose requests ask Redis in bursts.

    .venv/bin/python -m benchmarks.redis_idle [--redis-url redis://127.0.0.1:6379/9]

Bursts of 32 concurrent GET + PTTL (one replay-cache lookup each), 300 bursts, with
``max_idle`` at 8 and at the default, alternating: the connections Redis saw opened
(``total_connections_received``) and the client's CPU per call.
"""

from __future__ import annotations

import argparse
import asyncio
import time

import uvloop
from redis.asyncio import Redis

from idempotency_gateway.replay.redis_direct import MAX_IDLE, DirectCommands

BURST = 32
BURSTS = 300


async def _measure(url: str, max_idle: int) -> tuple[int, float]:
    client = Redis.from_url(url)
    direct = DirectCommands(client, max_idle=max_idle)
    before = (await client.info("stats"))["total_connections_received"]
    started = time.process_time()
    for _ in range(BURSTS):
        await asyncio.gather(
            *(direct.run(("GET", f"idle-{i}"), ("PTTL", f"idle-{i}")) for i in range(BURST))
        )
    cpu = time.process_time() - started
    after = (await client.info("stats"))["total_connections_received"]
    await direct.close()
    await client.aclose()
    return after - before, cpu / (BURST * BURSTS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/9")
    args = parser.parse_args()
    for max_idle in (8, MAX_IDLE, 8, MAX_IDLE):
        opened, per_call = uvloop.run(_measure(args.redis_url, max_idle))
        print(
            f"max_idle={max_idle:3}: {opened:5} connections opened for {BURST * BURSTS} calls, "
            f"{per_call * 1e6:6.1f} us of client CPU per call"
        )


if __name__ == "__main__":
    main()
