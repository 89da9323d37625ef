"""Per-endpoint opt-in the FastAPI way: ``Depends(idempotent(IdempotencyConfig(...)))``.

The middleware runs before routing, so it finds the marker itself: it matches the request
against ``scope["app"].routes`` (as the router will) and looks for an ``Idempotent``
among the matched route's dependencies, those the route inherits from its router included.
What it finds is remembered per route, so only the matching is paid per request.

    @api.post("/v1/charges")
    async def create_charge(
        execution: Execution = Depends(idempotent(IdempotencyConfig(key="required"))),
    ) -> ...:

As a dependency it hands the endpoint the ``Execution`` (``None`` for a request that came
without a key on a route where the key is optional).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from starlette.requests import Request
from starlette.routing import Match

from idempotency_gateway.asgi import Scope
from idempotency_gateway.config import IdempotencyConfig
from idempotency_gateway.execution import STATE_KEY, Execution
from idempotency_gateway.idempotency.policy import RoutePolicy


class Idempotent:
    """The marker, and the dependency that gives the endpoint its ``Execution``."""

    def __init__(self, config: IdempotencyConfig) -> None:
        self.config = config

    def __call__(self, request: Request) -> Execution | None:
        execution = getattr(request.state, STATE_KEY, None)
        return execution if isinstance(execution, Execution) else None


def idempotent(config: IdempotencyConfig | None = None) -> Idempotent:
    """Mark an endpoint as idempotent: ``Depends(idempotent(...))`` in its parameters, or
    in ``dependencies=[...]`` of the route or its router."""
    return Idempotent(config if config is not None else IdempotencyConfig())


def _calls(dependant: Any) -> Iterator[Any]:
    for dependency in getattr(dependant, "dependencies", ()):
        yield dependency.call
        yield from _calls(dependency)


def _marker_of(route: Any) -> Idempotent | None:
    # A route's dependant holds its own and its router's dependencies; FastAPI's included
    # routers may keep the router's in ``dependencies`` (``Depends``) instead.
    declared = (depends.dependency for depends in getattr(route, "dependencies", None) or ())
    calls = (*_calls(getattr(route, "dependant", None)), *declared)
    return next((call for call in calls if isinstance(call, Idempotent)), None)


def _children(route: Any) -> Any:
    """The routes inside a mount or an included router (FastAPI builds those lazily)."""
    candidates = getattr(route, "effective_candidates", None)
    return candidates() if callable(candidates) else getattr(route, "routes", None)


def _matched(routes: Any, scope: Scope) -> Any:
    """The endpoint route ``scope`` reaches, as the router would find it."""
    for route in routes:
        match, child_scope = route.matches(scope)
        if match is not Match.FULL:
            continue
        children = _children(route)
        if children is None:
            return route
        return _matched(children, {**scope, **child_scope})
    return None


class RouteMarkers:
    """The policy of the app's route a request will reach, when that route is marked."""

    def __init__(self) -> None:
        # By the route's id, the route kept beside its policy so that id is never reused.
        self._policies: dict[int, tuple[Any, RoutePolicy | None]] = {}

    def __call__(self, scope: Scope) -> RoutePolicy | None:
        route = _matched(getattr(scope.get("app"), "routes", ()), scope)
        return None if route is None else self._policy_of(route)

    def _policy_of(self, route: Any) -> RoutePolicy | None:
        known = self._policies.get(id(route))
        if known is None:
            marker = _marker_of(route)
            path = getattr(route, "path", "-")
            policy = None if marker is None else RoutePolicy(path, marker.config)
            known = self._policies[id(route)] = (route, policy)
        return known[1]
