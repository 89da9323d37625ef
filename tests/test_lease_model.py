"""A model of owners, leases, stalls and the database's clock, run over the real SQLite store.

Owners reserve or take over keys, renew, send attempts (each declined with a 503, or
executed) and finalize, exactly as the engine and the proxy do: ``confirm()`` before an attempt
(fresh after a retry pause), ``check()`` right before it leaves. Between any two steps time
may pass, which is how a stall looks from outside: the database's clock moves, and so does
each owner's lease clock, at its own rate (up to 10 % off). No step is a stall of its own: an
owner that takes no step while time passes is stalled.

Invariants, for every key and on both ``on_ambiguous`` routes:
- an attempt leaves only while the database says its owner and token hold a live lease;
- the upstream executes it at most once;
- never again once a takeover settled it as "outcome unknown".

An owner that executed and then stalls before finalizing is the ambiguous case the routes
decide (``retry`` trusts the upstream to dedupe); it is modelled on the ``fail`` route only.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
from collections.abc import Coroutine
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, TypeVar

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    MultipleResults,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)

from idempotency_gateway.config import StoreConfig
from idempotency_gateway.errors import LeaseNotConfirmed
from idempotency_gateway.execution import Execution, Outcome
from idempotency_gateway.idempotency.lease import Lease
from idempotency_gateway.idempotency.machine import Action, decide
from idempotency_gateway.idempotency.owner import new_owner_id
from idempotency_gateway.migrate import upgrade_to_head
from idempotency_gateway.storage import open_store
from idempotency_gateway.storage.base import Claim
from idempotency_gateway.storage.records import Fence, Record, RecordKey, Status
from tests.support.clock import ManualClock

T = TypeVar("T")

LEASE = 10.0
TTL = 100_000.0  # nothing expires: every new life of a key is a legitimate new execution
KEYS = ("a", "b")


@dataclass
class Owner:
    key: str
    fence: Fence
    execution: Execution
    paused: bool = False
    """A declined attempt was retried after a pause: the next confirmation is fresh."""
    executed: bool = False
    """An attempt was executed and not finalized yet (the owner stalls there)."""


@dataclass
class LeaseClock:
    """One owner's lease clock: the model's time at the owner's rate, from its own origin."""

    model: LeaseModel
    rate: float
    origin: float
    started: float = field(init=False)

    def __post_init__(self) -> None:
        self.started = self.model.time

    def __call__(self) -> float:
        return self.origin + (self.model.time - self.started) * self.rate


@cache
def migrated_database() -> Path:
    """One migrated SQLite file per test run; each example starts from a copy of it."""
    path = Path(tempfile.mkdtemp(prefix="lease-model-")) / "records.db"
    upgrade_to_head(f"sqlite:///{path}")
    return path


