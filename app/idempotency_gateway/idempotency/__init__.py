"""The idempotency domain: keys, fingerprints, the record state machine, leases and the engine.

Exports are imported on first use (``idempotency_gateway.lazy``): a small module of the
domain (``keys``, ``fingerprint``) loads without the middleware and its drivers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from idempotency_gateway.lazy import lazy_exports

if TYPE_CHECKING:
    from idempotency_gateway.idempotency.middleware import IdempotencyMiddleware
    from idempotency_gateway.idempotency.policy import RoutePolicy

__all__ = ["IdempotencyMiddleware", "RoutePolicy"]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "IdempotencyMiddleware": "idempotency_gateway.idempotency.middleware",
        "RoutePolicy": "idempotency_gateway.idempotency.policy",
    },
)
