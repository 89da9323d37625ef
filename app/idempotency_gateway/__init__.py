"""idempotency-gateway as a library: the middleware, its store and caches, their settings.

    from idempotency_gateway import IdempotencyMiddleware, IdempotencyConfig, open_store

Names are imported on first use (PEP 562): ``import idempotency_gateway`` stays cheap, the
CLI can prepare multiprocess metrics before prometheus_client loads, and each name needs only
the extra of what it uses: ``RedisCache`` and ``connect_redis`` ``[redis]``, the client
helper's httpx ``[client]``.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING

from idempotency_gateway.lazy import lazy_exports

if TYPE_CHECKING:
    from idempotency_gateway.client import IdempotentClient, idempotency_key
    from idempotency_gateway.config import (
        AnonymousPolicy,
        CacheConfig,
        IdempotencyConfig,
        KeyPolicy,
        OnAmbiguous,
        OutcomeConfig,
        StoreConfig,
        StreamingConfig,
        SweeperConfig,
    )
    from idempotency_gateway.errors import GatewayError
    from idempotency_gateway.execution import Execution, Outcome
    from idempotency_gateway.extras import MissingExtra
    from idempotency_gateway.idempotency.endpoints import idempotent
    from idempotency_gateway.idempotency.middleware import IdempotencyMiddleware
    from idempotency_gateway.migrate import upgrade_to_head
    from idempotency_gateway.operations.lifespan import idempotency_lifespan
    from idempotency_gateway.replay.cache import InProcessCache
    from idempotency_gateway.replay.live_streams_for import live_streams_for
    from idempotency_gateway.replay.redis_cache import RedisCache
    from idempotency_gateway.replay.redis_connect import connect_redis
    from idempotency_gateway.storage.backends import open_store
    from idempotency_gateway.storage.base import RecordStore

try:
    __version__ = version("idempotency-gateway")
except PackageNotFoundError:  # a source tree that was never installed
    __version__ = "0+unknown"

_HOMES = {
    "IdempotencyMiddleware": "idempotency_gateway.idempotency.middleware",
    "RecordStore": "idempotency_gateway.storage.base",
    "open_store": "idempotency_gateway.storage.backends",
    "InProcessCache": "idempotency_gateway.replay.cache",
    "RedisCache": "idempotency_gateway.replay.redis_cache",
    "connect_redis": "idempotency_gateway.replay.redis_connect",
    "live_streams_for": "idempotency_gateway.replay.live_streams_for",
    "AnonymousPolicy": "idempotency_gateway.config",
    "CacheConfig": "idempotency_gateway.config",
    "IdempotencyConfig": "idempotency_gateway.config",
    "KeyPolicy": "idempotency_gateway.config",
    "OnAmbiguous": "idempotency_gateway.config",
    "OutcomeConfig": "idempotency_gateway.config",
    "StoreConfig": "idempotency_gateway.config",
    "StreamingConfig": "idempotency_gateway.config",
    "GatewayError": "idempotency_gateway.errors",
    "Execution": "idempotency_gateway.execution",
    "Outcome": "idempotency_gateway.execution",
    "MissingExtra": "idempotency_gateway.extras",
    "SweeperConfig": "idempotency_gateway.config",
    "idempotent": "idempotency_gateway.idempotency.endpoints",
    "idempotency_lifespan": "idempotency_gateway.operations.lifespan",
    "upgrade_to_head": "idempotency_gateway.migrate",
    "IdempotentClient": "idempotency_gateway.client",
    "idempotency_key": "idempotency_gateway.client",
}

__all__ = [
    "AnonymousPolicy",
    "CacheConfig",
    "Execution",
    "GatewayError",
    "IdempotencyConfig",
    "IdempotencyMiddleware",
    "IdempotentClient",
    "InProcessCache",
    "KeyPolicy",
    "MissingExtra",
    "OnAmbiguous",
    "Outcome",
    "OutcomeConfig",
    "RecordStore",
    "RedisCache",
    "StoreConfig",
    "StreamingConfig",
    "SweeperConfig",
    "__version__",
    "connect_redis",
    "idempotency_key",
    "idempotency_lifespan",
    "idempotent",
    "live_streams_for",
    "open_store",
    "upgrade_to_head",
]


__getattr__, __dir__ = lazy_exports(__name__, _HOMES)
