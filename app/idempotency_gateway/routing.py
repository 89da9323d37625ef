"""Routing: the canonical target and its route, decided once per request.

``PrefixRouter`` matches on whole path segments: ``/v1/charges`` matches ``/v1/charges`` and
``/v1/charges/ch_1`` but not ``/v1/chargesX`` (a prefix that splits a segment would route by
accident). ``RouteRequests`` is the gateway's outermost routing layer: it canonicalizes the
target, matches it, and stores both in the scope for the idempotency layer and the proxy.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

from idempotency_gateway.asgi import ASGIApp, Receive, Scope, Send
from idempotency_gateway.config import RouteConfig
from idempotency_gateway.target import canonical_prefix, target_or_refuse

T = TypeVar("T")


def path_without_parameters(path: str) -> str:
    """The path as servlet containers (Tomcat, Jetty, Spring) resolve it: every segment's
    ``;parameters`` dropped, so ``/v1/charges;x=1`` and ``/v1;x/charges`` reach the upstream's
    ``/v1/charges`` handler. Routes match on this form, or such a path would pass a route's
    idempotency policy by. A segment left empty merges away, as ``//`` does."""
    if ";" not in path:
        return path
    segments = [segment.split(";", 1)[0] for segment in path.split("/")]
    kept = [segment for segment in segments[1:-1] if segment]
    return "/".join(["", *kept, segments[-1]])


class PrefixRouter(Generic[T]):
    def __init__(self, entries: Iterable[tuple[str, T]]) -> None:
        # Longest first, so the first hit is the most specific route. Prefixes are compared in
        # the canonical form the request paths arrive in.
        # Each prefix is kept with its "/"-terminated form, built once rather than per request.
        self._entries = sorted(
            (
                (prefix, prefix + "/", value)
                for prefix, value in ((canonical_prefix(p), v) for p, v in entries)
            ),
            key=lambda entry: len(entry[0]),
            reverse=True,
        )

    def match(self, path: str) -> T | None:
        path = path_without_parameters(path)
        for prefix, directory, value in self._entries:
            if not prefix or path == prefix or path.startswith(directory):
                return value
        return None


class RouteRequests:
    def __init__(self, app: ASGIApp, routes: Iterable[RouteConfig]) -> None:
        self.app = app
        self.router = PrefixRouter((route.match.path_prefix, route) for route in routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if await target_or_refuse(scope, send, self.router.match) is None:
            return
        await self.app(scope, receive, send)
