"""``BulkheadMiddleware``: a request takes its route tier's and its upstream's slots first.

It sits between the routing layer (which knows the route) and the idempotency layer, so a
request refused here is refused before its key is reserved and before anything is sent: the
client gets a 503 ``capacity-exhausted`` problem with ``Retry-After`` and ``retryable: true``,
no record is left behind, and its retry with the same key is as safe as its first try.

The slots are held until the response has gone out (or the client left): a slow route's
requests fill their tier's bulkhead, and the routes of other tiers keep their capacity on the
same upstream. The tier's slot is taken before the upstream's, always in that order, so two
requests can never each hold the slot the other waits for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from idempotency_gateway.asgi import ASGIApp, Receive, Scope, Send
from idempotency_gateway.config import BulkheadConfig, RouteConfig
from idempotency_gateway.errors import CapacityExhausted
from idempotency_gateway.problems import send_problem
from idempotency_gateway.request_id import request_id_of
from idempotency_gateway.resilience.bulkhead import Bulkhead, BulkheadKind
from idempotency_gateway.target import target_of
from idempotency_gateway.telemetry.request_log import RequestOutcome, note_outcome


def route_bulkheads(
    routes: Iterable[RouteConfig],
    tiers: Mapping[str, BulkheadConfig],
    upstreams: Mapping[str, Bulkhead | None],
) -> dict[str, tuple[Bulkhead, ...]]:
    """Route name -> the bulkheads its requests pass, tier first; routes with none are left
    out. One ``Bulkhead`` per tier, shared by every route that names it."""
    tier_bulkheads = {
        name: Bulkhead(BulkheadKind.TIER, name, config) for name, config in tiers.items()
    }
    passes: dict[str, tuple[Bulkhead, ...]] = {}
    for route in routes:
        tier = tier_bulkheads[route.bulkhead] if route.bulkhead is not None else None
        chain = tuple(bulkhead for bulkhead in (tier, upstreams[route.upstream]) if bulkhead)
        if chain:
            passes[route.name] = chain
    return passes


class BulkheadMiddleware:
    """Pure ASGI middleware; requests arrive routed (``routing.RouteRequests``).

    Arguments:
        app: the layer below (the idempotency middleware).
        bulkheads: route name -> its bulkheads in the order they are taken
            (``route_bulkheads``); a route not in it passes straight through.
    """

    def __init__(self, app: ASGIApp, *, bulkheads: Mapping[str, tuple[Bulkhead, ...]]) -> None:
        self.app = app
        self.bulkheads = bulkheads

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = target_of(scope).route if scope["type"] == "http" else None
        chain = self.bulkheads.get(route.name) if route is not None else None
        if route is None or not chain:
            await self.app(scope, receive, send)
            return
        held: list[Bulkhead] = []
        try:
            try:
                for bulkhead in chain:
                    await bulkhead.acquire()
                    held.append(bulkhead)
            except CapacityExhausted as error:
                note_outcome(scope, RequestOutcome.SHED)
                await send_problem(
                    send,
                    error,
                    request_id=request_id_of(scope),
                    error_format=route.idempotency.error_format,
                )
                return
            await self.app(scope, receive, send)
        finally:
            for bulkhead in reversed(held):
                bulkhead.release()