class LeaseModel(RuleBasedStateMachine):
    owners = Bundle("owners")

    def __init__(self) -> None:
        super().__init__()
        self.runner = asyncio.Runner()
        self.directory = tempfile.TemporaryDirectory()
        path = Path(self.directory.name) / "records.db"
        shutil.copyfile(migrated_database(), path)
        url = f"sqlite:///{path}"
        self.database = ManualClock()
        self.store = open_store(url, StoreConfig(), clock=self.database.utc)
        self.time = 0.0
        self.scope = new_owner_id()
        self.on_ambiguous = "fail"
        self.executions = dict.fromkeys(KEYS, 0)
        self.settled_unknown = dict.fromkeys(KEYS, False)
        self.after_settled = dict.fromkeys(KEYS, 0)

    def run(self, work: Coroutine[Any, Any, T]) -> T:
        return self.runner.run(work)

    def teardown(self) -> None:
        self.run(self.store.close())
        self.runner.close()
        self.directory.cleanup()

    def record_key(self, key: str) -> RecordKey:
        return RecordKey(self.scope, "POST /v1/charges", key)

    def record(self, key: str) -> Record:
        record = self.run(self.store.get(self.record_key(key)))
        assert record is not None
        return record

    @initialize(on_ambiguous=st.sampled_from(["retry", "fail"]))
    def choose_route(self, on_ambiguous: str) -> None:
        self.on_ambiguous = on_ambiguous

    @rule(seconds=st.sampled_from([0.5, 2.0, 5.0, 9.0, 15.0, 30.0]))
    def time_passes(self, seconds: float) -> None:
        self.time += seconds
        self.database.advance(seconds)

    @rule(
        target=owners,
        key=st.sampled_from(KEYS),
        rate=st.sampled_from([0.9, 1.0, 1.1]),
        origin=st.sampled_from([0.0, 1e6]),
    )
    def request_arrives(
        self, key: str, rate: float, origin: float
    ) -> Owner | MultipleResults[Owner]:
        """A request with ``key`` arrives at a new owner: it reserves, or takes over, or
        settles an abandoned record as outcome unknown (``fail``), or does nothing more."""
        clock = LeaseClock(self, rate, origin)
        claim = Claim("hash", new_owner_id(), LEASE, TTL)
        sent_at = clock()
        reservation = self.run(self.store.reserve(self.record_key(key), claim))
        record = reservation.record
        if not reservation.reserved:
            action = decide(record, request_hash="hash", now=reservation.now)
            if action not in (Action.RESTART, Action.ABANDONED):
                return multiple()  # replayed, or in flight
            sent_at = clock()
            taken = self.run(self.store.take_over(record, claim))
            if taken is None:
                return multiple()
            record = taken
            if action is Action.ABANDONED and self.on_ambiguous == "fail":
                fence = Fence(record.owner_id, record.fencing_token)
                self.settled_unknown[key] |= self.finalize(key, fence, Status.FAILED_FINAL)
                return multiple()
        fence = Fence(record.owner_id, record.fencing_token)
        lease = Lease(self.store, record.key, fence, length=LEASE, sent_at=sent_at, clock=clock)
        return Owner(key, fence, Execution(key, fence.fencing_token, lease))

    def finalize(self, key: str, fence: Fence, status: Status) -> bool:
        return self.run(
            self.store.finalize(self.record_key(key), fence, status=status, response=None, ttl=TTL)
        )

    @rule(owner=owners)
    def heartbeat(self, owner: Owner) -> None:
        lease = owner.execution.lease
        assert isinstance(lease, Lease)
        with contextlib.suppress(LeaseNotConfirmed):
            self.run(lease.renew())

    @rule(owner=owners, executes=st.booleans(), stalls_after=st.booleans())
    def attempt(self, owner: Owner, executes: bool, stalls_after: bool) -> None:
        if owner.executed or owner.execution.outcome is not None:
            return
        try:
            self.run(owner.execution.confirm(fresh=owner.paused))
            owner.execution.check()
        except LeaseNotConfirmed:
            return
        # The attempt leaves now: the database must agree this owner holds the lease.
        record = self.record(owner.key)
        assert record.status is Status.IN_PROGRESS
        assert record.owner_id == owner.fence.owner_id
        assert record.fencing_token == owner.fence.fencing_token
        assert record.lease_expires_at > self.database.now
        if not executes:
            owner.paused = True  # a 503 with Retry-After: the owner retries after a pause
            return
        self.executions[owner.key] += 1
        if self.settled_unknown[owner.key]:
            self.after_settled[owner.key] += 1
        owner.executed = True
        if not (stalls_after and self.on_ambiguous == "fail"):
            self.finalize(owner.key, owner.fence, Status.SUCCEEDED)

    @rule(owner=consumes(owners))
    def owner_finishes(self, owner: Owner) -> None:
        """The owner records what it knows: its executed answer, or that it gave up."""
        if owner.executed:
            status = Status.SUCCEEDED
        elif owner.execution.outcome is Outcome.AMBIGUOUS and self.on_ambiguous == "fail":
            status = Status.FAILED_FINAL
        else:
            status = Status.FAILED_RETRYABLE
        self.finalize(owner.key, owner.fence, status)

    @invariant()
    def executed_at_most_once(self) -> None:
        for key in KEYS:
            assert self.executions[key] <= 1, f"{key} executed {self.executions[key]} times"
            assert self.after_settled[key] == 0, f"{key} executed after outcome unknown"


LeaseModel.TestCase.settings = settings(max_examples=50, stateful_step_count=30, deadline=None)
test_lease_model = LeaseModel.TestCase
