"""The owner's side of a record: the lease heartbeat and the owner ids, on PostgreSQL and SQLite.

The heartbeat is a timer re-armed after each renewal (real time, a third of the lease); the
store's clock is a ``ManualClock`` moved by the test, so each renewal shows as a new
``lease_expires_at``. An owner that was taken over stops renewing and knows it was fenced.
Owner ids are unique without a ``uuid4`` each, also across a fork.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta

from prometheus_client import REGISTRY

from idempotency_gateway.clock import lease_clock
from idempotency_gateway.idempotency.owner import OwnerRun, new_owner_id
from idempotency_gateway.storage.base import Claim, RecordStore
from idempotency_gateway.storage.records import Record, RecordKey
from tests.support import eventually
from tests.support.clock import ManualClock

# A renewal every 0.1 s of real time.
LEASE = 0.3
TTL = 3600
# What the records table holds in owner_id.
OWNER_ID_LENGTH = 32


async def reserved(store: RecordStore, key: str) -> Record:
    claim = Claim("hash", new_owner_id(), lease=LEASE, ttl=TTL)
    reservation = await store.reserve(RecordKey("scope", "POST /v1/owned", key), claim)
    assert reservation.reserved
    return reservation.record


async def renewed_until(store: RecordStore, record: Record, clock: ManualClock) -> None:
    """Wait for a renewal that read the store's clock at its current time."""
    expected = clock.utc() + timedelta(seconds=LEASE)

    async def lease_ends() -> bool:
        current = await store.get(record.key)
        assert current is not None
        return current.lease_expires_at == expected

    await eventually(lease_ends, timeout=5.0, message=f"lease renewed to {expected}")


async def test_heartbeat_renews_the_lease_again_and_again_while_the_owner_runs(
    store: RecordStore, clock: ManualClock, unique: Callable[[str], str]
) -> None:
    record = await reserved(store, unique("heartbeat"))
    run = OwnerRun(store, record, lease=LEASE, ttl=TTL, sent_at=lease_clock())
    async with run.heartbeat():
        for _ in range(3):
            clock.advance(60)
            await renewed_until(store, record, clock)
    assert not run.fenced


async def test_an_owner_taken_over_stops_renewing_and_knows_it_was_fenced(
    store: RecordStore, clock: ManualClock, unique: Callable[[str], str]
) -> None:
    record = await reserved(store, unique("fenced-heartbeat"))
    run = OwnerRun(store, record, lease=LEASE, ttl=TTL, sent_at=lease_clock())

    def fenced_renewals() -> float:
        value = REGISTRY.get_sample_value(
            "idempotency_gateway_fenced_writes_total", {"write": "lease_renewal"}
        )
        return value or 0.0

    before = fenced_renewals()
    async with run.heartbeat():
        clock.advance(LEASE * 2)  # the lease ran out before the next renewal
        newer = await store.take_over(record, Claim("hash", new_owner_id(), LEASE, 3600))
        assert newer is not None
        await eventually(lambda: run.fenced, timeout=5.0, message="the old owner fenced")
    assert fenced_renewals() == before + 1
    current = await store.get(record.key)
    assert current is not None
    assert current.owner_id == newer.owner_id


def test_owner_ids_are_unique_fit_the_column_and_differ_in_a_forked_child() -> None:
    ids = [new_owner_id() for _ in range(10_000)]
    assert len(set(ids)) == len(ids)
    assert {len(owner_id) for owner_id in ids} == {OWNER_ID_LENGTH}
    reader, writer = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - runs in the child
        os.write(writer, new_owner_id().encode())
        os._exit(0)
    os.close(writer)
    _, status = os.waitpid(child, 0)
    child_id = os.read(reader, 64).decode()
    os.close(reader)
    assert os.waitstatus_to_exitcode(status) == 0
    parent_id = new_owner_id()
    # The child drew its own random prefix instead of continuing the parent's.
    assert child_id[:20] != parent_id[:20]
