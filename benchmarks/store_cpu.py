"""Client CPU per reserve + finalize pair on a store: ``python -m benchmarks.store_cpu``.

    .venv/bin/python -m benchmarks.store_cpu                       # a fresh SQLite file
    .venv/bin/python -m benchmarks.store_cpu --url postgresql://...  --pairs 5000

Measures ``time.process_time`` (this process's CPU, the driver's thread included), not wall
time, so a noisy machine changes the result little; the database server's CPU is not counted.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from pathlib import Path

from idempotency_gateway.config import StoreConfig
from idempotency_gateway.migrate import upgrade_to_head
from idempotency_gateway.storage import open_store
from idempotency_gateway.storage.base import Claim, RecordStore
from idempotency_gateway.storage.records import Fence, RecordKey, Status, StoredResponse

ANSWER = StoredResponse(201, [("content-type", "application/json")], b'{"id":"ch_1"}' * 8)


async def cpu_per_pair(url: str, pairs: int) -> float:
    store = open_store(url, StoreConfig())
    scope = uuid.uuid4().hex[:16]
    try:
        await _pairs(store, scope, 100, "warm")  # connections opened, statements compiled
        started = time.process_time()
        await _pairs(store, scope, pairs, "measured")
        return (time.process_time() - started) / pairs
    finally:
        await store.close()


async def _pairs(store: RecordStore, scope: str, count: int, label: str) -> None:
    for index in range(count):
        key = RecordKey(scope, "POST /v1/charges", f"{label}-{index}")
        claim = Claim("1" * 64, uuid.uuid4().hex, lease=30.0, ttl=3600.0)
        record = (await store.reserve(key, claim)).record
        fence = Fence(record.owner_id, record.fencing_token)
        await store.finalize(key, fence, status=Status.SUCCEEDED, response=ANSWER, ttl=3600.0)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.store_cpu")
    parser.add_argument("--url", help="database URL (default: a fresh SQLite file)")
    parser.add_argument("--pairs", type=int, default=3000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        url = args.url or f"sqlite:///{Path(directory) / 'records.db'}"
        upgrade_to_head(url)
        seconds = asyncio.run(cpu_per_pair(url, args.pairs))
    print(f"{seconds * 1e6:.0f} us of client CPU per reserve + finalize ({args.pairs} pairs)")


if __name__ == "__main__":
    main()
