"""``create_admin_app``: the admin listener assembled from its routers."""

from fastapi import FastAPI
from fastapi_offline import FastAPIOffline

from idempotency_gateway.operations.admin import breakers, drain, health, records
from idempotency_gateway.operations.admin.bounded import BoundedBodies
from idempotency_gateway.operations.admin.context import AdminContext
from idempotency_gateway.operations.admin.problems import answer_with_problems


def create_admin_app(context: AdminContext) -> FastAPI:
    # /docs and /redoc load Swagger UI and ReDoc from this listener, not from a CDN: the
    # admin port lives on private networks that often have no internet access.
    app = FastAPIOffline(
        title="idempotency-gateway admin API",
        description="Inspect and repair idempotency records; watch and force circuit breakers.",
        version="1",
        # No redirect from ``/admin/x/`` to ``/admin/x``: it would be answered before the
        # token check, to a Location built from the client's Host header. A 404 problem.
        redirect_slashes=False,
    )
    app.add_middleware(BoundedBodies)
    app.state.admin_context = context
    answer_with_problems(app)
    # In this order, the OpenAPI document lists the paths as it always has.
    for concern in (health, drain, records, breakers):
        app.include_router(concern.router)
    return app
