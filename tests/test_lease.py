"""``Lease``: the classic lease rule on a hand-moved lease clock, against the real stores.

An owner trusts its lease without a round trip until ``sent_at + lease - margin`` (the margin
a fifth of the lease), ``sent_at`` read before the granting statement was sent. Past that,
``confirm()`` renews with one compare-and-set judged by the store's clock; fenced, unreachable
or too slow, it raises ``LeaseNotConfirmed`` and the lease stays untrusted until a
confirmation succeeds. Fencing tokens come from one source per database: a key created again
after it expired, or taken over, always gets a larger token.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import timedelta

import pytest

from idempotency_gateway.clock import lease_clock
from idempotency_gateway.config import StoreConfig
from idempotency_gateway.errors import LeaseNotConfirmed
from idempotency_gateway.execution import Execution, Outcome
from idempotency_gateway.idempotency.lease import MARGIN_FRACTION, Lease
from idempotency_gateway.idempotency.owner import OwnerRun, new_owner_id
from idempotency_gateway.storage import open_store
from idempotency_gateway.storage.base import Claim, RecordStore, Removal
from idempotency_gateway.storage.records import Fence, Record, RecordKey
from tests.support import eventually
from tests.support.clock import ManualClock
from tests.support.tcp_proxy import TcpProxy

LEASE = 10.0
TRUSTED_FOR = LEASE * (1 - MARGIN_FRACTION)
TTL = 3600.0


class CountingStore:
    """Counts the renewals a lease sends through to the real store."""

    def __init__(self, store: RecordStore) -> None:
        self.store = store
        self.renewals = 0

    async def renew_lease(self, key: RecordKey, fence: Fence, *, lease: float) -> bool:
        self.renewals += 1
        return await self.store.renew_lease(key, fence, lease=lease)


def claim(lease: float = LEASE) -> Claim:
    return Claim("hash", new_owner_id(), lease=lease, ttl=TTL)


async def reserved(store: RecordStore, key: RecordKey) -> Record:
    reservation = await store.reserve(key, claim())
    assert reservation.reserved
    return reservation.record


def lease_of(
    store: RecordStore | CountingStore, record: Record, clock: ManualClock, *, length: float = LEASE
) -> Lease:
    fence = Fence(record.owner_id, record.fencing_token)
    # The lease only calls renew_lease: the counting wrapper stands in for the store.
    return Lease(store, record.key, fence, length=length, sent_at=clock(), clock=clock)  # type: ignore[arg-type]


@pytest.fixture
def key(unique: Callable[[str], str]) -> RecordKey:
    return RecordKey(unique("scope"), "POST /v1/leases", unique("key"))


async def test_a_fresh_lease_is_trusted_without_a_round_trip_until_the_margin(
    store: RecordStore, clock: ManualClock, key: RecordKey
) -> None:
    counting = CountingStore(store)
    lease = lease_of(counting, await reserved(store, key), clock)
    clock.advance(TRUSTED_FOR - 0.001)
    await lease.confirm()
    lease.check()
    assert counting.renewals == 0
    clock.advance(0.001)
    assert not lease.is_trusted()
    with pytest.raises(LeaseNotConfirmed):
        lease.check()


async def test_an_untrusted_lease_is_renewed_by_one_statement_and_trusted_from_its_send(
    store: RecordStore, clock: ManualClock, key: RecordKey
) -> None:
    counting = CountingStore(store)
    lease = lease_of(counting, await reserved(store, key), clock)
    clock.advance(LEASE * 2)  # stalled past the lease; nobody took the record over
    await lease.confirm()
    assert counting.renewals == 1
    current = await store.get(key)
    assert current is not None
    assert current.lease_expires_at == clock.utc() + timedelta(seconds=LEASE)
    clock.advance(TRUSTED_FOR - 0.001)
    lease.check()
    await lease.confirm()
    assert counting.renewals == 1


async def test_a_fresh_confirmation_after_a_pause_always_renews(
    store: RecordStore, clock: ManualClock, key: RecordKey
) -> None:
    counting = CountingStore(store)
    lease = lease_of(counting, await reserved(store, key), clock)
    await lease.confirm(fresh=True)
    assert counting.renewals == 1


async def test_a_lease_taken_over_is_fenced_for_good(
    store: RecordStore, clock: ManualClock, key: RecordKey
) -> None:
    record = await reserved(store, key)
    lease = lease_of(store, record, clock)
    clock.advance(LEASE * 2)
    newer = await store.take_over(record, claim())
    assert newer is not None
    with pytest.raises(LeaseNotConfirmed) as refused:
        await lease.confirm()
    assert refused.value.fenced
    assert lease.fenced
    # Fenced even inside what the clock would trust, and without asking again.
    assert not lease.is_trusted()
    with pytest.raises(LeaseNotConfirmed):
        await lease.confirm()
    current = await store.get(key)
    assert current is not None
    assert current.owner_id == newer.owner_id


@dataclass
class Partition:
    link: TcpProxy
    """Between ``store`` and PostgreSQL: paused, bytes stop and nothing closes."""
    store: RecordStore


@pytest.fixture
async def partition(postgres_url: str) -> AsyncIterator[Partition]:
    async with TcpProxy("127.0.0.1", 5432) as link:
        config = StoreConfig(statement_timeout=0.5, connect_timeout=0.5)
        store = open_store(link.rewrite_url(postgres_url), config)
        try:
            yield Partition(link, store)
        finally:
            link.resume()
            await store.close()


async def test_a_renewal_the_store_cannot_answer_leaves_the_lease_untrusted(
    partition: Partition, clock: ManualClock, key: RecordKey
) -> None:
    lease = lease_of(partition.store, await reserved(partition.store, key), clock, length=2.0)
    lease.check()
    partition.link.pause()
    with pytest.raises(LeaseNotConfirmed) as refused:
        await lease.confirm(fresh=True)
    assert not refused.value.fenced
    # Failed is failed: not trusted, although the clock alone would still trust it.
    assert not lease.is_trusted()
    with pytest.raises(LeaseNotConfirmed):
        lease.check()
    partition.link.resume()
    await lease.confirm()
    lease.check()


async def test_a_heartbeat_renewal_that_fails_untrusts_the_lease_without_fencing_it(
    partition: Partition, key: RecordKey
) -> None:
    record = await reserved(partition.store, key)
    # A renewal every 0.2 s of real time, each given up after 0.48 s.
    run = OwnerRun(partition.store, record, lease=0.6, ttl=TTL, sent_at=lease_clock())
    async with run.heartbeat():
        partition.link.pause()
        await eventually(lambda: not run.lease.is_trusted(), timeout=5.0, message="untrusted")
        assert not run.fenced
        partition.link.resume()
        await eventually(run.lease.is_trusted, timeout=5.0, message="trusted after a renewal")
    assert not run.fenced


async def test_an_execution_reports_not_executed_or_ambiguous_by_what_had_left(
    store: RecordStore, clock: ManualClock, key: RecordKey
) -> None:
    record = await reserved(store, key)
    lease = lease_of(store, record, clock)
    never_sent = Execution(key.idempotency_key, record.fencing_token, lease)
    clock.advance(LEASE * 2)
    assert await store.take_over(record, claim()) is not None
    with pytest.raises(LeaseNotConfirmed):
        await never_sent.confirm()
    assert never_sent.outcome is Outcome.NOT_EXECUTED

    other_key = RecordKey(key.tenant, key.operation, key.idempotency_key + "-sent")
    second = await reserved(store, other_key)
    sent_once = Execution(other_key.idempotency_key, second.fencing_token)
    sent_once.lease = lease_of(store, second, clock)
    await sent_once.confirm()
    sent_once.check()
    assert sent_once.sent
    clock.advance(LEASE * 2)
    assert await store.take_over(second, claim()) is not None
    with pytest.raises(LeaseNotConfirmed):
        await sent_once.confirm(fresh=True)
    assert sent_once.outcome is Outcome.AMBIGUOUS


async def test_a_key_created_again_after_expiry_gets_a_larger_token(
    store: RecordStore, clock: ManualClock, key: RecordKey
) -> None:
    first = await reserved(store, key)
    clock.advance(LEASE * 2)  # its owner is gone, so the record may be expired
    assert await store.expire(key) is Removal.DONE
    reborn = await store.reserve(key, claim())
    assert not reborn.reserved  # the expired row is still there: it is taken over
    again = await store.take_over(reborn.record, claim())
    assert again is not None
    assert again.attempts == 1  # a new life
    assert again.fencing_token > first.fencing_token
    clock.advance(LEASE * 2)
    assert await store.delete(key) is Removal.DONE
    recreated = await reserved(store, key)
    assert recreated.fencing_token > again.fencing_token


async def test_every_take_over_gets_a_larger_token_than_any_before(
    store: RecordStore, clock: ManualClock, key: RecordKey
) -> None:
    record = await reserved(store, key)
    tokens = [record.fencing_token]
    for _ in range(5):
        clock.advance(LEASE * 2)
        taken = await store.take_over(record, claim())
        assert taken is not None
        tokens.append(taken.fencing_token)
        record = taken
    assert tokens == sorted(set(tokens))
