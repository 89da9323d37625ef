"""The SQLite store's statements (and the shared key match), built once with bound parameters.

Building a SQLAlchemy construct (and its cache key) for every request cost more CPU than the
database round trips it described; built once here, each execution only binds values and
hits SQLAlchemy's compiled cache directly. PostgreSQL's live in ``postgres_sql``.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    ColumnElement,
    Select,
    Update,
    and_,
    bindparam,
    case,
    delete,
    or_,
    select,
    update,
)
from sqlalchemy.dialects import sqlite

from idempotency_gateway.idempotency.record import RecordKey, Status
from idempotency_gateway.idempotency.schema import records

_c = records.c


def _param(name: str, column: str) -> Any:
    return bindparam(name, type_=_c[column].type)


KEY_MATCHES: ColumnElement[bool] = and_(
    _c.scope == bindparam("k_scope"),
    _c.operation == bindparam("k_operation"),
    _c.idempotency_key == bindparam("k_key"),
)


def key_params(key: RecordKey) -> dict[str, str]:
    return {"k_scope": key.scope, "k_operation": key.operation, "k_key": key.idempotency_key}


# The owner's fence: only the execution that holds the record can write to it.
FENCE_MATCHES: ColumnElement[bool] = and_(
    _c.status == Status.IN_PROGRESS.value,
    _c.owner_id == bindparam("f_owner"),
    _c.fencing_token == bindparam("f_token"),
)

# A new record: every column but the answer, bound by its own name.
_NEW_ROW = {
    column.name: _param(column.name, column.name)
    for column in records.columns
    if not column.name.startswith("response_")
}

SELECT_RECORD: Select[Any] = select(records).where(KEY_MATCHES)

RESERVE_SQLITE = (
    sqlite.insert(records).values(_NEW_ROW).on_conflict_do_nothing().returning(*records.c)
)


def not_live(now: ColumnElement[Any]) -> ColumnElement[bool]:
    """No owner holds a live lease: the only rows a take-over or the sweeper may touch, so an
    execution in flight is never stolen or deleted, whatever its TTL says."""
    return or_(_c.status != Status.IN_PROGRESS.value, _c.lease_expires_at <= now)


_SEEN_UNCHANGED = and_(
    KEY_MATCHES,
    _c.status == bindparam("s_status"),
    _c.owner_id == bindparam("s_owner"),
    _c.fencing_token == bindparam("s_token"),
    not_live(_param("t_live_at", "lease_expires_at")),
)
_RESTART = {
    "request_hash": _param("t_request_hash", "request_hash"),
    "status": Status.IN_PROGRESS.value,
    "owner_id": _param("t_owner", "owner_id"),
    "lease_expires_at": _param("t_lease_expires_at", "lease_expires_at"),
    "response_status": None,
    "response_headers": None,
    "response_body": None,
    "body_compressed": False,
    "body_omitted": False,
    "updated_at": _param("t_now", "updated_at"),
}


def _take_over(values: dict[str, Any]) -> Update:
    return update(records).where(_SEEN_UNCHANGED).values(values).returning(*records.c)


# Same life: the history stays, the fencing token goes up, so the old owner is fenced off.
TAKE_OVER = _take_over(
    _RESTART | {"fencing_token": _c.fencing_token + 1, "attempts": _c.attempts + 1}
)
# An expired record starts a new life: token 1, a new TTL.
TAKE_OVER_EXPIRED = _take_over(
    _RESTART
    | {
        "fencing_token": 1,
        "attempts": 1,
        "created_at": _param("t_now2", "created_at"),
        "expires_at": _param("t_expires_at", "expires_at"),
    }
)

RENEW_LEASE = (
    update(records)
    .where(KEY_MATCHES, FENCE_MATCHES)
    .values(
        lease_expires_at=_param("r_lease_expires_at", "lease_expires_at"),
        updated_at=_param("r_now", "updated_at"),
    )
)

FINALIZE = (
    update(records)
    .where(KEY_MATCHES, FENCE_MATCHES)
    .values(
        status=_param("u_status", "status"),
        updated_at=_param("u_now", "updated_at"),
        response_status=_param("u_response_status", "response_status"),
        response_headers=_param("u_response_headers", "response_headers"),
        response_body=_param("u_response_body", "response_body"),
        body_compressed=_param("u_body_compressed", "body_compressed"),
        body_omitted=_param("u_body_omitted", "body_omitted"),
        # An execution that outlived its TTL keeps its answer a full TTL from now: otherwise
        # the client's retry would find the key forgotten and execute it a second time.
        expires_at=case(
            (_c.expires_at <= _param("u_now_check", "expires_at"), _param("u_keep", "expires_at")),
            else_=_c.expires_at,
        ),
    )
)

DELETE_RECORD = delete(records).where(KEY_MATCHES)
