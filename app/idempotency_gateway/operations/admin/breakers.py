"""``/admin/breakers``: watch the circuit breakers, and force them for every gateway."""

from fastapi import Request

from idempotency_gateway.operations.admin.auth import admin_router
from idempotency_gateway.operations.admin.context import AdminContext, Context
from idempotency_gateway.operations.admin.problems import not_found
from idempotency_gateway.operations.admin.views import BreakerCommand, BreakerView, ForcedState
from idempotency_gateway.resilience.breaker import BreakerState
from idempotency_gateway.telemetry.audit import log_admin_action

router = admin_router("breakers")


def _view(context: AdminContext, name: str) -> BreakerView:
    snapshot = context.breakers[name].snapshot()
    override = context.overrides.override_of(name)
    return BreakerView(
        name=name,
        state=snapshot.state.value,
        calls=snapshot.calls,
        failures=snapshot.failures,
        slow_calls=snapshot.slow_calls,
        override=override.value if override else None,
    )


@router.get("/admin/breakers")
async def list_breakers(context: Context) -> list[BreakerView]:
    """Breaker states as this gateway process sees them."""
    return [_view(context, name) for name in context.breakers]


@router.put("/admin/breakers/{upstream}")
async def force_breaker(
    context: Context, upstream: str, command: BreakerCommand, request: Request
) -> BreakerView:
    """Force a breaker for every gateway (applied everywhere within seconds), or
    ``normal`` to hand it back to its failure counts."""
    if upstream not in context.breakers:
        # Cut short: the name is the client's, and a problem need not echo all of it.
        raise not_found(f"no upstream named {upstream[:100]!r}")
    state = None if command.state is ForcedState.NORMAL else BreakerState(command.state.value)
    await context.overrides.set(upstream, state)
    log_admin_action(
        f"breaker set to {command.state.value}", client=request.client, upstream=upstream
    )
    return _view(context, upstream)
