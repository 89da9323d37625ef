"""Which requests a route protects, and how: the per-route idempotency policy."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Final

from idempotency_gateway.config import (
    DEFAULT_REPLAY_HEADER,
    IdempotencyConfig,
    KeyPolicy,
    RouteConfig,
    RouteMatch,
)
from idempotency_gateway.idempotency.webhooks import WebhookReceiver
from idempotency_gateway.routing import PrefixRouter, spelled
from idempotency_gateway.target import RequestTarget

EVERY_PATH: Final = RouteMatch(path_prefix="/")


@dataclass(frozen=True, slots=True)
class RoutePolicy:
    name: str
    config: IdempotencyConfig
    match: RouteMatch = EVERY_PATH
    """How the route's paths are spelled; the operation is named in that one spelling."""
    replay_header: str = DEFAULT_REPLAY_HEADER
    """The gateway-wide replay marker, for a route whose config names none of its own."""
    fingerprint_headers: tuple[bytes, ...] = field(init=False)
    replayed: tuple[bytes, bytes] = field(init=False)
    """The header field a replayed answer carries."""
    webhook: WebhookReceiver | None = field(init=False, compare=False)
    """On a webhook route: its signature check, delivery id and tenant."""

    def __post_init__(self) -> None:
        encoded = tuple(name.encode("ascii") for name in self.config.fingerprint_headers)
        object.__setattr__(self, "fingerprint_headers", encoded)
        marker = (self.config.replay_header or self.replay_header).lower().encode("ascii")
        object.__setattr__(self, "replayed", (marker, b"true"))
        webhook = self.config.webhook
        receiver = None if webhook is None else WebhookReceiver(webhook, route=self.name)
        object.__setattr__(self, "webhook", receiver)

    def covers(self, method: str) -> bool:
        return self.config.key is not KeyPolicy.OFF and method in self.config.methods

    def operation(self, method: str, target: RequestTarget) -> str:
        # The canonical path is ASCII (other octets stay percent-encoded): two different
        # paths never become one operation. In the spelling routes match it in (without
        # ";parameters", case-folded, format suffix left out as the route says): a key sent
        # again as /V1/Charges or /v1/charges.json names the handler the upstream already
        # ran, so it is the same record and a 422 (the fingerprint keeps the path as sent).
        return self.config.operation or f"{method} {spelled(target.path_text, self.match)}"


class RoutePolicies:
    """The gateway's policies: the one of the route already matched for the request."""

    def __init__(
        self, routes: Iterable[RouteConfig], *, replay_header: str = DEFAULT_REPLAY_HEADER
    ) -> None:
        # Keyed by name: the config refuses a route name used twice
        # (``config.route_reference_errors``); the request log and metrics tell routes apart
        # by it too.
        self._by_name = {
            route.name: RoutePolicy(route.name, route.idempotency, route.match, replay_header)
            for route in routes
        }

    def __call__(self, target: RequestTarget) -> RoutePolicy | None:
        return None if target.route is None else self._by_name[target.route.name]


PolicyResolver = Callable[[RequestTarget], RoutePolicy | None]
PathPolicyResolver = Callable[[str], RoutePolicy | None]
PolicySource = (
    IdempotencyConfig | Mapping[str, IdempotencyConfig] | RoutePolicies | PathPolicyResolver
)


def resolver_for(source: PolicySource) -> PolicyResolver:
    """Library users may give one policy, a ``{path_prefix: policy}`` map, or a function of
    the canonical path; the gateway gives its ``RoutePolicies``."""
    if isinstance(source, RoutePolicies):
        return source
    if isinstance(source, IdempotencyConfig):
        everywhere = RoutePolicy("default", source)
        return lambda _target: everywhere
    if isinstance(source, Mapping):
        router = PrefixRouter(
            (match, RoutePolicy(prefix, config, match))
            for prefix, config in source.items()
            for match in (RouteMatch(path_prefix=prefix),)
        )
        return lambda target: router.match(target.path_text)
    path_resolver = source
    return lambda target: path_resolver(target.path_text)
