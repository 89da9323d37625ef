"""An index on ``idempotency_key``, for the admin lookup of a key across scopes.

The primary key leads with ``scope``, so finding a key without its scope (``GET
/admin/records/by-key``) would scan the table. A plain ``CREATE INDEX``: PostgreSQL's
``CONCURRENTLY`` cannot run inside the migration's transaction, and building the index
blocks writes to the table only while it is built.

Revision ID: 0005_records_by_key
Revises: 0004_fencing_token_source
Create Date: 2026-11-28
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0005_records_by_key"
down_revision: str | None = "0004_fencing_token_source"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

_INDEX = "ix_idempotency_records_idempotency_key"


def upgrade() -> None:
    op.create_index(_INDEX, "idempotency_records", ["idempotency_key"])


def downgrade() -> None:
    op.drop_index(_INDEX, table_name="idempotency_records")
