"""What the admin endpoints act on, handed to each as a FastAPI dependency."""

# No ``from __future__ import annotations`` in this package: FastAPI reads the endpoint
# annotations at definition time.
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request
from pydantic import SecretStr

from idempotency_gateway.drain import DrainState
from idempotency_gateway.operations.breaker_overrides import BreakerOverrides
from idempotency_gateway.operations.cache_invalidations import CacheInvalidations
from idempotency_gateway.replay.cache import ReplayCache
from idempotency_gateway.resilience.breaker import CircuitBreaker
from idempotency_gateway.storage.base import RecordStore


@dataclass(frozen=True, slots=True)
class AdminContext:
    store: RecordStore
    cache: ReplayCache
    breakers: Mapping[str, CircuitBreaker]
    overrides: BreakerOverrides
    scope_headers: tuple[bytes, ...]
    scope_secret: bytes
    admin_token: SecretStr | None
    drain: DrainState
    # Set when the replay cache is per process: deletes must reach every worker's copy.
    invalidations: CacheInvalidations | None = None


def admin_context(request: Request) -> AdminContext:
    context = request.app.state.admin_context
    assert isinstance(context, AdminContext)
    return context


Context = Annotated[AdminContext, Depends(admin_context)]
