"""The real gateway in the test's event loop: ``create_gateway`` served over loopback.

    async with GatewayLauncher() as gateways:
        gateway = await gateways.start(
            gateway_config(upstream.url, routes=[route("/", key="required")]),
            database_url=database_url,
        )
        response = await gateway.client.post("/v1/charges", headers={...})

``gateway_config`` builds a validated config from a few overrides (one upstream, named
``primary``, unless ``upstreams`` says otherwise); ``route`` writes one route entry. The
launcher stops every gateway it started (lifespan shutdown included) when it exits.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol, Self

import httpx
from pydantic import SecretStr

from benchmarks.processes import free_port
from idempotency_gateway.config import GatewayConfig, validate_config
from idempotency_gateway.main import Gateway, create_gateway
from tests.support.servers import TEST_SCOPE_SECRET, serve_asgi

if TYPE_CHECKING:
    from opentelemetry.sdk.trace import SpanProcessor

PRIMARY = "primary"
# What ``idempotency-gateway serve`` tells uvicorn (app/cli.py): the gateway alone decides
# whose X-Forwarded-* to believe, so uvicorn must not rewrite the client address first.
CLI_SERVER_OPTIONS: dict[str, Any] = {"proxy_headers": False, "server_header": False}


def route(
    prefix: str,
    *,
    name: str | None = None,
    upstream: str = PRIMARY,
    bulkhead: str | None = None,
    **idempotency: Any,
) -> dict[str, Any]:
    """One ``routes`` entry; keyword arguments are its ``idempotency`` settings."""
    entry: dict[str, Any] = {
        "name": name or (prefix.strip("/").replace("/", "-") or "root"),
        "match": {"path_prefix": prefix},
        "upstream": upstream,
    }
    if bulkhead is not None:
        entry["bulkhead"] = bulkhead
    if idempotency:
        entry["idempotency"] = idempotency
    return entry


TEST_KEEPALIVE = "2s"


def gateway_config(
    upstream_url: str,
    *,
    routes: list[dict[str, Any]] | None = None,
    timeouts: Mapping[str, Any] | None = None,
    retry: Mapping[str, Any] | None = None,
    breaker: Mapping[str, Any] | None = None,
    tls: Mapping[str, Any] | None = None,
    upstreams: Mapping[str, Mapping[str, Any]] | None = None,
    **settings: Any,
) -> GatewayConfig:
    """A validated config: upstream ``primary`` at ``upstream_url``, by default one route ``/``.

    ``timeouts``, ``retry``, ``breaker`` and ``tls`` are the ``primary`` upstream's sections;
    ``upstreams`` adds (or replaces) upstream entries; ``settings`` are top-level sections such
    as ``limits``, ``store``, ``store_unavailable`` or ``trusted_proxies``.
    """
    primary: dict[str, Any] = {"url": upstream_url}
    sections = {"timeouts": timeouts, "retry": retry, "breaker": breaker, "tls": tls}
    primary.update({name: dict(section) for name, section in sections.items() if section})
    data: dict[str, Any] = {
        "upstreams": {PRIMARY: primary, **(upstreams or {})},
        "routes": routes or [route("/")],
        # Tests stop gateway processes with SIGTERM; the load balancers' drain grace would
        # only slow every stop down. Tests of the drain itself set their own.
        "lifecycle": {"drain_grace": "0s"},
        **settings,
        # Raw-socket tests read until the gateway closes an idle connection: the default
        # keep-alive (75 s, for load balancers) would hold each of them that long.
        "limits": {"keepalive_timeout": TEST_KEEPALIVE, **settings.get("limits", {})},
    }
    return validate_config(data, source="test")


def unreachable_database_url() -> str:
    """A PostgreSQL URL on a loopback port nobody listens on: every connect is refused."""
    return f"postgresql+asyncpg://postgres@127.0.0.1:{free_port()}/nowhere"


@dataclass(frozen=True)
class RunningGateway:
    url: str
    app: Gateway
    client: httpx.AsyncClient
    """Talks to ``url``; relative paths work (``client.post("/v1/charges")``)."""


@contextlib.asynccontextmanager
async def running_gateway(
    config: GatewayConfig,
    *,
    database_url: str,
    redis_url: str | None = None,
    span_processor: SpanProcessor | None = None,
) -> AsyncIterator[RunningGateway]:
    """Build the gateway with ``create_gateway`` and serve it (lifespan on) over loopback;
    with ``redis_url`` its replay cache and wake-ups are Redis, else in-process.
    ``span_processor``: where its spans go when ``config`` turns tracing on."""
    gateway = create_gateway(
        config,
        database_url=database_url,
        redis_url=redis_url,
        scope_secret=SecretStr(TEST_SCOPE_SECRET),
        span_processor=span_processor,
    )
    async with (
        serve_asgi(gateway, **CLI_SERVER_OPTIONS) as url,
        # trust_env off: a proxy in the environment must never sit between test and gateway.
        httpx.AsyncClient(base_url=url, timeout=10.0, trust_env=False) as client,
    ):
        yield RunningGateway(url, gateway, client)


class StartGateway(Protocol):
    """The ``start_gateway`` fixture (tests/conftest.py): an in-process gateway for one test.

    ``upstream_url`` defaults to the test's recording upstream; ``redis_url`` turns on the
    Redis replay cache and wake-ups; ``keyed`` gives one key-required route ``/`` and a single
    upstream attempt unless ``routes`` or ``retry`` say otherwise; ``sections`` go to
    ``gateway_config``. Every gateway stops before the upstream does.
    """

    async def __call__(
        self,
        database_url: str,
        *,
        upstream_url: str | None = None,
        redis_url: str | None = None,
        keyed: bool = False,
        **sections: Any,
    ) -> RunningGateway: ...


class GatewayLauncher:
    """Starts gateways on demand in a test and stops them all, in reverse order, at the end."""

    def __init__(self) -> None:
        self._stack = contextlib.AsyncExitStack()

    async def start(
        self, config: GatewayConfig, *, database_url: str, redis_url: str | None = None
    ) -> RunningGateway:
        return await self._stack.enter_async_context(
            running_gateway(config, database_url=database_url, redis_url=redis_url)
        )

    async def __aenter__(self) -> Self:
        await self._stack.__aenter__()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._stack.__aexit__(exc_type, exc, tb)
