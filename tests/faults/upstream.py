"""The fault run's upstream: a ``RecordingUpstream`` with processing time, faults the injector
switches on and off, and the fencing check the README asks of an upstream.

- **Processing time**: every request takes a little while (``latency``), so a crash or a stall
  of a gateway finds requests in flight at the upstream.
- **Faults**: while ``fault`` is set (an ``X-Test-Behavior`` value such as ``hang``, ``reset``
  or ``status=503``) every request without a behaviour of its own gets it. ``reset`` records the
  execution and then resets the connection: the work was committed, the answer is lost.
- **Fencing**: a request whose ``Idempotency-Fencing-Token`` is lower than one this upstream
  already saw for the same key comes from an owner that was fenced off; it is recorded (with
  the behaviour item ``stale``) and refused with 409, never executed. That is the contract the
  README gives upstreams behind ``on_ambiguous: retry``.

``disposition(execution)`` says what the upstream did with a request: ``committed`` (it may
have acted: answered, reset after commit, hung) or ``refused`` (it said "not processed" with a
not-executed status, or refused a stale token).
"""

from __future__ import annotations

import asyncio
import random
from collections import Counter

from aiohttp import web
from multidict import CIMultiDict

from tests.support.upstream import (
    BEHAVIOR_HEADER,
    FENCING_HEADER,
    KEY_HEADER,
    Execution,
    RecordingUpstream,
)

STALE = "stale"
# The statuses the gateway's default ``outcomes.not_executed`` treats as "not processed".
NOT_PROCESSED = frozenset({408, 425, 429, 503})


class FaultyUpstream(RecordingUpstream):
    def __init__(self, *, latency: tuple[float, float] = (0.01, 0.06), seed: int = 0) -> None:
        super().__init__()
        self.fault: str | None = None
        self.latency = latency
        self._random = random.Random(seed)
        self._highest_token: dict[tuple[str, str], int] = {}
        self.working: Counter[str] = Counter()
        """Idempotency keys of the requests being worked on right now."""

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        key = request.headers.get(KEY_HEADER, "")
        self.working[key] += 1
        try:
            return await self._work(request)
        finally:
            self.working[key] -= 1

    async def _work(self, request: web.Request) -> web.StreamResponse:
        # Processing time before the work is committed: requests stay in flight for a while.
        await asyncio.sleep(self._random.uniform(*self.latency))
        if self.fault is not None and BEHAVIOR_HEADER not in request.headers:
            headers = CIMultiDict(request.headers)
            headers[BEHAVIOR_HEADER] = self.fault
            request = request.clone(headers=headers)  # before the body is read: aiohttp's rule
        body = await request.read()
        key = request.headers.get(KEY_HEADER)
        token = _int_or_none(request.headers.get(FENCING_HEADER))
        if key is not None and token is not None:
            tenant_key = (request.headers.get("Authorization", ""), key)
            highest = self._highest_token.get(tenant_key, 0)
            if token < highest:
                execution = self._record(request, body, {STALE: str(highest)})
                return web.json_response(
                    {"error": "stale fencing token", "token": token, "highest": highest},
                    status=409,
                    headers={"X-Upstream-Execution": str(execution.number)},
                )
            self._highest_token[tenant_key] = token
        # The body is read already, so nothing in here awaits before the execution is
        # recorded: the ledger's order is the order in which tokens were accepted.
        return await super()._answer(request)


def disposition(execution: Execution) -> str:
    """``refused`` when the upstream said it did nothing, else ``committed``."""
    if STALE in execution.behavior:
        return "refused"
    status = _int_or_none(execution.behavior.get("status"))
    if status is not None and status in NOT_PROCESSED:
        return "refused"
    return "committed"


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None
