"""What the admin API answers with: records, their keys, breakers."""

import base64
from datetime import datetime
from enum import StrEnum
from typing import Self

from pydantic import BaseModel

from idempotency_gateway.idempotency.keys import key_hash
from idempotency_gateway.storage.records import Record


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
            scope=record.key.tenant,
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
