"""A Python client for APIs behind the gateway: stable keys and safe retries (httpx).

    async with IdempotentClient("https://payments.internal") as client:
        key = idempotency_key("charge", order.id)      # the same key on every retry
        response = await client.post("/v1/charges", key=key, json={"amount": 1000})

The key comes from business ids, never from the time or the attempt number: a retry with a new
key is a new charge. Retries use the gateway's own full-jitter math, honour ``Retry-After``,
stop at an overall deadline, and stop at once on answers a retry cannot change (400, 422, any
replayed answer). A replay is recognized by its marker under either name a gateway may be
configured with (``replay_header``): Stripe's ``Idempotent-Replayed``, the default, or the IETF
draft's ``Idempotency-Replayed``.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Self

try:
    import httpx
except ModuleNotFoundError as missing:  # pragma: no cover - depends on the install
    raise ImportError(
        "the client helper needs httpx: pip install 'idempotency-gateway[client]'"
    ) from missing

from idempotency_gateway.clock import Monotonic, monotonic
from idempotency_gateway.config import DEFAULT_REPLAY_HEADER
from idempotency_gateway.resilience.backoff import parse_retry_after, pause_before_retry

IDEMPOTENCY_KEY_HEADER = "Idempotency-Key"
IETF_REPLAY_HEADER = "Idempotency-Replayed"
# Both names a gateway may mark a replay with: a client need not know which one it is set to.
REPLAY_HEADERS = (DEFAULT_REPLAY_HEADER, IETF_REPLAY_HEADER)
# 409: the first request with the key is still running; 429/5xx: not processed or not yet.
RETRY_STATUSES = frozenset({409, 425, 429, 500, 502, 503, 504})
_UNSAFE_WITHOUT_KEY = frozenset({"POST", "PATCH"})


def idempotency_key(*business_ids: str | int, namespace: str = "") -> str:
    """A stable key from the ids that make an operation unique (order id, invoice id, ...)."""
    if not business_ids:
        raise ValueError("derive the key from at least one business id")
    digest = hashlib.sha256()
    # Length-prefixed, namespace included, so no two different inputs hash alike.
    for part in (namespace, *business_ids):
        encoded = str(part).encode()
        digest.update(len(encoded).to_bytes(4, "big") + encoded)
    return digest.hexdigest()


class IdempotentClient:
    """httpx with stable keys and safe retries.

    ``replay_header``: the field that marks a replayed answer. ``None`` (the default)
    recognizes both names a gateway may be configured with, Stripe's ``Idempotent-Replayed``
    (the gateway's default) and the IETF draft's ``Idempotency-Replayed``. Name one to
    recognize it alone: the gateway drops an upstream's marker only under its own configured
    name, so an upstream that sends the other name itself would otherwise make its fresh
    answers look replayed (and final).
    """

    def __init__(
        self,
        base_url: str = "",
        *,
        http: httpx.AsyncClient | None = None,
        max_attempts: int = 5,
        base: float = 0.1,
        cap: float = 5.0,
        deadline: float = 30.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        clock: Monotonic = monotonic,
        uniform: Callable[[float, float], float] = random.uniform,
        replay_header: str | None = None,
    ) -> None:
        self.http = http or httpx.AsyncClient(base_url=base_url)
        self.replay_headers = REPLAY_HEADERS if replay_header is None else (replay_header,)
        self.max_attempts = max_attempts
        self.base = base
        self.cap = cap
        self.deadline = deadline
        self._sleep = sleep
        self._clock = clock
        self._uniform = uniform

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.http.aclose()

    async def post(self, url: str, *, key: str, **kwargs: Any) -> httpx.Response:
        return await self.request("POST", url, key=key, **kwargs)

    async def request(
        self, method: str, url: str, *, key: str | None = None, **kwargs: Any
    ) -> httpx.Response:
        """Send, retrying what is safe to retry; the last answer or error comes back."""
        headers = dict(kwargs.pop("headers", None) or {})
        if key is not None:
            headers[IDEMPOTENCY_KEY_HEADER] = key
        # Without a key a sent POST may have executed: only "never sent" is safe to retry.
        only_unsent = key is None and method.upper() in _UNSAFE_WITHOUT_KEY
        ends_at = self._clock() + self.deadline
        attempt = 0
        while True:
            attempt += 1
            try:
                response = await self.http.request(method, url, headers=headers, **kwargs)
            except httpx.TransportError as error:
                never_sent = isinstance(error, httpx.ConnectError | httpx.ConnectTimeout)
                if only_unsent and not never_sent:
                    raise
                if not await self._pause(attempt, None, ends_at):
                    raise
                continue
            # A replayed answer is the stored outcome: every retry would get it again.
            replayed = any(response.headers.get(name) == "true" for name in self.replay_headers)
            if response.status_code not in RETRY_STATUSES or only_unsent or replayed:
                return response
            retry_after = parse_retry_after(response.headers.get("retry-after"))
            if not await self._pause(attempt, retry_after, ends_at):
                return response

    async def _pause(self, attempt: int, retry_after: float | None, ends_at: float) -> bool:
        if attempt >= self.max_attempts:
            return False
        delay = pause_before_retry(
            attempt, retry_after=retry_after, base=self.base, cap=self.cap, uniform=self._uniform
        )
        if self._clock() + delay >= ends_at:
            return False
        await self._sleep(delay)
        return True
