"""The admin listener: health, readiness, metrics and the operator API (FastAPI, OpenAPI docs
at ``/docs``). Served on its own port next to the proxy port.

``/admin/*`` needs ``Authorization: Bearer <GATEWAY_ADMIN_TOKEN>``; with no token configured
the admin API is off and says so. ``/healthz``, ``/readyz`` and ``/metrics`` are open: the
admin port belongs on a private network.
"""

# No ``from __future__ import annotations`` here: FastAPI reads the endpoint annotations,
# including aliases defined inside ``create_admin_app``, at definition time.
import asyncio
import base64
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Self

from fastapi import Depends, FastAPI, Header, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import PlainTextResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi_offline import FastAPIOffline
from pydantic import BaseModel, SecretStr
from starlette.exceptions import HTTPException

from idempotency_gateway.drain import DrainState
from idempotency_gateway.errors import AdminError, GatewayError, StoreReadOnly, StoreUnavailable
from idempotency_gateway.idempotency.keys import MAX_KEY_LENGTH, key_hash, scope_of
from idempotency_gateway.migrate import schema_state
from idempotency_gateway.operations.breaker_overrides import BreakerOverrides
from idempotency_gateway.operations.cache_invalidations import CacheInvalidations
from idempotency_gateway.problems import CHALLENGE, problem_body
from idempotency_gateway.replay.cache import ReplayCache
from idempotency_gateway.resilience.breaker import BreakerState, CircuitBreaker
from idempotency_gateway.storage.base import RecordStore, Removal
from idempotency_gateway.storage.records import Record, RecordKey
from idempotency_gateway.telemetry.audit import log_admin_action
from idempotency_gateway.telemetry.metrics import exposition

READINESS_TIMEOUT = 2.0


@dataclass(frozen=True, slots=True)
class AdminContext:
    store: RecordStore
    cache: ReplayCache
    breakers: Mapping[str, CircuitBreaker]
    overrides: BreakerOverrides
    scope_headers: tuple[bytes, ...]
    scope_secret: bytes
    admin_token: SecretStr | None
    drain: DrainState
    # Set when the replay cache is per process: deletes must reach every worker's copy.
    invalidations: CacheInvalidations | None = None


class StoredAnswerView(BaseModel):
    status: int
    headers: list[tuple[str, str]]
    body_size: int
    body_omitted: bool
    body_base64: str | None = None


class RecordView(BaseModel):
    scope: str
    operation: str
    idempotency_key: str
    request_hash: str
    status: str
    owner_id: str
    fencing_token: int
    attempts: int
    lease_expires_at: datetime
    created_at: datetime
    updated_at: datetime
    expires_at: datetime
    response: StoredAnswerView | None

    @classmethod
    def of(cls, record: Record, *, include_body: bool = False) -> Self:
        answer = record.response
        return cls(
            scope=record.key.scope,
            operation=record.key.operation,
            idempotency_key=record.key.idempotency_key,
            request_hash=record.request_hash,
            status=record.status.value,
            owner_id=record.owner_id,
            fencing_token=record.fencing_token,
            attempts=record.attempts,
            lease_expires_at=record.lease_expires_at,
            created_at=record.created_at,
            updated_at=record.updated_at,
            expires_at=record.expires_at,
            response=None
            if answer is None
            else StoredAnswerView(
                status=answer.status,
                headers=answer.headers,
                body_size=len(answer.body),
                body_omitted=answer.body_omitted,
                body_base64=base64.b64encode(answer.body).decode() if include_body else None,
            ),
        )


class KeyMatchView(BaseModel):
    """A record found by its key alone: enough to tell the scopes apart and to address the
    record (``scope`` and ``operation``) in the other record endpoints."""

    scope: str
    operation: str
    key_hash: str
    status: str
    attempts: int
    created_at: datetime
    updated_at: datetime
    expires_at: datetime
    lease_expires_at: datetime

    @classmethod
    def of(cls, record: Record) -> Self:
        # The record's view cut down to these fields: one place maps a record to its fields.
        shared = RecordView.of(record).model_dump(include=set(cls.model_fields))
        return cls(key_hash=key_hash(record.key.idempotency_key), **shared)


