"""The middleware's resources opened and closed with the app, the sweeper running between.

    store = open_store(DATABASE_URL, StoreConfig())
    api = FastAPI(lifespan=idempotency_lifespan(store))
    api.add_middleware(IdempotencyMiddleware, store=store, ...)

An app with a lifespan of its own enters this one inside it:
``async with idempotency_lifespan(store)(app): yield``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager

from idempotency_gateway.config import SweeperConfig
from idempotency_gateway.operations.sweeper import Sweeper
from idempotency_gateway.replay.cache import ReplayCache
from idempotency_gateway.replay.wakeups import Wakeups
from idempotency_gateway.storage.base import RecordStore

Lifespan = Callable[[object], AbstractAsyncContextManager[None]]


def idempotency_lifespan(
    store: RecordStore,
    *,
    cache: ReplayCache | None = None,
    wakeups: Wakeups | None = None,
    sweeper: SweeperConfig | None = None,
) -> Lifespan:
    """A lifespan (FastAPI's and Starlette's ``lifespan=``) that starts ``store`` (opens what
    its request path needs), runs the sweeper, which deletes expired
    records every ``sweeper.interval`` (``SweeperConfig(interval=0)``: never; on PostgreSQL
    one process of a fleet sweeps at a time), and at shutdown stops it and closes ``wakeups``,
    ``cache`` and ``store``, the ones the middleware was given."""
    settings = sweeper if sweeper is not None else SweeperConfig()

    @contextlib.asynccontextmanager
    async def lifespan(_app: object) -> AsyncIterator[None]:
        await store.start()
        sweeping = (
            asyncio.create_task(Sweeper(store, settings).run()) if settings.interval > 0 else None
        )
        try:
            yield
        finally:
            if sweeping is not None:
                sweeping.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await sweeping
            for resource in (wakeups, cache):
                if resource is not None:
                    await resource.close()
            await store.close()

    return lifespan
