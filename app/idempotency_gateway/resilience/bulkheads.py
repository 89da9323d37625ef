"""``BulkheadMiddleware``: a request takes its route tier's and its upstream's slots first.

It sits between the routing layer (which knows the route) and the idempotency layer, so a
request refused here is refused before its key is reserved and before anything is sent: the
client gets a 503 ``capacity-exhausted`` problem with ``Retry-After`` and ``retryable: true``,
no record is left behind, and its retry with the same key is as safe as its first try.

The slots are taken once the request's body is whole (when the layer below reads its last
part: every layer that acts on a request reads its body first), and held until the response
has gone out (or the client left): a slow route's requests fill their tier's bulkhead, and
the routes of other tiers keep their capacity on the same upstream. A client trickling its
body in never holds a slot meanwhile, so slow bodies cannot fill a bulkhead and shed the
requests of everyone else for as long as ``request_body_timeout``; a request refused before
its body is read (a missing key, say) takes none. The tier's slot is taken before the
upstream's, always in that order, so two requests can never each hold the slot the other
waits for.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from idempotency_gateway.asgi import ASGIApp, Message, Receive, Scope, Send
from idempotency_gateway.config import BulkheadConfig, RouteConfig
from idempotency_gateway.errors import CapacityExhausted
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
        body_whole = False

        async def receive_then_take_slots() -> Message:
            nonlocal body_whole
            message = await receive()
            if body_whole or message["type"] != "http.request" or message.get("more_body"):
                return message
            body_whole = True
            try:
                for bulkhead in chain:
                    await bulkhead.acquire()
                    held.append(bulkhead)
            except CapacityExhausted:
                # The layer below answers it as any refusal, before it reserves or sends.
                note_outcome(scope, RequestOutcome.SHED)
                raise
            return message

        try:
            await self.app(scope, receive_then_take_slots, send)
        finally:
            for bulkhead in reversed(held):
                bulkhead.release()
