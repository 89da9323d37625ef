"""The admin listener: health, readiness, metrics and the operator API (FastAPI, OpenAPI docs
at ``/docs``). Served on its own port next to the proxy port.

``/admin/*`` needs ``Authorization: Bearer <GATEWAY_ADMIN_TOKEN>``; with no token configured
the admin API is off and says so. ``/healthz``, ``/readyz`` and ``/metrics`` are open: the
admin port belongs on a private network.

One router per concern (``health``, ``drain``, ``records``, ``breakers``); each endpoint gets
the gateway's ``AdminContext`` as a dependency, and ``create_admin_app`` only assembles.
"""

from typing import TYPE_CHECKING

from idempotency_gateway.lazy import lazy_exports

if TYPE_CHECKING:
    from idempotency_gateway.operations.admin.app import create_admin_app
    from idempotency_gateway.operations.admin.context import AdminContext

__all__ = ["AdminContext", "create_admin_app"]

__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "AdminContext": "idempotency_gateway.operations.admin.context",
        "create_admin_app": "idempotency_gateway.operations.admin.app",
    },
)
