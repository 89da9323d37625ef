"""``/admin/drain``: take this gateway out of rotation before a restart, or put it back."""

from fastapi import status

from idempotency_gateway.operations.admin.auth import admin_router
from idempotency_gateway.operations.admin.context import Context

router = admin_router("lifecycle")


@router.post("/admin/drain", status_code=status.HTTP_202_ACCEPTED)
async def start_drain(context: Context) -> dict[str, str]:
    """Fail ``/readyz`` in every worker of this gateway; requests are still served."""
    context.drain.start()
    return {"status": "draining"}


@router.delete("/admin/drain")
async def cancel_drain(context: Context) -> dict[str, str]:
    context.drain.cancel()
    return {"status": "ready"}
