"""The SQLite store's statements, as the database runs them: every one it runs.

The same statements as ``postgres_sql``, in SQLite's dialect: the fence is spelled out in
every owner write (``owner_id = :f_owner AND fencing_token = :f_token`` on a row still
``IN_PROGRESS``), and a take-over never touches a row whose lease is live. SQLite runs on one
machine, so "now" is the host's clock, passed in as ``:now``. Times are text that orders as
the times do (``storage.sqlite.to_text`` says why it has the form it has), so every
comparison here is a text comparison.

A new owner's fencing token comes from the one-row counter ``FENCING_TOKEN_SOURCE``, bumped by
``NEXT_TOKEN`` in the same transaction as the reserve or take-over that uses it (``:token``).
"""

from __future__ import annotations

from idempotency_gateway.storage.records import FENCING_TOKEN_SOURCE

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

# Run on every new connection. WAL lets readers run beside
# the single writer; busy_timeout makes the writers of several worker processes queue instead
# of failing with "database is locked".
PRAGMAS = (
    "PRAGMA journal_mode=WAL",
    "PRAGMA synchronous=NORMAL",
    "PRAGMA busy_timeout=5000",
)

# The operators' statements: the admin API, the sweeper, the stuck-record gauge. A record in
# flight under a live lease is never removed; see ``RecordStore.delete``.
DELETE_UNLESS_LIVE = f"DELETE FROM idempotency_records WHERE {_KEY} AND {_NOT_LIVE}"

EXPIRE_UNLESS_LIVE = f"""
UPDATE idempotency_records SET expires_at = :now, updated_at = :now
WHERE {_KEY} AND {_NOT_LIVE}
"""

# :operation NULL: every operation.
FIND_BY_KEY = """
SELECT * FROM idempotency_records
WHERE idempotency_key = :key AND (:operation IS NULL OR operation = :operation)
ORDER BY created_at DESC
LIMIT :limit
"""

_STUCK = "status = 'IN_PROGRESS' AND lease_expires_at <= :now"

LIST_STUCK = f"""
SELECT * FROM idempotency_records WHERE {_STUCK} ORDER BY lease_expires_at LIMIT :limit
"""

# Counting stops at :limit, however many owners died.
COUNT_STUCK = f"""
SELECT count(*) FROM (SELECT 1 FROM idempotency_records WHERE {_STUCK} LIMIT :limit)
"""

# One writer per file: no lock to take, no rows to skip. A live execution is never deleted,
# whatever its TTL says.
SWEEP_BATCH = f"""
DELETE FROM idempotency_records
WHERE (scope, operation, idempotency_key) IN (
    SELECT scope, operation, idempotency_key FROM idempotency_records
    WHERE expires_at <= :now AND {_NOT_LIVE}
    LIMIT :limit
)
"""

SET_BREAKER_OVERRIDE = """
INSERT INTO breaker_overrides (upstream, state, updated_at) VALUES (:upstream, :state, :at)
ON CONFLICT (upstream) DO UPDATE SET state = excluded.state, updated_at = excluded.updated_at
"""
CLEAR_BREAKER_OVERRIDE = "DELETE FROM breaker_overrides WHERE upstream = :upstream"
BREAKER_OVERRIDES = "SELECT upstream, state FROM breaker_overrides"

# Invalidations are stamped and pruned with SQLite's own clock, which every process on the
# file's machine shares, in the text form of ``to_text`` (milliseconds: SQLite's ``%f``).
_DATABASE_NOW = "strftime('%Y-%m-%d %H:%M:%f', 'now')"
_DATABASE_AGO = "strftime('%Y-%m-%d %H:%M:%f', 'now', '-' || :seconds || ' seconds')"

PUBLISH_INVALIDATION = f"""
INSERT INTO cache_invalidations (scope, operation, idempotency_key, created_at)
VALUES (:scope, :operation, :key, {_DATABASE_NOW})
"""
NEWEST_INVALIDATION = "SELECT coalesce(max(id), 0) FROM cache_invalidations"
RECENT_INVALIDATIONS = f"SELECT id FROM cache_invalidations WHERE created_at > {_DATABASE_AGO}"
INVALIDATIONS_AFTER = f"""
SELECT id, scope, operation, idempotency_key FROM cache_invalidations
WHERE id > :seen OR created_at > {_DATABASE_AGO}
ORDER BY id
"""
PRUNE_INVALIDATIONS = f"DELETE FROM cache_invalidations WHERE created_at < {_DATABASE_AGO}"

SCHEMA_MIGRATED = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'alembic_version'"
SCHEMA_REVISION = "SELECT version_num FROM alembic_version"
