"""``RedisAdapter``: all the cache, the wake-ups and the live streams ask of Redis, on one node
or a cluster.

``connect_redis`` (``redis_connect``) builds it once from the URL, and that is the only place
where one node and a cluster part ways: a single node (``redis_node``) sends its GET and
SET + PUBLISH past redis-py's per-call layers and listens on one pub/sub connection; a
cluster (``redis_cluster``) routes by slot, publishes on sharded channels and listens on one
connection per primary. Neither the cache nor the wake-ups look at a client's type.

Errors translate once, at the adapter's edge (``redis_connection.redis_failures``): what
means "Redis failed" (redis-py's errors, socket errors, timeouts, a connection torn down under
a command) leaves it as ``RedisUnavailable`` (``redis_unavailable``), which callers turn into
a miss; anything else is a bug and is raised as it is.

This module imports neither redis-py nor an implementation: it is what the cache and the
wake-ups are written against.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    from idempotency_gateway.replay.wakeups import PublishedWakeups

_CLUSTER_SCHEMES = {"redis+cluster": False, "rediss+cluster": True}

# What an operator's delete leaves in a cache entry's place for a while: never an entry (no
# newline), so a read of it is a miss, and a store of an answer over it is refused. A replay
# that read the record just before the operator changed it thus cannot put the old answer
# back after the operator's last delete of the entry, in Redis as in each process's own copies.
INVALIDATED = b"idgw:invalidated"

# SET with a TTL unless the entry is the marker; its length is compared first, so an
# answer's body is never copied into the script, and with ``pcall``, so that a value of
# another type is replaced as a plain SET replaces it. KEYS[1]: the entry; ARGV: the value,
# the TTL in milliseconds, the marker. Answers 1 when stored, 0 when refused.
SET_UNLESS_INVALIDATED = """
if redis.pcall('STRLEN', KEYS[1]) == #ARGV[3] and redis.call('GET', KEYS[1]) == ARGV[3] then
    return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""

# A stream entry's fields, and a stream's entries with their ids, as Redis sends them.
Fields = dict[bytes, bytes]
Entries = list[tuple[bytes, Fields]]


class StreamAppend(NamedTuple):
    stream: str
    entry_id: str
    fields: Fields
    # The stream is deleted before this entry (a new owner's first: see ``redis_appends``).
    replace: bool = False


class RedisAdapter(Protocol):
    async def get(self, name: str) -> object:
        """The value as Redis sent it: ``bytes``, or ``None`` when there is none."""
        ...

    async def get_with_ttl(self, name: str) -> tuple[object, object]:
        """The value and its remaining life in milliseconds (PTTL), in one round trip."""
        ...

    async def set_and_publish(self, name: str, value: bytes, *, ttl_ms: int, channel: str) -> None:
        """SET with a TTL (``SET_UNLESS_INVALIDATED``) and a wake-up on ``channel``, in one
        round trip."""
        ...

    async def publish(self, channel: str) -> None: ...

    async def invalidate(self, name: str, *, ttl_ms: int) -> None:
        """Replace the entry with ``INVALIDATED`` for ``ttl_ms``."""
        ...

    async def ping(self) -> bool: ...

    async def health(self, *, ping: Callable[[], Awaitable[bool]], ping_timeout: float) -> str:
        """What readiness reports: ``ping`` is the cache's own, under its breaker."""
        ...

    async def append_to_streams(
        self, appends: Sequence[StreamAppend], *, expiries: Mapping[str, int]
    ) -> None:
        """XADD each entry and EXPIRE each stream (seconds), pipelined in one round trip; an
        entry whose id the stream already holds is left as it is."""
        ...

    async def first_entry(self, stream: str) -> Entries:
        """XRANGE COUNT 1: the stream's first entry, if it has one."""
        ...

    async def read_stream(self, stream: str, after: bytes, *, count: int, block_ms: int) -> Entries:
        """XREAD BLOCK: up to ``count`` entries after ``after``, waiting up to ``block_ms``
        for one (none when it passed), on a connection of its own whose reads may wait."""
        ...

    def wakeups(self, *, timeout: float) -> PublishedWakeups:
        """Wake-ups across processes, listening the way this deployment needs."""
        ...

    async def close(self) -> None: ...


def is_cluster_url(url: str) -> bool:
    return url.partition("://")[0].lower() in _CLUSTER_SCHEMES


def uses_tls(cluster_url: str) -> bool:
    return _CLUSTER_SCHEMES[cluster_url.partition("://")[0].lower()]
