"""Client CPU per piece of a replay, as the gateway runs them.

    .venv/bin/python -m benchmarks.replay_pieces [--redis-url URL] [--at-once N]

Each piece is timed with ``time.process_time`` per call on uvloop, ``--at-once`` calls at a
time (8 by default: within the direct path's idle connections, so no call pays a connect):
the Redis GET bare and under the cache's guard (breaker, deadline, latency histogram, key,
decode), the SET + PUBLISH of an answer, a hit in the in-process cache, the breaker's permit
and verdict alone, and the fingerprint of a body sent again. Run it against two checkouts
(``PYTHONPATH=<checkout>/app``) to compare them piece by piece.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable

import uvloop

from idempotency_gateway.idempotency.fingerprint import request_hash
from idempotency_gateway.replay.cache import CachedAnswer, InProcessCache
from idempotency_gateway.replay.redis_cache import CACHE_BREAKER, RedisCache
from idempotency_gateway.replay.redis_connect import connect_redis
from idempotency_gateway.resilience.breaker import CircuitBreaker
from idempotency_gateway.storage.records import RecordKey, Status, StoredResponse

BODY = b'{"amount": 1000, "currency": "usd"}'
HEADERS = [(b"content-type", b"application/json"), (b"authorization", b"Bearer sk_test")]
SYNC_CALLS = 50_000


def _answer(key: RecordKey) -> CachedAnswer:
    response = StoredResponse(200, [("content-type", "application/json")], b"x" * 64)
    return CachedAnswer(key, "h" * 64, Status.SUCCEEDED, response, time.monotonic() + 3600)


async def _per_call(
    call: Callable[[int], Awaitable[object]], *, at_once: int, rounds: int
) -> float:
    for _ in range(rounds // 10):  # warm: connections open, caches filled
        await asyncio.gather(*(call(i) for i in range(at_once)))
    started = time.process_time()
    for _ in range(rounds):
        await asyncio.gather(*(call(i) for i in range(at_once)))
    return (time.process_time() - started) / (rounds * at_once) * 1e6


def _sync_per_call(call: Callable[[], object]) -> float:
    started = time.process_time()
    for _ in range(SYNC_CALLS):
        call()
    return (time.process_time() - started) / SYNC_CALLS * 1e6


async def _measure(url: str, at_once: int, rounds: int) -> dict[str, float]:
    adapter = connect_redis(url, timeout=0.05, connect_timeout=1.0)
    cache = RedisCache(adapter, timeout=0.05, max_entry_bytes=1 << 20)
    keys = [RecordKey("bench", "POST /small", f"replay-piece-{i}") for i in range(at_once)]
    memory = InProcessCache(max_entries=at_once, max_bytes=1 << 20)
    for key in keys:
        await cache.put(_answer(key))
        await memory.put(_answer(key))
    try:
        costs = {
            "Redis GET, bare": await _per_call(
                lambda i: adapter.get("idgw:bench:absent"), at_once=at_once, rounds=rounds
            ),
            "Redis GET under the guard, with key and decode": await _per_call(
                lambda i: cache.get(keys[i]), at_once=at_once, rounds=rounds
            ),
            "SET + PUBLISH under the guard": await _per_call(
                lambda i: cache.put(_answer(keys[i])), at_once=at_once, rounds=rounds
            ),
            "in-process cache hit": await _per_call(
                lambda i: memory.get(keys[i]), at_once=at_once, rounds=rounds
            ),
        }
    finally:
        await cache.close()
    breaker = CircuitBreaker("bench", CACHE_BREAKER)

    def permit_and_verdict() -> None:
        breaker.record(breaker.acquire(), failure=False)

    def fingerprint_again() -> str:
        return request_hash(
            method="POST", path=b"/small", query_string=b"", headers=HEADERS, body=BODY
        )

    costs["breaker permit and verdict"] = _sync_per_call(permit_and_verdict)
    costs["fingerprint of a body sent again"] = _sync_per_call(fingerprint_again)
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/14")
    parser.add_argument("--at-once", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2000)
    args = parser.parse_args()
    costs = uvloop.run(_measure(args.redis_url, args.at_once, args.rounds))
    for name, micros in costs.items():
        print(f"{name}: {micros:.1f} us")


if __name__ == "__main__":
    main()
