"""``create_gateway``: the ASGI app of the gateway, assembled from a config.

    proxy port:  AccessLogMiddleware (request id, log line, metrics)
                   -> RouteRequests (canonical target and its route, once)
                   -> BulkheadMiddleware (route tier and upstream slots once the body is
                      whole, or a 503)
                   -> IdempotencyMiddleware -> ProxyApp -> upstreams
    admin port:  the admin FastAPI app (health, readiness, metrics, operator API)

One ASGI app serves both listeners and tells them apart by the local port of the connection,
so ``--workers N`` runs both in every worker with one lifespan. The same
``IdempotencyMiddleware`` is what a library user wraps around their own app.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import SecretStr

from idempotency_gateway.asgi import Receive, Scope, Send
from idempotency_gateway.clock import utc_now
from idempotency_gateway.config import (
    CacheConfig,
    GatewayConfig,
    check_admin_token,
    database_url_or_default,
    environment_settings,
    load_config,
    validate_config,
)
from idempotency_gateway.database_url import backend_of
from idempotency_gateway.drain import DrainState
from idempotency_gateway.idempotency.middleware import IdempotencyMiddleware
from idempotency_gateway.idempotency.policy import RoutePolicies
from idempotency_gateway.idempotency.scope_secret import resolve_scope_secret
from idempotency_gateway.migrate import upgrade_to_head_async
from idempotency_gateway.operations.admin import AdminContext, create_admin_app
from idempotency_gateway.operations.breaker_overrides import BreakerOverrides
from idempotency_gateway.operations.cache_invalidations import CacheInvalidations
from idempotency_gateway.operations.stuck_records import StuckRecordsSampler
from idempotency_gateway.operations.sweeper import Sweeper
from idempotency_gateway.proxy.app import ProxyApp
from idempotency_gateway.proxy.resilient import ResilientUpstream
from idempotency_gateway.proxy.upstream_client import UpstreamClient
from idempotency_gateway.replay.cache import InProcessCache, ReplayCache
from idempotency_gateway.replay.live_streams_for import live_streams_for
from idempotency_gateway.replay.redis_cache import RedisCache
from idempotency_gateway.replay.redis_connect import connect_redis
from idempotency_gateway.replay.tiered_cache import TieredCache
from idempotency_gateway.replay.wakeups import LocalWakeups, Wakeups
from idempotency_gateway.resilience.breaker import BreakerState
from idempotency_gateway.resilience.bulkhead import publish_every
from idempotency_gateway.resilience.bulkheads import BulkheadMiddleware, route_bulkheads
from idempotency_gateway.routing import RouteRequests, check_routes
from idempotency_gateway.server.heap import settle_after_startup
from idempotency_gateway.storage.backends import open_store
from idempotency_gateway.telemetry import tracing
from idempotency_gateway.telemetry.iteration_metrics import write_pending
from idempotency_gateway.telemetry.loop_lag import LoopLagMonitor
from idempotency_gateway.telemetry.metrics import (
    BREAKER_STATE,
    BREAKER_STATE_VALUES,
    BREAKER_TRANSITIONS,
)
from idempotency_gateway.telemetry.request_log import AccessLogMiddleware

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor

log = logging.getLogger(__name__)

# The CLI hands its resolved config to worker processes through this variable.
RESOLVED_CONFIG_ENV = "GATEWAY_RESOLVED_CONFIG"
# How long shutdown waits for in-flight executions to finish and finalize.
DRAIN_TIMEOUT = 30.0


def replay_layer(config: CacheConfig, redis_url: str | None) -> tuple[ReplayCache, Wakeups]:
    """Redis when configured (shared by every gateway process), else in-process."""
    if redis_url is None:
        return InProcessCache.sized_by(config), LocalWakeups()
    # One adapter for both: the cache closes it, after the gateway closed the wake-ups.
    redis = connect_redis(redis_url, timeout=config.timeout, connect_timeout=config.timeout)
    shared = RedisCache(redis, timeout=config.timeout, max_entry_bytes=config.max_entry_size)
    # ``max_entries: 0`` keeps no copies in this process: every replay asks Redis.
    cache: ReplayCache = (
        TieredCache(InProcessCache.sized_by(config), shared) if config.max_entries else shared
    )
    return cache, redis.wakeups(timeout=config.timeout)


def _record_breaker_transition(upstream: str, old: BreakerState, new: BreakerState) -> None:
    log.warning("breaker for upstream %s: %s -> %s", upstream, old.value, new.value)
    BREAKER_TRANSITIONS.labels(upstream, old.value, new.value).inc()
    BREAKER_STATE.labels(upstream).set(BREAKER_STATE_VALUES[new.value])


class Gateway:
    """The whole gateway as one ASGI app: the proxy stack and the admin API, with their
    lifespan (store, upstream clients, wake-ups and background loops start and stop here).

    ``create_gateway`` is this class. Requests on ``admin_port`` go to the admin app, every
    other request to ``AccessLogMiddleware -> RouteRequests -> BulkheadMiddleware ->
    IdempotencyMiddleware -> ProxyApp`` (no ``BulkheadMiddleware`` when the config has no
    bulkhead). Shutdown waits up to ``DRAIN_TIMEOUT`` for executions in flight to record their
    outcome before it closes anything.

    Arguments:
        config: the validated config file (``load_config``/``validate_config``).
        database_url: the record store; ``None`` is the embedded SQLite file
            (``config.EMBEDDED_DATABASE_URL``), migrated at startup.
        redis_url: the shared replay cache and wake-ups; ``None`` keeps both in-process.
            Either way each process keeps copies of finished answers of its own (unless
            ``cache.max_entries`` is 0), which admin deletes reach through
            ``CacheInvalidations``.
        admin_port: the local port whose connections get the admin app instead of the proxy.
        admin_token: the bearer token of ``/admin/*``; ``None`` turns the operator API off.
        scope_secret: the key of the scope hashes (``resolve_scope_secret`` says what
            ``None`` means for each database).
        drain: the drain flag shared by this process's workers (``/readyz`` fails while set).
        span_processor: where spans go when the config turns ``tracing`` on; ``None`` is
            OTLP over HTTP (``docs/tracing.md``). Tracing is per process: the gateway started
            last in a process traces it.
    """

    def __init__(
        self,
        config: GatewayConfig,
        *,
        database_url: str | None = None,
        redis_url: str | None = None,
        admin_port: int | None = None,
        admin_token: SecretStr | None = None,
        scope_secret: SecretStr | None = None,
        drain: DrainState | None = None,
        settle_heap: bool = False,
        span_processor: SpanProcessor | None = None,
    ) -> None:
        """``settle_heap``: once started, freeze the heap out of the garbage collector's way
        (``server.heap``); for a process that serves this gateway alone, as ``serve`` does."""
        check_routes(config.routes, source="config")
        self.config = config
        self.settle_heap = settle_heap
        self.span_processor = span_processor
        self.drain = drain or DrainState()
        self.database_url = database_url_or_default(database_url)
        secret = resolve_scope_secret(scope_secret, self.database_url)
        check_admin_token(admin_token)
        self.admin_port = admin_port
        self.store = open_store(self.database_url, config.store)
        self.cache, self.wakeups = replay_layer(config.cache, redis_url)
        self.clients = {
            name: UpstreamClient(name, upstream) for name, upstream in config.upstreams.items()
        }
        self.upstreams = {
            name: ResilientUpstream(client, on_breaker_transition=_record_breaker_transition)
            for name, client in self.clients.items()
        }
        breakers = {name: upstream.breaker for name, upstream in self.upstreams.items()}
        self.overrides = BreakerOverrides(self.store, breakers, clock=utc_now)
        self.invalidations = (
            None if self.cache.shared_across_workers else CacheInvalidations(self.store, self.cache)
        )
        self.sweeper = Sweeper(self.store, config.sweeper)
        self.stuck_records = StuckRecordsSampler(self.store.count_stuck)
        self.loop_lag = LoopLagMonitor()
        self.idempotency = IdempotencyMiddleware(
            ProxyApp(config, self.upstreams),
            store=self.store,
            cache=self.cache,
            wakeups=self.wakeups,
            policy=RoutePolicies(config.routes, replay_header=config.replay_header),
            scope_secret=secret,
            scope_headers=config.scope.headers,
            header_name=config.idempotency_header,
            max_request_body=config.limits.max_request_body,
            store_unavailable=config.store_unavailable,
            finalize_attempts=config.store.finalize_attempts,
            live_streams=live_streams_for(redis_url),
        )
        bulkheads = route_bulkheads(
            config.routes,
            config.bulkheads,
            {name: upstream.bulkhead for name, upstream in self.upstreams.items()},
        )
        # Each once, for the sampler of their gauges.
        self.bulkheads = list(dict.fromkeys(b for chain in bulkheads.values() for b in chain))
        self.app = AccessLogMiddleware(
            RouteRequests(
                BulkheadMiddleware(self.idempotency, bulkheads=bulkheads)
                if bulkheads
                # Nothing to bound: the layer would only cost a lookup per request.
                else self.idempotency,
                config.routes,
            )
        )
        self.admin = create_admin_app(
            AdminContext(
                store=self.store,
                cache=self.cache,
                breakers=breakers,
                overrides=self.overrides,
                scope_headers=tuple(name.encode() for name in config.scope.headers),
                scope_secret=secret,
                admin_token=admin_token,
                invalidations=self.invalidations,
                drain=self.drain,
            )
        )
        self._background: list[asyncio.Task[None]] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        server = scope.get("server")
        if self.admin_port is not None and server is not None and server[1] == self.admin_port:
            await self.admin(scope, receive, send)
            return
        await self.app(scope, receive, send)

    async def startup(self) -> None:
        if self.config.tracing.enabled:
            tracing.enable(self.config.tracing, span_processor=self.span_processor)
        if backend_of(self.database_url) == "sqlite":
            # The embedded store belongs to this gateway alone: keep its schema current.
            await upgrade_to_head_async(self.database_url)
        # Before anything else touches the database: the request path's connections first.
        await self.store.start()
        for client in self.clients.values():
            await client.start()
        for name in self.upstreams:
            BREAKER_STATE.labels(name).set(BREAKER_STATE_VALUES[BreakerState.CLOSED.value])
        await self.wakeups.start()
        self.loop_lag.start()
        self._background.append(asyncio.create_task(self.overrides.run()))
        if self.invalidations is not None:
            self._background.append(asyncio.create_task(self.invalidations.run()))
        self._background.append(asyncio.create_task(self.stuck_records.run()))
        if self.bulkheads:
            self._background.append(asyncio.create_task(publish_every(self.bulkheads)))
        if self.config.sweeper.interval > 0:
            self._background.append(asyncio.create_task(self.sweeper.run()))

    async def shutdown(self) -> None:
        pending = set(self.idempotency.executions)
        if pending:
            log.info("draining %d in-flight executions", len(pending))
            _, still_running = await asyncio.wait(pending, timeout=DRAIN_TIMEOUT)
            if still_running:
                log.error("%d executions still running at shutdown", len(still_running))
        self.loop_lag.stop()
        for task in self._background:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.idempotency.close()
        for client in self.clients.values():
            await client.close()
        await self.wakeups.close()
        await self.cache.close()
        await self.store.close()
        if self.config.tracing.enabled:
            tracing.disable()
        # The last requests' metrics are due at the end of this iteration; the loop may not
        # run another.
        write_pending()

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                try:
                    await self.startup()
                except Exception as exc:
                    log.exception("startup failed")
                    await send({"type": "lifespan.startup.failed", "message": str(exc)})
                    return
                if self.settle_heap:
                    settle_after_startup()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return


# The name the docs and the server factory use; one signature, so its defaults live once.
create_gateway = Gateway


def gateway_from_environment() -> Gateway:
    """Factory for ``uvicorn --factory`` and for each ``serve --workers N`` process."""
    settings = environment_settings()
    resolved = os.environ.get(RESOLVED_CONFIG_ENV)
    if resolved is not None:
        config = GatewayConfig.model_validate_json(resolved)
    elif settings.config is not None:
        config = load_config(Path(settings.config))
    else:
        config = validate_config({}, source="environment (set GATEWAY_CONFIG)")
    return create_gateway(
        config,
        database_url=settings.database_url,
        redis_url=settings.redis_url,
        admin_port=settings.admin_port,
        admin_token=settings.admin_token,
        scope_secret=settings.scope_secret,
        drain=DrainState.from_environment(),
        settle_heap=True,
    )
