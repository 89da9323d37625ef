"""The SQLite store's hot statements, as the database runs them.

The same statements as ``postgres_sql``, in SQLite's dialect: the fence is spelled out in
every owner write (``owner_id = :f_owner AND fencing_token = :f_token`` on a row still
``IN_PROGRESS``), and a take-over never touches a row whose lease is live. SQLite runs on one
machine, so "now" is the host's clock, passed in as ``:now``; times are stored as the text
SQLAlchemy writes for the same columns (``storage.sqlite.to_text``), so the text comparisons
here agree with the admin and sweep paths, which stay on SQLAlchemy.

A new owner's fencing token comes from the one-row counter ``FENCING_TOKEN_SOURCE``, bumped by
``NEXT_TOKEN`` in the same transaction as the reserve or take-over that uses it (``:token``).
"""

from __future__ import annotations

from idempotency_gateway.storage.schema import FENCING_TOKEN_SOURCE

_KEY = "scope = :scope AND operation = :operation AND idempotency_key = :key"
_FENCE = "status = 'IN_PROGRESS' AND owner_id = :f_owner AND fencing_token = :f_token"
_NOT_LIVE = "NOT (status = 'IN_PROGRESS' AND lease_expires_at > :now)"

NEXT_TOKEN = f"""
UPDATE {FENCING_TOKEN_SOURCE} SET last_token = last_token + 1 WHERE id = 1
RETURNING last_token
"""

RESERVE = """
INSERT INTO idempotency_records (
    scope, operation, idempotency_key, request_hash, status, owner_id, fencing_token,
    lease_expires_at, attempts, body_compressed, body_omitted,
    created_at, updated_at, expires_at)
VALUES (:scope, :operation, :key, :request_hash, 'IN_PROGRESS', :owner, :token,
    :lease_expires_at, 1, 0, 0, :now, :now, :expires_at)
ON CONFLICT DO NOTHING
RETURNING *
"""

SELECT = f"SELECT * FROM idempotency_records WHERE {_KEY}"

# The compare-and-set on the row as it was read (:s_status, :s_owner, :s_token). An expired
# row starts a new life (new TTL, attempts from 1); otherwise the history stays. Either way
# the new owner's :token is the counter's next, fencing the old owner off.
TAKE_OVER = f"""
UPDATE idempotency_records SET
    request_hash = :request_hash, status = 'IN_PROGRESS', owner_id = :owner,
    lease_expires_at = :lease_expires_at,
    response_status = NULL, response_headers = NULL, response_body = NULL,
    body_compressed = 0, body_omitted = 0, updated_at = :now,
    fencing_token = :token,
    attempts = CASE WHEN expires_at <= :now THEN 1 ELSE attempts + 1 END,
    created_at = CASE WHEN expires_at <= :now THEN :now ELSE created_at END,
    expires_at = CASE WHEN expires_at <= :now THEN :expires_at ELSE expires_at END
WHERE {_KEY} AND status = :s_status AND owner_id = :s_owner AND fencing_token = :s_token
    AND {_NOT_LIVE}
RETURNING *
"""

RENEW_LEASE = f"""
UPDATE idempotency_records SET lease_expires_at = :lease_expires_at, updated_at = :now
WHERE {_KEY} AND {_FENCE}
"""

# A row past its expiry (its execution outlived the TTL) keeps the answer until :keep, a
# full TTL from now, so the client's retry replays it instead of executing again.
FINALIZE = f"""
UPDATE idempotency_records SET
    status = :status, updated_at = :now,
    response_status = :response_status, response_headers = :response_headers,
    response_body = :response_body, body_compressed = :body_compressed,
    body_omitted = :body_omitted,
    expires_at = CASE WHEN expires_at <= :now THEN :keep ELSE expires_at END
WHERE {_KEY} AND {_FENCE}
"""

# Owner ids are unique per claim, so the owner id alone fences this write.
RELEASE_UNSENT = f"""
UPDATE idempotency_records
SET status = 'FAILED_RETRYABLE', lease_expires_at = :now, updated_at = :now
WHERE {_KEY} AND status = 'IN_PROGRESS' AND owner_id = :f_owner
"""

# Run on every new connection, the store's and SQLAlchemy's alike. WAL lets readers run beside
# the single writer; busy_timeout makes the writers of several worker processes queue instead
# of failing with "database is locked".
PRAGMAS = (
    "PRAGMA journal_mode=WAL",
    "PRAGMA synchronous=NORMAL",
    "PRAGMA busy_timeout=5000",
)
