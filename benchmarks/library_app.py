"""Library mode: one small FastAPI endpoint, bare or behind an idempotency middleware.

    BENCH_LIBRARY=gateway BENCH_DATABASE_URL=postgresql://... \
        uvicorn benchmarks.library_app:api --loop uvloop --http httptools --workers 1

``BENCH_LIBRARY`` picks the middleware:

- ``plain``: no middleware (the ceiling for this endpoint);
- ``gateway``: ``idempotency_gateway.idempotency.IdempotencyMiddleware``, durable on PostgreSQL
  (``open_store(BENCH_DATABASE_URL)``), default policy (POST and PATCH, key optional);
- ``header-memory``: ``asgi-idempotency-header`` with its ``MemoryBackend`` (a dict in the
  process: nothing durable, nothing shared between processes);
- ``header-redis``: ``asgi-idempotency-header`` with its ``RedisBackend`` on ``BENCH_REDIS_URL``.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI

MODES = ("plain", "gateway", "header-memory", "header-redis")


def create_api(mode: str) -> FastAPI:
    closers: list[Callable[[], Awaitable[object]]] = []

    @asynccontextmanager
    async def lifespan(_api: FastAPI) -> AsyncIterator[None]:
        yield
        for closer in closers:
            await closer()

    api = FastAPI(lifespan=lifespan)

    @api.post("/small")
    async def create_thing() -> dict[str, bool]:
        return {"ok": True}

    if mode == "gateway":
        from idempotency_gateway.config import IdempotencyConfig, StoreConfig
        from idempotency_gateway.idempotency import IdempotencyMiddleware
        from idempotency_gateway.storage import open_store

        store = open_store(os.environ["BENCH_DATABASE_URL"], StoreConfig())
        closers.append(store.close)
        api.add_middleware(
            IdempotencyMiddleware,
            store=store,
            policy=IdempotencyConfig(),
            # Any fixed secret: the benchmark measures the HMAC, not the secret's handling.
            scope_secret="benchmark-scope-secret",
        )
    elif mode in ("header-memory", "header-redis"):
        from idempotency_header_middleware import IdempotencyHeaderMiddleware
        from idempotency_header_middleware.backends import MemoryBackend, RedisBackend

        if mode == "header-memory":
            backend: MemoryBackend | RedisBackend = MemoryBackend()
        else:
            from redis.asyncio import Redis

            client = Redis.from_url(os.environ["BENCH_REDIS_URL"])
            closers.append(client.aclose)
            backend = RedisBackend(client)
        api.add_middleware(IdempotencyHeaderMiddleware, backend=backend)  # type: ignore[arg-type]
    elif mode != "plain":
        raise SystemExit(f"BENCH_LIBRARY must be one of {', '.join(MODES)}, not {mode!r}")
    return api


api = create_api(os.environ.get("BENCH_LIBRARY", "plain"))
