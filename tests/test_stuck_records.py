"""The ``stuck_records`` gauge and the store count behind it, on PostgreSQL and SQLite.

``count_stuck`` must agree with ``list_stuck`` (the admin listing) and never count past its
limit; the sampler puts that count into the gauge and keeps the last sample while the store
is down instead of failing the worker's background task.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from prometheus_client import REGISTRY

from idempotency_gateway.config import StoreConfig
from idempotency_gateway.operations.stuck_records import StuckRecordsSampler
from idempotency_gateway.storage import open_store
from idempotency_gateway.storage.base import Claim, RecordStore
from idempotency_gateway.storage.records import RecordKey
from tests.support.clock import ManualClock
from tests.support.gateway import unreachable_database_url

LEASE = 10.0
GAUGE = "idempotency_gateway_stuck_records"


async def reserve_owners(store: RecordStore, unique: Callable[[str], str], count: int) -> set[str]:
    """``count`` fresh IN_PROGRESS records with a ``LEASE`` second lease; their keys."""
    keys = {unique(f"stuck-{n}") for n in range(count)}
    assert len(keys) == count
    for key in keys:
        claim = Claim("hash", uuid.uuid4().hex, lease=LEASE, ttl=3600)
        reservation = await store.reserve(RecordKey("scope", "POST /v1/stuck", key), claim)
        assert reservation.reserved
    return keys


async def test_count_stuck_agrees_with_the_listing_and_stops_at_its_limit(
    store: RecordStore, clock: ManualClock, unique: Callable[[str], str]
) -> None:
    keys = await reserve_owners(store, unique, 3)
    listed = {record.key.idempotency_key for record in await store.list_stuck(limit=100_000)}
    assert not keys & listed  # leases still running: not stuck yet
    assert await store.count_stuck(limit=100_000) == len(listed)

    clock.advance(LEASE + 1)

    stuck = await store.list_stuck(limit=100_000)
    assert keys <= {record.key.idempotency_key for record in stuck}
    assert await store.count_stuck(limit=100_000) == len(stuck)
    assert await store.count_stuck(limit=2) == 2


async def test_sampler_sets_the_gauge_and_keeps_it_while_the_store_is_down(
    store: RecordStore, clock: ManualClock, unique: Callable[[str], str]
) -> None:
    await reserve_owners(store, unique, 2)
    clock.advance(LEASE + 1)
    await StuckRecordsSampler(store.count_stuck, limit=100_000).sample()
    sampled = REGISTRY.get_sample_value(GAUGE)
    assert sampled == await store.count_stuck(limit=100_000)
    assert sampled is not None
    assert sampled >= 2

    down = open_store(unreachable_database_url(), StoreConfig(), clock=clock.utc)
    try:
        sampler = StuckRecordsSampler(down.count_stuck)
        await sampler.sample()
    finally:
        await down.close()
    assert sampler.degradation.failures == 1
    assert REGISTRY.get_sample_value(GAUGE) == sampled
