"""``release_unsent`` and ``OrphanReleases`` on both stores: a claim its owner never sent is
given back as not executed, fenced by the owner id, and the queue that holds such claims
while the store is down stays bounded."""

from __future__ import annotations

import uuid
from collections.abc import Callable

from idempotency_gateway.config import StoreConfig
from idempotency_gateway.idempotency.orphans import OrphanReleases
from idempotency_gateway.storage import open_store
from idempotency_gateway.storage.base import Claim, RecordStore
from idempotency_gateway.storage.records import Fence, RecordKey, Status, StoredResponse
from tests.support import eventually
from tests.support.gateway import unreachable_database_url

LEASE = 30.0
TTL = 3600.0


def _key(unique: Callable[[str], str], name: str = "key") -> RecordKey:
    return RecordKey(unique("scope"), "POST /v1/charges", unique(name))


async def _reserved(store: RecordStore, key: RecordKey) -> Fence:
    """A fresh claim on ``key``: its owner id and fencing token."""
    reservation = await store.reserve(key, Claim("1" * 64, uuid.uuid4().hex, LEASE, TTL))
    assert reservation.reserved
    return Fence(reservation.record.owner_id, reservation.record.fencing_token)


async def test_an_unsent_claim_is_released_as_not_executed_and_runs_again(
    store: RecordStore, unique: Callable[[str], str]
) -> None:
    key = _key(unique)
    owner = await _reserved(store, key)

    assert await store.release_unsent(key, owner.owner_id)

    record = await store.get(key)
    assert record is not None
    assert record.status is Status.FAILED_RETRYABLE
    assert record.response is None
    taken = await store.take_over(record, Claim("1" * 64, uuid.uuid4().hex, LEASE, TTL))
    assert taken is not None
    assert taken.status is Status.IN_PROGRESS


async def test_a_release_by_another_owner_or_of_a_finished_record_changes_nothing(
    store: RecordStore, unique: Callable[[str], str]
) -> None:
    key = _key(unique)
    owner = await _reserved(store, key)

    assert not await store.release_unsent(key, uuid.uuid4().hex)
    assert await store.finalize(
        key, owner, status=Status.SUCCEEDED, response=StoredResponse(201, [], b"{}"), ttl=TTL
    )
    assert not await store.release_unsent(key, owner.owner_id)
    assert not await store.release_unsent(_key(unique, "absent"), owner.owner_id)

    record = await store.get(key)
    assert record is not None
    assert record.status is Status.SUCCEEDED


async def test_released_orphans_leave_the_queue(
    store: RecordStore, unique: Callable[[str], str]
) -> None:
    keys = [_key(unique, f"key-{number}") for number in range(3)]
    owners = [await _reserved(store, key) for key in keys]
    orphans = OrphanReleases(store)

    for key, owner in zip(keys, owners, strict=True):
        orphans.add(key, owner.owner_id, ttl=TTL)
    await eventually(lambda: orphans.pending == 0)
    await orphans.close()

    for key in keys:
        record = await store.get(key)
        assert record is not None
        assert record.status is Status.FAILED_RETRYABLE


async def test_the_queue_is_bounded_and_gives_up_past_the_ttl(
    unique: Callable[[str], str],
) -> None:
    down = open_store(unreachable_database_url(), StoreConfig(connect_timeout=0.2))
    now = [0.0]
    orphans = OrphanReleases(down, capacity=2, monotonic=lambda: now[0])
    try:
        for number in range(3):
            orphans.add(_key(unique, f"key-{number}"), uuid.uuid4().hex, ttl=10.0)
        assert orphans.pending == 2
        now[0] = 11.0
        await eventually(lambda: orphans.pending == 0)
    finally:
        await orphans.close()
        await down.close()
