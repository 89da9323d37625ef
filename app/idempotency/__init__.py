"""Durable idempotency: keys, fingerprints, the record state machine, its stores."""

from app.idempotency.middleware import IdempotencyMiddleware
from app.idempotency.policy import RoutePolicy

__all__ = ["IdempotencyMiddleware", "RoutePolicy"]
