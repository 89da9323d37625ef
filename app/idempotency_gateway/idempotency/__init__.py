"""Durable idempotency: keys, fingerprints, the record state machine, its stores."""

from idempotency_gateway.idempotency.middleware import IdempotencyMiddleware
from idempotency_gateway.idempotency.policy import RoutePolicy

__all__ = ["IdempotencyMiddleware", "RoutePolicy"]
