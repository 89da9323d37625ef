"""Fencing tokens from one monotonic source per database.

Every new owner of a key (reserve, take-over; and so a key created again after it expired,
was swept or deleted) draws its token from one source, so its token is larger than any
owner's before it. PostgreSQL: the sequence ``idempotency_fencing_tokens``, and the column
becomes ``bigint`` (the sequence serves every key, so it outgrows ``integer``; changing the
type rewrites the table once). SQLite: the one-row counter table
``idempotency_fencing_tokens``, bumped in the transaction that writes the owner.
Both start above every token already stored.

Revision ID: 0004_fencing_token_source
Revises: 0003_cache_invalidations
Create Date: 2026-11-27
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004_fencing_token_source"
down_revision: str | None = "0003_cache_invalidations"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_SOURCE = "idempotency_fencing_tokens"


def _token_column(now: sa.types.TypeEngine[int], was: sa.types.TypeEngine[int]) -> None:
    op.alter_column(
        "idempotency_records",
        "fencing_token",
        type_=now,
        existing_type=was,
        existing_nullable=False,
    )


def upgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        _token_column(sa.BigInteger(), sa.Integer())
        op.execute(f"CREATE SEQUENCE {_SOURCE} AS bigint")
        op.execute(
            f"SELECT setval('{_SOURCE}', coalesce(max(fencing_token), 0) + 1, false) "
            "FROM idempotency_records"
        )
        return
    op.create_table(
        _SOURCE,
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("last_token", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f(f"pk_{_SOURCE}")),
        sa.CheckConstraint("id = 1", name=op.f(f"ck_{_SOURCE}_one_row")),
    )
    op.execute(
        f"INSERT INTO {_SOURCE} (id, last_token) "
        "SELECT 1, coalesce(max(fencing_token), 0) FROM idempotency_records"
    )


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute(f"DROP SEQUENCE {_SOURCE}")
        _token_column(sa.Integer(), sa.BigInteger())
        return
    op.drop_table(_SOURCE)
