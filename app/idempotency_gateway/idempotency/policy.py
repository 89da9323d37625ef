"""Which requests a route protects, and how: the per-route idempotency policy."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from idempotency_gateway.config import IdempotencyConfig, KeyPolicy
from idempotency_gateway.routing import PrefixRouter


@dataclass(frozen=True, slots=True)
class RoutePolicy:
    name: str
    config: IdempotencyConfig
    fingerprint_headers: tuple[bytes, ...] = field(init=False)

    def __post_init__(self) -> None:
        encoded = tuple(name.encode("ascii") for name in self.config.fingerprint_headers)
        object.__setattr__(self, "fingerprint_headers", encoded)

    def covers(self, method: str) -> bool:
        return self.config.key is not KeyPolicy.OFF and method in self.config.methods

    def operation(self, method: str, path: str) -> str:
        return self.config.operation or f"{method} {path}"


PolicyResolver = Callable[[str], RoutePolicy | None]
PolicySource = IdempotencyConfig | Mapping[str, IdempotencyConfig] | PolicyResolver


def resolver_for(source: PolicySource) -> PolicyResolver:
    """Library users may give one policy, a ``{path_prefix: policy}`` map, or a function."""
    if isinstance(source, IdempotencyConfig):
        everywhere = RoutePolicy("default", source)
        return lambda _path: everywhere
    if isinstance(source, Mapping):
        router = PrefixRouter(
            (prefix, RoutePolicy(prefix, config)) for prefix, config in source.items()
        )
        return router.match
    return source
