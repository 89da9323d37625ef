"""``ReplayCache``: a fast path for replays. It never decides anything.

Only finished, replayable records (``SUCCEEDED``, ``FAILED_FINAL``) are cached: their answer
never changes until the record expires or an operator deletes it, so a cached copy cannot go
stale while it lives. Every entry carries the full record key and the request hash, and is
checked on the way out: a corrupt, foreign or expired entry is a miss, never an answer.

One clock: no host's wall clock judges an entry's expiry. A record's remaining life is what
the database says it is (its ``expires_at`` minus the database's "now" of the statement that
handed the record over), counted down on this process's monotonic clock from the moment that
statement was sent, so an entry dies no later than its record whatever a host's clock says.
Redis gets that remaining life as a relative TTL (``PX``) and judges it on its own clock.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Protocol

import orjson

from idempotency_gateway.clock import Monotonic, lease_clock
from idempotency_gateway.config import CacheConfig
from idempotency_gateway.storage.records import (
    REPLAYABLE,
    Record,
    RecordKey,
    Status,
    StoredResponse,
)
from idempotency_gateway.telemetry.iteration_metrics import counts
from idempotency_gateway.telemetry.metrics import CACHE_LOOKUPS

# Bound once per result (hit, miss, error), shared by every cache.
cache_lookups = counts(CACHE_LOOKUPS)

log = logging.getLogger(__name__)

# 2: no expiry inside the entry (Redis's TTL alone ends it). An entry of another format is a
# miss, so gateways of both formats on one Redis only cost each other cache hits.
_FORMAT = 2
# How long an invalidated key refuses new entries: a replay that read the record just before
# the operator changed it must not put the old answer back. Far longer than a store read.
INVALIDATION_GUARD = 5.0


@dataclass(frozen=True, slots=True)
class CachedAnswer:
    key: RecordKey
    request_hash: str
    status: Status
    response: StoredResponse
    # This process's lease clock (``clock.lease_clock``), never a wall clock.
    expires_at: float

    @classmethod
    def of(cls, record: Record, *, now: datetime, asked_at: float) -> CachedAnswer | None:
        if record.status not in REPLAYABLE or record.response is None:
            return None
        return cls(
            record.key,
            record.request_hash,
            record.status,
            record.response,
            expiry_of(record, now=now, asked_at=asked_at),
        )

    def is_live(self, now: float) -> bool:
        return self.expires_at > now


def expiry_of(record: Record, *, now: datetime, asked_at: float) -> float:
    """When ``record`` expires, on this process's monotonic clock. ``now``: the database's
    clock in the statement that handed the record over; ``asked_at``: the monotonic clock when
    that statement was sent, no later than the database's ``now``, so the result is never
    later than the record's expiry."""
    return asked_at + (record.expires_at - now).total_seconds()


def cache_key(key: RecordKey, *, prefix: str = "idgw:r:") -> str:
    """A fixed-length name: client-chosen keys never shape the cache's key space. The digest
    is a Redis Cluster hash tag, so a key's entry and its wake-up channel share a slot."""
    return f"{prefix}{{{_key_digest(key.tenant, key.operation, key.idempotency_key)}}}"


@functools.lru_cache(maxsize=4096)
def _key_digest(*parts: str) -> str:
    """Each part length-prefixed, so no two keys' parts run together into the same bytes.
    Remembered: a new key asks for it three times (lookup, entry, wake-up channel) and every
    replay of a key again."""
    encoded = [part.encode() for part in parts]
    return hashlib.sha256(
        b"".join([len(part).to_bytes(4, "big") + part for part in encoded])
    ).hexdigest()


def encode(answer: CachedAnswer) -> bytes:
    """JSON metadata, a newline, then the body bytes as they are (no base64 round trip)."""
    meta = orjson.dumps(
        {
            "v": _FORMAT,
            "k": [answer.key.tenant, answer.key.operation, answer.key.idempotency_key],
            "h": answer.request_hash,
            "s": answer.status.value,
            "rs": answer.response.status,
            "rh": answer.response.headers,
            "o": answer.response.body_omitted,
        }
    )
    return meta + b"\n" + answer.response.body


