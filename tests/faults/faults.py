"""Fault injectors: each one breaks one thing for a bounded time, then heals it.

Every injector targets 127.0.0.1 only (our own gateway processes, our private PostgreSQL and
Redis, our upstream), counts what it did in ``injected`` by kind, and returns once the fault
is healed. The pauses inside are the length of an outage, not a way of waiting for
something: where an injector waits for a condition (a gateway with requests in flight), it
polls with a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import asyncpg
import httpx

from tests.faults.clients import TENANTS, FaultClient, Load
from tests.faults.cluster import LEASE, Cluster, PrivatePostgres, PrivateRedis, ReplicatedPostgres
from tests.faults.upstream import FaultyUpstream, disposition
from tests.support import GatewayProcess, eventually

GATEWAY_KILL = "gateway kill -9 mid-request"
GATEWAY_STALL = "gateway SIGSTOP past the lease"
GATEWAY_STALL_BETWEEN_ATTEMPTS = "gateway SIGSTOP between attempts"
DATABASE_LINK_PAUSE = "a gateway's database link paused past the lease"
POSTGRES_RESTART = "postgresql stopped and restarted"
REDIS_RESTART = "redis kill -9 and restart"
UPSTREAM_HANG = "upstream hangs"
UPSTREAM_RESET = "upstream resets after commit"
UPSTREAM_5XX = "upstream answers 5xx"
POSTGRES_FAILOVER = "postgresql primary kill -9, standby promoted"
"""Not in ``KINDS``: it needs a ``ReplicatedPostgres`` (``tests/faults/test_failover.py``)."""

KINDS = (
    GATEWAY_KILL,
    GATEWAY_STALL,
    GATEWAY_STALL_BETWEEN_ATTEMPTS,
    DATABASE_LINK_PAUSE,
    POSTGRES_RESTART,
    REDIS_RESTART,
    UPSTREAM_HANG,
    UPSTREAM_RESET,
    UPSTREAM_5XX,
)
# The 5xx an upstream answers in turn: final (500), ambiguous (502), not processed (503).
FAULT_STATUSES = (500, 502, 503)


@dataclass
class FaultInjector:
    cluster: Cluster
    upstream: FaultyUpstream
    postgres: PrivatePostgres
    redis_server: PrivateRedis
    load: Load
    rng: random.Random
    client_deadline: float = 30.0
    injected: Counter[str] = field(default_factory=Counter)
    measured: dict[str, float] = field(default_factory=dict)
    """What an injector measured (seconds, counts), for the report."""

    def injector(self, kind: str) -> Callable[[], Awaitable[None]]:
        return {
            GATEWAY_KILL: self.kill_gateway_mid_request,
            GATEWAY_STALL: self.stall_gateway_past_lease,
            GATEWAY_STALL_BETWEEN_ATTEMPTS: self.stall_gateway_between_attempts,
            DATABASE_LINK_PAUSE: self.pause_database_link_past_lease,
            POSTGRES_RESTART: self.restart_postgres,
            REDIS_RESTART: self.restart_redis,
            UPSTREAM_HANG: lambda: self.upstream_misbehaves(UPSTREAM_HANG, "hang"),
            UPSTREAM_RESET: lambda: self.upstream_misbehaves(UPSTREAM_RESET, "reset"),
            UPSTREAM_5XX: self.upstream_answers_5xx,
            POSTGRES_FAILOVER: self.fail_over_postgres,
        }[kind]

    async def inject(self, kind: str) -> None:
        await self.injector(kind)()

    async def _busy_gateway(self) -> GatewayProcess:
        """A gateway owning a request the upstream is working on right now (polled, with a
        deadline): a crash or a stall there strikes mid-request."""

        def busy() -> GatewayProcess | None:
            candidates = [
                gateway
                for gateway in self.cluster.gateways
                if any(self.upstream.working[op.key] for op in self.load.inflight_at(gateway))
            ]
            return self.rng.choice(candidates) if candidates else None

        return await eventually(
            busy, timeout=10.0, interval=0.005, message="a gateway with a request upstream"
        )

    async def kill_gateway_mid_request(self) -> None:
        """kill -9 a gateway while it has requests in flight, then start a replacement."""
        victim = await self._busy_gateway()
        await self.cluster.kill(victim)
        self.injected[GATEWAY_KILL] += 1
        await self.cluster.replace()

    async def stall_gateway_past_lease(self) -> None:
        """SIGSTOP a gateway while the upstream works on one of its requests, for twice the
        lease, then SIGCONT (before its upstream timeout): it wakes up holding answers it no
        longer owns."""
        victim = await self._busy_gateway()
        await self._cut_off_past_lease(GATEWAY_STALL, victim, victim.pause, victim.resume)

    async def stall_gateway_between_attempts(self) -> None:
        """The upstream answers 503 (not processed, so the gateways retry after its
        Retry-After); a
        gateway with requests in that pause is SIGSTOPped past the lease. Its owners wake up
        between two attempts, after other gateways took their records over: the next attempt
        must not go out."""
        # Retry-After holds the owners in their pause long enough to be caught there.
        self.upstream.fault = "status=503,retry-after=1"
        try:
            victim = await eventually(
                self._gateway_between_attempts,
                timeout=10.0,
                interval=0.005,
                message="a gateway with a request the upstream refused, not yet finished",
            )
            victim.pause()
        finally:
            self.upstream.fault = None
        await self._cut_off_past_lease(
            GATEWAY_STALL_BETWEEN_ATTEMPTS, victim, lambda: None, victim.resume
        )

    async def pause_database_link_past_lease(self) -> None:
        """A busy gateway's link to PostgreSQL stops passing bytes (nothing closes) for twice
        the lease: its owners can neither renew nor finalize, and must send nothing more once
        their lease is no longer confirmed."""
        victim = await self._busy_gateway()
        link = self.cluster.database_link(victim)
        await self._cut_off_past_lease(DATABASE_LINK_PAUSE, victim, link.pause, link.resume)

    def _gateway_between_attempts(self) -> GatewayProcess | None:
        """A gateway with a request in flight that the upstream already refused with a 503
        and is not working on now: it is pausing before its next attempt."""
        refused = {
            execution.idempotency_key
            for execution in self.upstream.executions
            if disposition(execution) == "refused"
        }
        candidates = [
            gateway
            for gateway in self.cluster.gateways
            if any(
                op.key in refused and not self.upstream.working[op.key]
                for op in self.load.inflight_at(gateway)
            )
        ]
        return self.rng.choice(candidates) if candidates else None

    async def _cut_off_past_lease(
        self,
        kind: str,
        victim: GatewayProcess,
        cut_off: Callable[[], None],
        reconnect: Callable[[], None],
    ) -> None:
        """Cut ``victim`` off for twice the lease, then reconnect it.

        Meanwhile a second instance of each of its clients (a "twin", as when a job runner
        retries the same business operation elsewhere) sends the same operations through
        the other gateways, so the cut-off owners' records are really taken over.
        """
        stalled = self.load.inflight_at(victim)
        cut_off()
        self.injected[kind] += 1
        twin = FaultClient(f"twin-of-{victim.name}", stalled)
        others = [gateway for gateway in self.cluster.gateways if gateway is not victim]
        task = asyncio.create_task(
            twin.run(
                lambda: others,
                self.load,
                deadline=self.client_deadline,
                resend_chance=0.0,
                rng=random.Random(self.rng.random()),
                finish_all=True,
            )
        )
        self.load.extra_clients.append((twin, task))
        try:
            await asyncio.sleep(LEASE * 2)  # the outage itself
        finally:
            reconnect()

    async def restart_postgres(self, down_for: float = 1.5) -> None:
        await self.postgres.stop()
        self.injected[POSTGRES_RESTART] += 1
        try:
            await asyncio.sleep(down_for)  # the outage itself
        finally:
            await self.postgres.start()

    async def fail_over_postgres(self, lag_for: float = 2.0) -> None:
        """The standby falls behind, the primary dies with SIGKILL, the standby is promoted.

        The replication link is cut first, until the primary holds a finished record the
        standby cannot have: asynchronous replication acknowledges such commits (so the cut
        lasts until one exists), synchronous replication makes them wait for the standby (so
        the cut lasts ``lag_for`` seconds at most, and they die unacknowledged with the
        primary). Measured: how long the
        promotion took, and when each gateway executed a new key again after the kill.
        """
        postgres = self.postgres
        if not isinstance(postgres, ReplicatedPostgres):
            raise TypeError(f"{POSTGRES_FAILOVER} needs a ReplicatedPostgres")
        primary = await asyncpg.connect(postgres.primary_dsn)
        try:
            await postgres.link.cut()
            # Whatever a statement that starts after this wrote cannot be on the standby.
            cut_at = await primary.fetchval("SELECT now()")

            async def finished_on_primary_alone() -> int:
                return int(
                    await primary.fetchval(
                        "SELECT count(*) FROM idempotency_records "
                        "WHERE status <> 'IN_PROGRESS' AND updated_at > $1",
                        cut_at,
                    )
                )

            if postgres.synchronous:
                # Such commits wait for the standby: none may show up, so wait a bounded time.
                with contextlib.suppress(AssertionError):
                    await eventually(finished_on_primary_alone, timeout=lag_for, interval=0.01)
            else:
                # Acknowledged at once: wait until one exists, however slow the machine, so
                # the failover really has something to lose.
                await eventually(
                    finished_on_primary_alone,
                    timeout=30.0,
                    interval=0.01,
                    message="a record finished on the asynchronous primary alone",
                )
            self.measured[
                "records finished on the primary alone"
            ] = await finished_on_primary_alone()
        finally:
            await primary.close()
        killed = time.monotonic()
        await postgres.kill()
        self.injected[POSTGRES_FAILOVER] += 1
        await postgres.standby.promote()
        self.measured["promotion took (s)"] = time.monotonic() - killed
        recovered = await asyncio.gather(
            *(self._first_new_key(gateway, since=killed) for gateway in self.cluster.gateways)
        )
        self.measured["gateways execute new keys again after the kill (s)"] = max(recovered)

    async def _first_new_key(self, gateway: GatewayProcess, *, since: float) -> float:
        """Seconds from ``since`` until ``gateway`` executed a new key (polled)."""
        key = f"probe-{uuid.uuid4().hex}"
        async with httpx.AsyncClient(base_url=gateway.url, timeout=5.0, trust_env=False) as http:

            async def executed() -> float | None:
                try:
                    answer = await http.post(
                        "/v1/charges",
                        json={"amount": 1, "currency": "usd", "reference": key},
                        headers={"Authorization": TENANTS[0], "Idempotency-Key": key},
                    )
                except httpx.TransportError:
                    return None
                return time.monotonic() - since if answer.status_code == 201 else None

            return await eventually(
                executed, timeout=30.0, interval=0.02, message=f"{gateway.name} recovers"
            )

    async def restart_redis(self, down_for: float = 1.0) -> None:
        await self.redis_server.kill()
        self.injected[REDIS_RESTART] += 1
        try:
            await asyncio.sleep(down_for)  # the outage itself
        finally:
            await self.redis_server.start()

    async def upstream_misbehaves(self, kind: str, behavior: str, lasting: float = 1.0) -> None:
        self.upstream.fault = behavior
        self.injected[kind] += 1
        try:
            await asyncio.sleep(lasting)  # the outage itself
        finally:
            self.upstream.fault = None

    async def upstream_answers_5xx(self, lasting: float = 1.5) -> None:
        """A final 500, an ambiguous 502 and a not-processed 503, a third of the time each."""
        self.injected[UPSTREAM_5XX] += 1
        try:
            for status in self.rng.sample(FAULT_STATUSES, len(FAULT_STATUSES)):
                self.upstream.fault = f"status={status}"
                await asyncio.sleep(lasting / len(FAULT_STATUSES))  # the outage itself
        finally:
            self.upstream.fault = None
