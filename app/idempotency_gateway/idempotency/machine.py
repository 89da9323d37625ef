"""The record state machine: what an existing record means for an incoming request, and
which final state an execution's outcome leads to.

    ABSENT              --reserve-->                 IN_PROGRESS
    expired, not live   --take over-->               IN_PROGRESS (a new life, a new TTL)
    IN_PROGRESS, lease over --take over-->           IN_PROGRESS
    FAILED_RETRYABLE    --take over-->               IN_PROGRESS

Every reserve and take-over draws the database's next fencing token: each new owner of a key
holds a larger one than any before it.
    IN_PROGRESS         --finalize (owner, token)--> SUCCEEDED | FAILED_FINAL | FAILED_RETRYABLE

An ``IN_PROGRESS`` record whose lease is live is in flight even past its TTL: its owner is
still running the request, so expiring it would execute the request twice.
"""

from __future__ import annotations

from datetime import datetime
from enum import Enum, auto

from idempotency_gateway.config import IdempotencyConfig, OnAmbiguous
from idempotency_gateway.execution import Outcome
from idempotency_gateway.storage.records import Record, Status


class Action(Enum):
    REPLAY = auto()
    MISMATCH = auto()
    IN_FLIGHT = auto()
    # Nothing reached the upstream before (retryable failure) or the record is forgotten
    # (expired): take the record over and execute.
    RESTART = auto()
    # The owner's lease ran out mid-flight: the upstream may or may not have executed.
    ABANDONED = auto()


def decide(record: Record, *, request_hash: str, now: datetime) -> Action:
    if record.is_expired(now):
        return Action.RESTART
    if record.request_hash != request_hash:
        return Action.MISMATCH
    if record.status is Status.FAILED_RETRYABLE:
        return Action.RESTART
    if record.status is Status.IN_PROGRESS:
        return Action.ABANDONED if record.lease_is_over(now) else Action.IN_FLIGHT
    return Action.REPLAY


def classify(status: int, outcome: Outcome | None, config: IdempotencyConfig) -> Status:
    """The final state of a record, from the answer and what the app reported."""
    if outcome is Outcome.NOT_EXECUTED or (
        outcome is None and status in config.outcomes.not_executed
    ):
        return Status.FAILED_RETRYABLE
    if outcome is Outcome.AMBIGUOUS or status in config.outcomes.ambiguous:
        # ``fail`` stores the answer for good: a second execution is never risked.
        # ``retry`` trusts the upstream to dedupe on the forwarded key.
        if config.on_ambiguous is OnAmbiguous.RETRY:
            return Status.FAILED_RETRYABLE
        return Status.FAILED_FINAL
    return Status.SUCCEEDED if status < 400 else Status.FAILED_FINAL