def decode(raw: bytes, expected: RecordKey, *, expires_at: float) -> CachedAnswer | None:
    """The entry, or ``None`` when it is not a well-formed entry for exactly this key.
    ``expires_at``: what the reader knows of its life (Redis's TTL had it live when read)."""
    meta_bytes, separator, body = raw.partition(b"\n")
    if not separator:
        return None
    try:
        meta = orjson.loads(meta_bytes)
        if meta["v"] != _FORMAT or RecordKey(*meta["k"]) != expected:
            return None
        status = Status(meta["s"])
        if status not in REPLAYABLE:
            return None
        response = StoredResponse(
            status=int(meta["rs"]),
            headers=[(str(name), str(value)) for name, value in meta["rh"]],
            body=body,
            body_omitted=bool(meta["o"]),
        )
        return CachedAnswer(expected, str(meta["h"]), status, response, expires_at)
    except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
        return None


class ReplayCache(Protocol):
    """What the engine, the admin API and the gateway's assembly need of a replay cache;
    none of them looks at the concrete class."""

    # True when every worker reads the same entries (Redis): one delete reaches them all.
    # False for a cache each process keeps for itself: an operator's delete then reaches the
    # other processes only through ``CacheInvalidations``.
    shared_across_workers: bool

    async def get(self, key: RecordKey) -> CachedAnswer | None: ...

    async def put(self, answer: CachedAnswer) -> bool:
        """True when storing it also woke the key's waiters in other processes (the Redis
        cache publishes the wake-up in the same round trip as the entry)."""
        ...

    async def delete(self, key: RecordKey) -> bool: ...

    def invalidate(self, keys: Iterable[RecordKey]) -> None:
        """Drop this process's own copies of records an operator changed, and keep them out
        for a while (``INVALIDATION_GUARD``). A shared cache keeps no copies of its own."""
        ...

    def clear(self) -> None:
        """Drop every copy this process keeps of its own (a shared cache keeps none)."""
        ...

    async def health(self) -> str:
        """What readiness reports for the cache: it never makes the gateway unready."""
        ...

    async def close(self) -> None: ...


class InProcessCache:
    """A bounded LRU for the embedded default: by entry count and by total body bytes."""

    shared_across_workers = False

    def __init__(
        self,
        *,
        max_entries: int,
        max_bytes: int,
        monotonic: Monotonic = lease_clock,
    ) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[RecordKey, CachedAnswer] = OrderedDict()
        self._bytes = 0
        self._monotonic = monotonic
        # Key -> until when puts of it are refused (see INVALIDATION_GUARD).
        self._guarded: dict[RecordKey, float] = {}

    @classmethod
    def sized_by(cls, config: CacheConfig) -> InProcessCache:
        return cls(max_entries=config.max_entries, max_bytes=config.max_bytes)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    async def get(self, key: RecordKey) -> CachedAnswer | None:
        answer = self.lookup(key)
        cache_lookups("miss" if answer is None else "hit").inc()
        return answer

    def lookup(self, key: RecordKey) -> CachedAnswer | None:
        """The live entry, uncounted: for a cache in front of another, which counts once."""
        answer = self._entries.get(key)
        if answer is None:
            return None
        if not answer.is_live(self._monotonic()):
            self._remove(key)
            return None
        self._entries.move_to_end(key)
        return answer

    async def put(self, answer: CachedAnswer) -> bool:
        size = len(answer.response.body)
        if size > self.max_bytes or self._is_guarded(answer.key):
            return False
        self._remove(answer.key)
        self._entries[answer.key] = answer
        self._bytes += size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            oldest = next(iter(self._entries))
            self._remove(oldest)
        return False  # waiters of this process only, whom ``LocalWakeups`` wakes itself

    async def delete(self, key: RecordKey) -> bool:
        self._remove(key)
        return True

    def invalidate(self, keys: Iterable[RecordKey]) -> None:
        """Drop records an operator changed, and keep them out for a while."""
        now = self._monotonic()
        self._guarded = {key: until for key, until in self._guarded.items() if until > now}
        for key in keys:
            self._remove(key)
            self._guarded[key] = now + INVALIDATION_GUARD

    def _is_guarded(self, key: RecordKey) -> bool:
        until = self._guarded.get(key)
        return until is not None and until > self._monotonic()

    def clear(self) -> None:
        self._entries.clear()
        self._bytes = 0

    def _remove(self, key: RecordKey) -> None:
        answer = self._entries.pop(key, None)
        if answer is not None:
            self._bytes -= len(answer.response.body)

    async def health(self) -> str:
        return "in-process"

    async def close(self) -> None:
        self.clear()
