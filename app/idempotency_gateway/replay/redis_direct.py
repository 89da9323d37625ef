"""Commands on redis-py's own connections, past the client's per-call layers.

Each ``Redis.execute_command`` goes through a retry wrapper, an event dispatcher, an
observability recorder and the pool's health check on every call: on a replay that was more
client CPU than the gateway's own work (``benchmarks/redis_clients.py``: a GET costs about
50 us that way and about 21 us on a bare connection). The replay cache asks a single node
for one GET or one pipelined SET + PUBLISH per request, so it sends them on connections taken
from the client's own pool (auth, TLS, database, RESP version and timeouts all apply, redis-py
connects them) and keeps the idle ones itself.

Bounded like the pool itself: a connection is taken with the pool's own accounting, so every
one this path holds, busy or idle, counts against the pool's ``max_connections`` (100 unless
the URL says ``?max_connections=N``); at the limit a command fails at once (a cache miss)
instead of opening one more. At most ``max_idle`` stay idle, none for longer than
``idle_timeout``: a burst leaves no crowd of sockets behind, and Redis's ``maxclients`` is
not spent on connections nobody uses.

A connection goes back to the idle list only after every reply of its commands was read. An
error reply (a SET refused by a full Redis, a WRONGTYPE) is a whole reply: the connection
stays in step and is kept, and the error is raised in the one caller whose command drew it,
never in the others that shared its pipeline.
Any failure or cancellation closes it, so a reply can never be read as the answer to a later
command, and closes the idle ones too, so a Redis that restarted costs one failure, not one
per connection the busiest moment left idle. (``cache.decode`` also checks that an entry
names the key it was asked for.)
A Redis Cluster keeps the full client, which routes by slot.

The commands of one loop iteration go together (``run_batched``): the GET + PTTL of every
keyed request that arrived at once, and the SET + PUBLISH of every request finalized at once,
are one pipeline, one write and one read of all the replies, sent once the iteration's other
callbacks had their turn. The first caller of an iteration sends the batch; the others wait
for their replies. At most ``MAX_BATCH`` calls share a pipeline. Under load this is what
keeps Redis's cost per request down on both sides: 32 concurrent new keys cost a few
writes and reads instead of 32 (``benchmarks/RESULTS.md``, "Redis reads batched").
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.exceptions import ResponseError
from redis.typing import EncodableT

Command = Sequence[EncodableT]

# As wide as a busy worker's burst of concurrent requests: a connection closed for being one
# too many idle is opened again by the next burst, and a reconnect (socket, HELLO, SELECT,
# CLIENT SETNAME) costs the client several times the command (32 at once, burst after burst:
# 36-42 us of CPU per GET + PTTL with 64 kept, 250-290 us with 8; benchmarks/redis_idle.py).
MAX_IDLE = 64
IDLE_TIMEOUT = 30.0
MAX_BATCH = 64


class BatchFailed(ConnectionError):
    """The caller that was sending a batch failed or was cancelled first: the other callers'
    commands may or may not have reached Redis, as with any call that fails under way."""


_Waiter = tuple[tuple["Command", ...], "asyncio.Future[list[Any]] | None"]


class DirectCommands:
    def __init__(
        self, redis: Redis, *, max_idle: int = MAX_IDLE, idle_timeout: float = IDLE_TIMEOUT
    ) -> None:
        self._pool: ConnectionPool = redis.connection_pool
        self.max_idle = max_idle
        self.idle_timeout = idle_timeout
        # (connection, loop time it went idle), oldest first: taken from the end (the
        # warmest), expired from the front.
        self._idle: list[tuple[AbstractConnection, float]] = []
        self._reaper: asyncio.TimerHandle | None = None
        self._closing: set[asyncio.Task[None]] = set()
        # The batch this loop iteration is gathering: the sender's own commands first (no
        # future: it reads its replies itself), then each other caller's with its future.
        self._batch: list[_Waiter] | None = None

    @property
    def idle(self) -> int:
        return len(self._idle)

    async def run(self, *commands: Command) -> list[Any]:
        """The replies to ``commands``, sent together in one write: one round trip. An error
        reply is raised (the first one), after every reply was read."""
        return _raised(await self._exchange(commands))

    async def _exchange(self, commands: Sequence[Command]) -> list[Any]:
        """The replies to ``commands``, an error reply as its ``ResponseError`` in its place."""
        # Synchronous, so no lock is needed: the pool's own count of connections in use
        # (``MaxConnectionsError`` at its limit) covers the ones held here.
        connection = self._idle.pop()[0] if self._idle else self._from_pool()
        try:
            await connection.send_packed_command(_pack(connection, commands), check_health=False)
            replies = [await _read_reply(connection) for _ in commands]
        except BaseException:
            # The idle ones were opened before this failure and most likely share its cause
            # (Redis restarted, killed its clients, or a network path broke): each would cost
            # a later command a failure of its own, and a half-open breaker's probe the whole
            # probe. They go too; the next command connects afresh.
            idle, self._idle = self._idle, []
            self._discard([connection, *(dropped for dropped, _ in idle)])
            raise
        self._keep(connection)
        return replies

    async def run_batched(self, *commands: Command) -> list[Any]:
        """The replies to ``commands``, sent in one pipeline with every other batched call of
        this loop iteration."""
        loop = asyncio.get_running_loop()
        if self._batch is not None and len(self._batch) < MAX_BATCH:
            future: asyncio.Future[list[Any]] = loop.create_future()
            self._batch.append((commands, future))
            return await future
        batch: list[_Waiter] = [(commands, None)]
        self._batch = batch
        try:
            try:
                # Every callback already due runs first: the requests finalized alongside
                # this one join the batch meanwhile.
                await _next_iteration(loop)
            finally:
                if self._batch is batch:
                    self._batch = None
            replies = await self._exchange([command for sent, _ in batch for command in sent])
        except BaseException as exc:
            for _, waiter in batch[1:]:
                if waiter is not None and not waiter.done():
                    waiter.set_exception(BatchFailed(f"the batch's sender failed: {exc!r}"))
            raise
        start = len(commands)
        for sent, waiter in batch[1:]:
            if waiter is not None and not waiter.done():
                own = replies[start : start + len(sent)]
                error = _first_error(own)
                if error is None:
                    waiter.set_result(own)
                else:
                    waiter.set_exception(error)
            start += len(sent)
        return _raised(replies[: len(commands)])

    def _from_pool(self) -> AbstractConnection:
        connection: AbstractConnection = self._pool.get_available_connection()  # type: ignore[no-untyped-call]
        return connection

    def _keep(self, connection: AbstractConnection) -> None:
        if len(self._idle) >= self.max_idle:
            self._discard([connection])
            return
        loop = asyncio.get_running_loop()
        self._idle.append((connection, loop.time()))
        if self._reaper is None:
            self._reaper = loop.call_later(self.idle_timeout, self._reap, loop)

    def _reap(self, loop: asyncio.AbstractEventLoop) -> None:
        self._reaper = None
        stale_before = loop.time() - self.idle_timeout
        stale = 0
        while stale < len(self._idle) and self._idle[stale][1] <= stale_before:
            stale += 1
        expired, self._idle = self._idle[:stale], self._idle[stale:]
        if expired:
            self._discard([connection for connection, _ in expired])
        if self._idle:
            # Due when the oldest one left runs out.
            due = self._idle[0][1] + self.idle_timeout
            self._reaper = loop.call_at(due, self._reap, loop)

    def _discard(self, connections: list[AbstractConnection]) -> None:
        # Closing needs a few awaits; the command that failed must not wait for them.
        task = asyncio.get_running_loop().create_task(self._close(connections))
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def _close(self, connections: list[AbstractConnection]) -> None:
        for connection in connections:
            with contextlib.suppress(Exception):
                await connection.disconnect(nowait=True)
            # Back to the pool unconnected: it no longer counts as in use, and holds no socket.
            with contextlib.suppress(Exception):
                await self._pool.release(connection)

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            self._reaper = None
        idle, self._idle = self._idle, []
        await self._close([connection for connection, _ in idle])
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)


async def _read_reply(connection: AbstractConnection) -> Any:
    try:
        return await connection.read_response()
    except ResponseError as error:
        # Raised by redis-py after the whole reply was parsed: nothing is left unread.
        return error


def _first_error(replies: list[Any]) -> ResponseError | None:
    return next((reply for reply in replies if isinstance(reply, ResponseError)), None)


def _raised(replies: list[Any]) -> list[Any]:
    error = _first_error(replies)
    if error is not None:
        raise error
    return replies


def _hiredis_packer() -> Callable[[tuple[Any, ...]], bytes] | None:
    """hiredis's RESP packer; the ``redis`` extra installs hiredis, but a redis-py without it
    still works, with redis-py's own packer."""
    try:
        import hiredis
    except ImportError:
        return None
    pack: Callable[[tuple[Any, ...]], bytes] = hiredis.pack_command
    return pack


_HIREDIS_PACK = _hiredis_packer()


def _pack(connection: AbstractConnection, commands: Sequence[Command]) -> bytes | list[bytes]:
    """The commands in RESP: hiredis packs in C what redis-py's asyncio connection packs in
    Python, for a sixth of the CPU (``benchmarks/RESULTS.md``, "Redis reads batched")."""
    if _HIREDIS_PACK is None:
        return connection.pack_commands(commands)
    return b"".join([_HIREDIS_PACK(tuple(command)) for command in commands])


def _next_iteration(loop: asyncio.AbstractEventLoop) -> asyncio.Future[None]:
    """Done once the callbacks due now have run (``loop.call_soon``)."""
    future: asyncio.Future[None] = loop.create_future()
    loop.call_soon(_wake, future)
    return future


def _wake(future: asyncio.Future[None]) -> None:
    if not future.done():  # the waiting caller was cancelled meanwhile
        future.set_result(None)
