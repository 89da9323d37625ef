"""The idempotency domain: keys, fingerprints, the record state machine, leases and the engine."""

from idempotency_gateway.idempotency.middleware import IdempotencyMiddleware
from idempotency_gateway.idempotency.policy import RoutePolicy

__all__ = ["IdempotencyMiddleware", "RoutePolicy"]
