"""Clients that retry like real SDKs, and remember every answer they saw.

Each client is ``idempotency_gateway.client.IdempotentClient`` (the same key on every
attempt; 409, 425, 429, 5xx and connection errors retried with full jitter, ``Retry-After``
honoured; a replayed answer or a non-retryable status ends the operation) over an httpx
transport that plays
load balancer, picking a live gateway of the cluster for every attempt, and writes every
answer or error into the client's log. A client works through its own list of business
operations; some operations belong to two clients at once (the same key sent concurrently
from two places), and now and then a client sends a finished operation again.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import httpx

from idempotency_gateway.client import RETRY_STATUSES, IdempotentClient
from tests.faults.cluster import ROUTES
from tests.support import GatewayProcess

TENANTS = ("Bearer sk_test_fault_tenant_a", "Bearer sk_test_fault_tenant_b")
REPLAYED = "idempotent-replayed"
# What a client remembers of an answer's headers.
_KEPT_HEADERS = ("content-type", REPLAYED, "x-upstream-execution", "retry-after")


@dataclass(frozen=True, slots=True)
class Operation:
    """One business operation: the key is derived from it once and reused on every retry."""

    key: str
    path: str
    tenant: str
    amount: int

    @property
    def on_ambiguous(self) -> str:
        return ROUTES[self.path]

    @property
    def body(self) -> dict[str, object]:
        return {"amount": self.amount, "currency": "usd", "reference": self.key}


@dataclass(frozen=True, slots=True)
class Attempt:
    """One HTTP exchange as a client saw it: an answer, or the error instead of one."""

    client: str
    key: str
    gateway: str
    status: int | None
    body: bytes
    headers: dict[str, str]
    error: str | None
    elapsed: float

    @property
    def replayed(self) -> bool:
        return self.headers.get(REPLAYED) == "true"

    @property
    def final(self) -> bool:
        """An answer no retry can change, by the client helper's own rules."""
        return self.status is not None and (self.status not in RETRY_STATUSES or self.replayed)


@dataclass(slots=True)
class Send:
    """One operation sent by one client until it got a final answer or gave up."""

    client: str
    operation: Operation
    final: Attempt | None = None
    gave_up: str | None = None
    """Why there is no final answer (the deadline passed on an error or a retryable status)."""