class BreakerView(BaseModel):
    name: str
    state: str
    calls: int
    failures: int
    slow_calls: int
    override: str | None


class ForcedState(StrEnum):
    FORCED_OPEN = "forced_open"
    FORCED_CLOSED = "forced_closed"
    DISABLED = "disabled"
    NORMAL = "normal"


class BreakerCommand(BaseModel):
    state: ForcedState


class Problem(BaseModel):
    """An RFC 9457 problem document, as every admin error is answered."""

    type: str
    title: str
    status: int
    detail: str
    retryable: bool
    request_id: str | None = None


def _problems(**described: str) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for problem answers, so the document lists every status sent."""
    content = {"application/problem+json": {"schema": Problem.model_json_schema()}}
    return {
        int(status.removeprefix("s")): {"description": text, "content": content}
        for status, text in described.items()
    }


# What every /admin/* operation may answer besides its success (the token check, validation,
# a missing record or upstream, a store or cache that does not answer).
ADMIN_PROBLEMS = _problems(
    s401="the admin token is missing or wrong",
    s404="the admin API is off, or no such record or upstream",
    s422="invalid parameters",
    s503="the store or the replay cache does not answer",
)


def _problem_response(error: GatewayError, headers: dict[str, str] | None = None) -> Response:
    return Response(
        problem_body(error, request_id=None),
        status_code=error.status,
        media_type="application/problem+json",
        headers=headers,
    )


def _not_found(detail: str) -> AdminError:
    return AdminError(detail, status=404, slug="not-found", title="Not found")


def _invalid(detail: str) -> AdminError:
    return AdminError(detail, status=422, slug="invalid-admin-request", title="Invalid request")


# Starlette's own refusals (unknown path, wrong method), as problems of our tree.
_ROUTING_PROBLEMS = {
    404: ("not-found", "Not found", "no admin endpoint at this path"),
    405: ("method-not-allowed", "Method not allowed", "this endpoint does not take that method"),
}


def _routing_problem(error: HTTPException) -> AdminError:
    slug, title, detail = _ROUTING_PROBLEMS.get(
        error.status_code, ("http-error", "HTTP error", str(error.detail))
    )
    return AdminError(detail, status=error.status_code, slug=slug, title=title)


def refuse_nul(request: Request) -> None:
    """PostgreSQL text cannot hold NUL: refuse it here (422) instead of failing the store (503)."""
    values = [request.url.path, *request.path_params.values(), *request.query_params.values()]
    if any("\x00" in str(value) for value in values):
        raise _invalid("a path or query parameter holds a NUL character (%00)")


def create_admin_app(context: AdminContext) -> FastAPI:
    # /docs and /redoc load Swagger UI and ReDoc from this listener, not from a CDN: the
    # admin port lives on private networks that often have no internet access.
    app = FastAPIOffline(
        title="idempotency-gateway admin API",
        description="Inspect and repair idempotency records; watch and force circuit breakers.",
        version="1",
    )

    @app.exception_handler(GatewayError)
    async def gateway_error(_request: Request, error: GatewayError) -> Response:
        headers = {}
        if error.status == 401:
            headers["WWW-Authenticate"] = CHALLENGE.decode()
        if error.retry_after is not None:
            headers["Retry-After"] = str(error.retry_after)
        return _problem_response(error, headers)

    @app.exception_handler(HTTPException)
    async def routing_error(_request: Request, error: HTTPException) -> Response:
        # Keeps Allow on a 405: the client learns which methods the endpoint takes.
        return _problem_response(
            _routing_problem(error), dict(error.headers) if error.headers else None
        )

    @app.exception_handler(RequestValidationError)
    async def invalid_request(_request: Request, error: RequestValidationError) -> Response:
        problems = "; ".join(
            f"{'.'.join(str(part) for part in item['loc'])}: {item['msg']}"
            for item in error.errors()
        )
        return _problem_response(_invalid(problems))

    # Declared the FastAPI way, so the OpenAPI document carries the scheme and /docs can
    # call /admin/*; auto_error off, because the refusals are ours (404 when the API is off,
    # a 401 problem with a challenge otherwise). HTTPBearer reads the scheme in any case.
    bearer = HTTPBearer(auto_error=False, description="the admin token (GATEWAY_ADMIN_TOKEN)")

    def require_token(
        credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
    ) -> None:
        if context.admin_token is None:
            raise AdminError(
                "the admin API is off: set GATEWAY_ADMIN_TOKEN to turn it on",
                status=404,
                slug="admin-api-off",
                title="Admin API disabled",
            )
        expected = context.admin_token.get_secret_value().encode()
        offered = b"" if credentials is None else credentials.credentials.encode()
        # Constant time: the comparison must not leak how much of a guess was right. No
        # configured token is empty, so a missing credential never matches.
        if not secrets.compare_digest(offered, expected):
            raise AdminError(
                "send Authorization: Bearer <admin token>",
                status=401,
                slug="unauthorized",
                title="Unauthorized",
            )

    def record_key(
        operation: Annotated[str, Query(description="e.g. 'POST /v1/charges'", min_length=1)],
        key: Annotated[str, Query(min_length=1, max_length=255)],
        scope: Annotated[str | None, Query(description="scope hash, or 'anonymous'")] = None,
        x_scope_credential: Annotated[
            str | None,
            Header(description="the client's credential; the gateway hashes it to the scope"),
        ] = None,
    ) -> RecordKey:
        if (scope is None) == (x_scope_credential is None):
            raise _invalid(
                "give exactly one of the scope query parameter or the X-Scope-Credential header"
            )
        if x_scope_credential is not None:
            if len(context.scope_headers) != 1:
                raise _invalid("the scope combines several headers: give the scope hash instead")
            header = (context.scope_headers[0], x_scope_credential.encode("latin-1"))
            scope = scope_of([header], context.scope_headers, secret=context.scope_secret)
        assert scope is not None
        return RecordKey(scope, operation, key)

    admin: Any = {
        "dependencies": [Depends(require_token), Depends(refuse_nul)],
        "responses": ADMIN_PROBLEMS,
    }
    RecordKeyParam = Annotated[RecordKey, Depends(record_key)]

    @app.get("/healthz", tags=["health"])
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/readyz",
        tags=["health"],
        responses={
            503: {
                "description": "not ready: draining, the store does not answer on the request "
                "path's connections, refuses writes (read-only), or its schema is not at the "
                "migration head",
                "model": dict[str, str],
            }
        },
    )
    async def readyz(response: Response) -> dict[str, str]:
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

    @app.get("/metrics", tags=["health"], response_class=PlainTextResponse)
    async def metrics() -> Response:
        body, content_type = exposition()
        return Response(body, media_type=content_type)

    @app.post("/admin/drain", **admin, tags=["lifecycle"], status_code=202)
    async def start_drain() -> dict[str, str]:
        """Fail ``/readyz`` in every worker of this gateway; requests are still served."""
        context.drain.start()
        return {"status": "draining"}

    @app.delete("/admin/drain", **admin, tags=["lifecycle"])
    async def cancel_drain() -> dict[str, str]:
        context.drain.cancel()
        return {"status": "ready"}

    @app.get("/admin/records", **admin, tags=["records"])
    async def get_record(key: RecordKeyParam, include_body: bool = False) -> RecordView:
        record = await context.store.get(key)
        if record is None:
            raise _not_found("no record for that scope, operation and key")
        return RecordView.of(record, include_body=include_body)

    @app.get("/admin/records/by-key", **admin, tags=["records"])
    async def records_by_key(
        key: Annotated[str, Query(min_length=1, max_length=MAX_KEY_LENGTH)],
        operation: Annotated[
            str | None, Query(description="e.g. 'POST /v1/charges'", min_length=1)
        ] = None,
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> list[KeyMatchView]:
        """Records of a key in every scope (of one operation, if given), newest first. The
        access log's ``key_hash`` is the ``key_hash`` here: a log line finds its record."""
        found = await context.store.find_by_key(key, operation=operation, limit=limit)
        return [KeyMatchView.of(record) for record in found]

    @app.get("/admin/records/stuck", **admin, tags=["records"])
    async def stuck_records(
        limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    ) -> list[RecordView]:
        """``IN_PROGRESS`` records whose lease ran out: their owner died or stalled."""
        return [RecordView.of(record) for record in await context.store.list_stuck(limit=limit)]

    async def change_record(key: RecordKey, change: str, request: Request) -> dict[str, Any]:
        # Cache out, record changed, cache out again: a replay that read the record just
        # before the change cannot leave a stale copy behind.
        cache_cleared = await context.cache.delete(key)
        removal = await (
            context.store.delete(key) if change == "deleted" else context.store.expire(key)
        )
        if removal is Removal.IN_FLIGHT:
            raise AdminError(
                "the record is in flight: its owner holds a live lease and may be sending "
                "the request upstream right now, so a duplicate let in beside it could execute "
                "it a second time. Retry once the lease ran out (GET /admin/records/stuck "
                "lists owners that stopped renewing it) or the execution finished",
                status=409,
                slug="record-in-flight",
                title="Record in flight",
            )
        changed = removal is Removal.DONE
        cache_cleared = await context.cache.delete(key) and cache_cleared
        if changed and context.invalidations is not None:
            await context.invalidations.publish(key)
        if not cache_cleared:
            raise AdminError(
                f"the record was {change if changed else 'already absent'} but its cache entry "
                "could not be removed (Redis unreachable); retry",
                status=503,
                slug="cache-unavailable",
                title="Replay cache unavailable",
            )
        if not changed:
            raise _not_found("no record for that scope, operation and key")
        log_admin_action(
            f"record {change}", client=request.client, scope=key.scope, operation=key.operation
        )
        return {change: True}

    @app.delete("/admin/records", **admin, tags=["records"])
    async def delete_record(key: RecordKeyParam, request: Request) -> dict[str, Any]:
        """Delete a record and its cache entry: the key may execute again."""
        return await change_record(key, "deleted", request)

    @app.post("/admin/records/expire", **admin, tags=["records"])
    async def expire_record(key: RecordKeyParam, request: Request) -> dict[str, Any]:
        """Expire a record now (it stays readable until swept): the key may execute again."""
        return await change_record(key, "expired", request)

    def breaker_view(name: str, breaker: CircuitBreaker) -> BreakerView:
        snapshot = breaker.snapshot()
        override = context.overrides.override_of(name)
        return BreakerView(
            name=name,
            state=snapshot.state.value,
            calls=snapshot.calls,
            failures=snapshot.failures,
            slow_calls=snapshot.slow_calls,
            override=override.value if override else None,
        )

    @app.get("/admin/breakers", **admin, tags=["breakers"])
    async def list_breakers() -> list[BreakerView]:
        """Breaker states as this gateway process sees them."""
        return [breaker_view(name, breaker) for name, breaker in context.breakers.items()]

    @app.put("/admin/breakers/{upstream}", **admin, tags=["breakers"])
    async def force_breaker(
        upstream: str, command: BreakerCommand, request: Request
    ) -> BreakerView:
        """Force a breaker for every gateway (applied everywhere within seconds), or
        ``normal`` to hand it back to its failure counts."""
        if upstream not in context.breakers:
            raise _not_found(f"no upstream named {upstream!r}")
        state = None if command.state is ForcedState.NORMAL else BreakerState(command.state.value)
        await context.overrides.set(upstream, state)
        log_admin_action(
            f"breaker set to {command.state.value}", client=request.client, upstream=upstream
        )
        return breaker_view(upstream, context.breakers[upstream])

    return app
