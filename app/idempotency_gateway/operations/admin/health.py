"""``/healthz``, ``/readyz`` and ``/metrics``: open, for probes and scrapers."""

import asyncio

from fastapi import APIRouter, Response
from fastapi.responses import PlainTextResponse

from idempotency_gateway.errors import StoreReadOnly, StoreUnavailable
from idempotency_gateway.migrate import schema_state
from idempotency_gateway.operations.admin.context import Context
from idempotency_gateway.telemetry.metrics import exposition

READINESS_TIMEOUT = 2.0

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    responses={
        503: {
            "description": "not ready: draining, the store does not answer on the request "
            "path's connections, refuses writes (read-only), or its schema is not at the "
            "migration head",
            "model": dict[str, str],
        }
    },
)
async def readyz(context: Context, response: Response) -> dict[str, str]:
    if context.drain.draining:
        response.status_code = 503
        return {"status": "draining"}
    checks = {"store": "ok"}
    try:
        async with asyncio.timeout(READINESS_TIMEOUT):
            await context.store.ping()
            checks["schema"] = await schema_state(context.store)
    except StoreReadOnly:
        checks["store"] = "read-only"
    except (StoreUnavailable, TimeoutError):
        checks["store"] = "down"
    # A slow or absent Redis costs latency, never answers: degraded, still ready.
    checks["cache"] = await context.cache.health()
    ready = checks["store"] == "ok" and checks.get("schema") == "ok"
    response.status_code = 200 if ready else 503
    return {"status": "ready" if ready else "not ready", **checks}


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics() -> Response:
    body, content_type = exposition()
    return Response(body, media_type=content_type)
