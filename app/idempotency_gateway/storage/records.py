"""The durable record of one idempotency key and the answer it stores."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from enum import StrEnum

# "METHOD path" by default: longer operations cannot be recorded (the middleware says 414).
OPERATION_MAX_LENGTH = 512

# Where fencing tokens come from, one source per database: the sequence of this name on
# PostgreSQL, and on SQLite a one-row counter table of this name (bumped in the transaction
# that writes the new owner).
FENCING_TOKEN_SOURCE = "idempotency_fencing_tokens"


class Status(StrEnum):
    IN_PROGRESS = "IN_PROGRESS"
    SUCCEEDED = "SUCCEEDED"
    FAILED_RETRYABLE = "FAILED_RETRYABLE"
    FAILED_FINAL = "FAILED_FINAL"


# Statuses whose stored answer is replayed to every later duplicate.
REPLAYABLE = frozenset({Status.SUCCEEDED, Status.FAILED_FINAL})


@dataclass(frozen=True, slots=True)
class RecordKey:
    # The client's tenant: the HMAC of its credentials (or a webhook sender's), kept in the
    # tables' ``scope`` column and shown as ``scope`` by the admin API, names they had first.
    tenant: str
    operation: str
    idempotency_key: str


@dataclass(frozen=True, slots=True)
class StoredResponse:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    body_omitted: bool = False
    # ``headers`` as they go on the wire, encoded at the first replay: a copy kept in the
    # process's own replay tier is replayed again and again.
    _wire_headers: tuple[tuple[bytes, bytes], ...] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def wire_headers(self) -> tuple[tuple[bytes, bytes], ...]:
        """``headers`` as bytes, the form they were received in (latin-1 both ways)."""
        encoded = self._wire_headers
        if encoded is None:
            encoded = tuple(
                (name.encode("latin-1"), value.encode("latin-1")) for name, value in self.headers
            )
            object.__setattr__(self, "_wire_headers", encoded)  # frozen: a cache, not a change
        return encoded


@dataclass(frozen=True, slots=True)
class Record:
    key: RecordKey
    request_hash: str
    status: Status
    owner_id: str
    fencing_token: int
    lease_expires_at: datetime
    response: StoredResponse | None
    attempts: int
    created_at: datetime
    updated_at: datetime
    expires_at: datetime

    def is_live(self, now: datetime) -> bool:
        """An owner holds a live lease: the execution is in flight, whatever the TTL says."""
        return self.status is Status.IN_PROGRESS and self.lease_expires_at > now

    def is_expired(self, now: datetime) -> bool:
        """Past its TTL and not in flight: the key is forgotten. A live execution never
        expires; forgetting it would let a duplicate execute a second time."""
        return self.expires_at <= now and not self.is_live(now)

    def lease_is_over(self, now: datetime) -> bool:
        return self.lease_expires_at <= now


@dataclass(frozen=True, slots=True)
class Fence:
    """What an owner must name in every write: a fenced-off owner's writes change nothing."""

    owner_id: str
    fencing_token: int


@dataclass(frozen=True, slots=True)
class Invalidation:
    """An operator's delete or expire of ``key``, for every process's in-process replay cache;
    ``id`` orders them (a sequence, never a time)."""

    id: int
    key: RecordKey
