"""The gateway's tables, described for Alembic, which creates and changes them; the stores
run SQL of their own on their native drivers (``postgres_sql``, ``sqlite_sql``)."""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    SmallInteger,
    String,
    Table,
    text,
)

from idempotency_gateway.storage.records import FENCING_TOKEN_SOURCE, OPERATION_MAX_LENGTH

metadata = MetaData(
    naming_convention={
        "ix": "ix_%(table_name)s_%(column_0_N_name)s",
        "uq": "uq_%(table_name)s_%(column_0_N_name)s",
        "ck": "ck_%(table_name)s_%(constraint_name)s",
        "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
        "pk": "pk_%(table_name)s",
    }
)

records = Table(
    "idempotency_records",
    metadata,
    Column("scope", String(64), primary_key=True),
    Column("operation", String(OPERATION_MAX_LENGTH), primary_key=True),
    Column("idempotency_key", String(255), primary_key=True),
    Column("request_hash", String(64), nullable=False),
    Column("status", String(16), nullable=False),
    Column("owner_id", String(32), nullable=False),
    # Drawn from FENCING_TOKEN_SOURCE: larger for every new owner of a key, across its lives.
    Column("fencing_token", BigInteger, nullable=False),
    Column("lease_expires_at", DateTime(timezone=True), nullable=False),
    Column("response_status", SmallInteger, nullable=True),
    Column("response_headers", JSON, nullable=True),
    Column("response_body", LargeBinary, nullable=True),
    Column("body_compressed", Boolean, nullable=False, server_default=text("false")),
    Column("body_omitted", Boolean, nullable=False, server_default=text("false")),
    Column("attempts", Integer, nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
    Column("expires_at", DateTime(timezone=True), nullable=False),
    Index("ix_idempotency_records_expires_at", "expires_at"),
    # The admin lookup of a key across scopes (the primary key leads with the scope).
    Index("ix_idempotency_records_idempotency_key", "idempotency_key"),
    # Finds owners that died mid-flight without scanning finished rows.
    Index(
        "ix_idempotency_records_stale_in_progress",
        "lease_expires_at",
        postgresql_where=text("status = 'IN_PROGRESS'"),
        sqlite_where=text("status = 'IN_PROGRESS'"),
    ),
)

# SQLite only (PostgreSQL has the sequence of the same name): the last token handed out.
fencing_token_counter = Table(
    FENCING_TOKEN_SOURCE,
    metadata,
    Column("id", Integer, primary_key=True),
    Column("last_token", BigInteger, nullable=False),
    CheckConstraint("id = 1", name="one_row"),
)

# Operator-forced circuit breaker states: every gateway process applies them within seconds.
breaker_overrides = Table(
    "breaker_overrides",
    metadata,
    Column("upstream", String(128), primary_key=True),
    Column("state", String(16), nullable=False),
    Column("updated_at", DateTime(timezone=True), nullable=False),
)

# Records an operator deleted or expired: each gateway process drops them from its in-process
# replay cache on its next poll. Rows are pruned once every process must have seen them.
cache_invalidations = Table(
    "cache_invalidations",
    metadata,
    Column("id", BigInteger().with_variant(Integer, "sqlite"), primary_key=True),
    Column("scope", String(64), nullable=False),
    Column("operation", String(OPERATION_MAX_LENGTH), nullable=False),
    Column("idempotency_key", String(255), nullable=False),
    Column("created_at", DateTime(timezone=True), nullable=False),
)