@dataclass(slots=True)
class Load:
    """Shared by the clients and the scenario: when to stop, and how far everybody got."""

    stop: asyncio.Event = field(default_factory=asyncio.Event)
    finished: int = 0
    inflight: dict[int, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    """Gateway port -> keys of the requests in flight to it right now (client side)."""
    operations: dict[str, Operation] = field(default_factory=dict)
    """Every operation some client has started sending, by key."""
    extra_clients: list[tuple[FaultClient, asyncio.Task[None]]] = field(default_factory=list)
    """Clients a fault injector started (they count like every other client)."""

    def inflight_at(self, gateway: GatewayProcess) -> list[Operation]:
        return [self.operations[key] for key, count in self.inflight[gateway.port].items() if count]


class BalancingTransport(httpx.AsyncBaseTransport):
    """A load balancer in the client: every attempt goes to a gateway picked at random from
    the cluster's current list, and every answer or error lands in ``attempts``."""

    def __init__(
        self,
        name: str,
        gateways: Callable[[], Sequence[GatewayProcess]],
        attempts: list[Attempt],
        load: Load,
        rng: random.Random,
    ) -> None:
        self.name = name
        self._gateways = gateways
        self._attempts = attempts
        self._load = load
        self._random = rng
        self._inner = httpx.AsyncHTTPTransport(retries=0)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        gateway = self._random.choice(list(self._gateways()))
        request.url = request.url.copy_with(host=gateway.host, port=gateway.port)
        key = request.headers.get("idempotency-key", "")
        started = time.monotonic()
        self._load.inflight[gateway.port][key] += 1
        try:
            response = await self._inner.handle_async_request(request)
            body = await response.aread()
        except httpx.TransportError as error:
            self._note(key, gateway, None, b"", {}, type(error).__name__, started)
            raise
        finally:
            self._load.inflight[gateway.port][key] -= 1
        kept = {name: response.headers[name] for name in _KEPT_HEADERS if name in response.headers}
        self._note(key, gateway, response.status_code, body, kept, None, started)
        return httpx.Response(
            response.status_code,
            headers=response.headers,
            content=body,
            request=request,
            extensions=response.extensions,
        )

    def _note(
        self,
        key: str,
        gateway: GatewayProcess,
        status: int | None,
        body: bytes,
        headers: dict[str, str],
        error: str | None,
        started: float,
    ) -> None:
        self._attempts.append(
            Attempt(
                self.name,
                key,
                gateway.name,
                status,
                body,
                headers,
                error,
                time.monotonic() - started,
            )
        )

    async def aclose(self) -> None:
        await self._inner.aclose()


@dataclass(slots=True)
class FaultClient:
    """One SDK-like client with its own operations."""

    name: str
    operations: list[Operation]
    attempts: list[Attempt] = field(default_factory=list)
    sends: list[Send] = field(default_factory=list)

    async def run(
        self,
        gateways: Callable[[], Sequence[GatewayProcess]],
        load: Load,
        *,
        deadline: float,
        resend_chance: float,
        rng: random.Random,
        finish_all: bool = False,
    ) -> None:
        """Send each operation until a final answer (or ``deadline`` seconds); stop taking
        new operations once ``load.stop`` is set, unless ``finish_all``."""
        transport = BalancingTransport(self.name, gateways, self.attempts, load, rng)
        http = httpx.AsyncClient(
            transport=transport,
            base_url="http://gateway.invalid",
            # Longer than the gateway's own upstream deadline (5 s): a slow answer is waited
            # for, a gateway that stalls for longer is not.
            timeout=httpx.Timeout(7.0, connect=1.0),
            trust_env=False,
        )
        async with IdempotentClient(
            http=http, max_attempts=10_000, base=0.05, cap=1.0, deadline=deadline
        ) as client:
            done: list[Operation] = []
            for operation in self.operations:
                if load.stop.is_set() and not finish_all:
                    return
                await self._send(client, operation, load)
                done.append(operation)
                load.finished += 1
                if rng.random() < resend_chance:
                    # A duplicate of something finished: must be the same answer, replayed.
                    await self._send(client, rng.choice(done), load)

    async def _send(self, client: IdempotentClient, operation: Operation, load: Load) -> None:
        send = Send(self.name, operation)
        self.sends.append(send)
        load.operations[operation.key] = operation
        seen = len(self.attempts)
        try:
            await client.post(
                operation.path,
                key=operation.key,
                json=operation.body,
                headers={"Authorization": operation.tenant},
            )
        except httpx.TransportError as error:
            send.gave_up = f"deadline passed after {type(error).__name__}"
            return
        mine = [attempt for attempt in self.attempts[seen:] if attempt.key == operation.key]
        last = mine[-1]
        if last.final:
            send.final = last
        else:
            send.gave_up = f"deadline passed after status {last.status}"


def make_clients(
    count: int,
    operations_per_client: int,
    *,
    shared_share: float,
    rng: random.Random,
    prefix: str,
) -> list[FaultClient]:
    """``count`` clients; each operation belongs to one client, or (``shared_share`` of them)
    to two, who then send it at about the same point of their lists."""
    clients = [FaultClient(f"client-{index + 1}", []) for index in range(count)]
    total = count * operations_per_client
    for number in range(total):
        operation = Operation(
            key=f"{prefix}-{number}-{uuid.uuid4().hex[:8]}",
            path=rng.choice(tuple(ROUTES)),
            tenant=rng.choice(TENANTS),
            amount=rng.randint(1, 10_000),
        )
        owners = rng.sample(clients, 2) if rng.random() < shared_share else [rng.choice(clients)]
        for owner in owners:
            owner.operations.append(operation)
    return clients
