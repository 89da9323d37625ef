"""``/admin/records``: find, inspect, delete and expire idempotency records."""

import logging
from typing import Annotated, Any

from fastapi import Depends, Header, Query, Request

from idempotency_gateway.errors import AdminError
from idempotency_gateway.idempotency.keys import MAX_KEY_LENGTH, tenant_of
from idempotency_gateway.operations.admin.auth import admin_router
from idempotency_gateway.operations.admin.context import AdminContext, Context
from idempotency_gateway.operations.admin.problems import invalid, not_found
from idempotency_gateway.operations.admin.views import KeyMatchView, RecordView
from idempotency_gateway.storage.base import Removal
from idempotency_gateway.storage.records import RecordKey
from idempotency_gateway.telemetry.audit import log_admin_action

router = admin_router("records")
log = logging.getLogger(__name__)


def record_key(
    context: Context,
    operation: Annotated[str, Query(description="e.g. 'POST /v1/charges'", min_length=1)],
    key: Annotated[str, Query(min_length=1, max_length=255)],
    scope: Annotated[str | None, Query(description="scope hash, or 'anonymous'")] = None,
    x_scope_credential: Annotated[
        str | None,
        Header(description="the client's credential; the gateway hashes it to the scope"),
    ] = None,
) -> RecordKey:
    if (scope is None) == (x_scope_credential is None):
        raise invalid(
            "give exactly one of the scope query parameter or the X-Scope-Credential header"
        )
    if x_scope_credential is not None:
        if len(context.scope_headers) != 1:
            raise invalid("the scope combines several headers: give the scope hash instead")
        header = (context.scope_headers[0], x_scope_credential.encode("latin-1"))
        scope = tenant_of([header], context.scope_headers, secret=context.scope_secret)
    assert scope is not None
    return RecordKey(scope, operation, key)


RecordKeyParam = Annotated[RecordKey, Depends(record_key)]


@router.get("/admin/records")
async def get_record(
    context: Context, key: RecordKeyParam, include_body: bool = False
) -> RecordView:
    record = await context.store.get(key)
    if record is None:
        raise not_found("no record for that scope, operation and key")
    return RecordView.of(record, include_body=include_body)


@router.get("/admin/records/by-key")
async def records_by_key(
    context: Context,
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


@router.get("/admin/records/stuck")
async def stuck_records(
    context: Context, limit: Annotated[int, Query(ge=1, le=1000)] = 100
) -> list[RecordView]:
    """``IN_PROGRESS`` records whose lease ran out: their owner died or stalled."""
    return [RecordView.of(record) for record in await context.store.list_stuck(limit=limit)]


async def _change(
    context: AdminContext, key: RecordKey, change: str, request: Request
) -> dict[str, Any]:
    # Cache out before the record changes, or nothing changes: a 503 after a change would
    # invite a retry that changes the record again, after a retried request may already have
    # executed anew. Out, the entry leaves a marker that keeps a replay which read the record
    # before the change from putting its answer back (``redis_adapter.INVALIDATED``).
    if not await context.cache.delete(key):
        raise AdminError(
            "the record's cache entry could not be removed (Redis unreachable), so nothing "
            "was changed; retry",
            status=503,
            slug="cache-unavailable",
            title="Replay cache unavailable",
        )
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
    if removal is not Removal.DONE:
        raise not_found("no record for that scope, operation and key")
    # Out again, renewing the marker from the change on. Should Redis fail now, the change
    # stands and is reported as done: the marker set before it still guards the entry.
    if not await context.cache.delete(key):
        log.warning("record %s, but its cache entry's marker could not be renewed", change)
    if context.invalidations is not None:
        await context.invalidations.publish(key)
    log_admin_action(
        f"record {change}", client=request.client, scope=key.tenant, operation=key.operation
    )
    return {change: True}


@router.delete("/admin/records")
async def delete_record(context: Context, key: RecordKeyParam, request: Request) -> dict[str, Any]:
    """Delete a record and its cache entry: the key may execute again."""
    return await _change(context, key, "deleted", request)


@router.post("/admin/records/expire")
async def expire_record(context: Context, key: RecordKeyParam, request: Request) -> dict[str, Any]:
    """Expire a record now (it stays readable until swept): the key may execute again."""
    return await _change(context, key, "expired", request)
