"""A live execution is never expired: an ``IN_PROGRESS`` record whose owner keeps renewing its
lease is in flight past its TTL, so a duplicate gets 409 (never a second execution) and the
background sweeper leaves the row alone.

Real gateway processes, a real slow upstream and the real store, on PostgreSQL and SQLite.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from idempotency_gateway.config import StoreConfig
from idempotency_gateway.storage import open_store
from idempotency_gateway.storage.base import Claim, RecordStore
from idempotency_gateway.storage.records import Record, RecordKey, Status
from tests.support import GatewayProcess, RecordingUpstream, eventually, write_config
from tests.support.gateway import route
from tests.support.keyed import is_replay, keyed_gateway_config, record_key, send_keyed
from tests.support.problems import assert_problem
from tests.support.upstream import EXECUTION_HEADER

pytestmark = pytest.mark.slow

# The first request outlives its TTL several times over; the heartbeat keeps its lease live.
TTL = "2s"
LEASE = "1s"


@pytest.fixture
async def real_time_store(database_url: str) -> AsyncIterator[RecordStore]:
    """The gateway's own database, read on its own clock (no manual time here)."""
    store = open_store(database_url, StoreConfig())
    yield store
    await store.close()


async def record_of(store: RecordStore, key: RecordKey) -> Record:
    record = await store.get(key)
    assert record is not None, f"no record for {key}"
    return record


async def test_a_duplicate_after_the_ttl_of_a_live_execution_gets_409_not_a_second_run(
    tmp_path: Path,
    database_url: str,
    real_time_store: RecordStore,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
) -> None:
    config = keyed_gateway_config(
        upstream.url,
        routes=[route("/", key="required", ttl=TTL, lease=LEASE, on_ambiguous="fail")],
        sweeper={"interval": "100ms", "batch_size": 100},
    )
    gateway = GatewayProcess(
        write_config(tmp_path, config.model_dump(mode="json")),
        env={"GATEWAY_DATABASE_URL": database_url},
        log_dir=tmp_path,
    )
    key = unique("slow-past-ttl")
    marker = RecordKey("anonymous", "POST /v1/sweep-marker", unique("marker"))
    try:
        await gateway.start()
        async with httpx.AsyncClient(base_url=gateway.url, timeout=30.0, trust_env=False) as client:
            first = asyncio.create_task(send_keyed(client, key, behavior="gate=slow"))
            await upstream.wait_arrived("slow")
            live = await record_of(real_time_store, record_key(key))
            # A record that expires after the live one: once a sweep has removed it, the
            # sweeper has had its chance at the live record too.
            claim = Claim("f" * 64, os.urandom(16).hex(), lease=1.0, ttl=2.0)
            assert (await real_time_store.reserve(marker, claim)).reserved

            async def marker_swept() -> bool:
                return await real_time_store.get(marker) is None

            await eventually(marker_swept, timeout=20.0, message="the sweeper ran")
            still = await record_of(real_time_store, record_key(key))
            assert datetime.now(UTC) > live.expires_at
            assert still.status is Status.IN_PROGRESS
            assert still.owner_id == live.owner_id
            assert still.fencing_token == live.fencing_token
            # Renewed past the TTL by the owner's heartbeat: the lease, not the TTL, rules.
            assert still.lease_expires_at > live.expires_at

            duplicate = await send_keyed(client, key)
            assert_problem(duplicate, 409, "request-in-flight")

            upstream.release("slow")
            original = await first
            replay = await send_keyed(client, key)
    finally:
        await gateway.stop()
        print(f"--- gateway log tail ---\n{gateway.log_tail()}")

    assert original.status_code == 201
    assert upstream.count(key) == 1
    assert is_replay(replay)
    assert replay.headers[EXECUTION_HEADER] == original.headers[EXECUTION_HEADER]
    assert replay.content == original.content
