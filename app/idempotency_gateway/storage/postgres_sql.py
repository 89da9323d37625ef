"""The PostgreSQL store's statements, as the database runs them: every one it runs.

One clock: every lease and expiry is written and compared with the database's clock
(``now()``: one instant per statement, which runs in autocommit), never a gateway host's, so
gateways whose clocks disagree cannot steal each other's live leases. Durations travel as
seconds and become intervals in SQL. ``$1`` pins "now" to a given instant instead; only the
store's tests do that (``RecordStore(clock=...)``), to move time by hand.

The fence is spelled out in every owner write: ``owner_id = $n AND fencing_token = $m`` on a
row still ``IN_PROGRESS``. A take-over never touches a row whose lease is live.

Every new owner's fencing token is drawn from the database's one sequence
(``FENCING_TOKEN_SOURCE``), so it is larger than any token the key had before, in this life or
an earlier one (a key created again after expiry, sweep or an admin delete). A reserve that
finds the key taken still draws one: sequences may skip values, never repeat them.
"""

from __future__ import annotations

from idempotency_gateway.storage.records import FENCING_TOKEN_SOURCE

_CLOCK = "clock AS (SELECT coalesce($1::timestamptz, now()) AS now)"
_KEY = "r.scope = $2 AND r.operation = $3 AND r.idempotency_key = $4"
_FENCE = "r.status = 'IN_PROGRESS' AND r.owner_id = $5 AND r.fencing_token = $6"
_NOT_LIVE = "NOT (r.status = 'IN_PROGRESS' AND r.lease_expires_at > clock.now)"
_NEXT_TOKEN = f"nextval('{FENCING_TOKEN_SOURCE}')"

# $5 request_hash, $6 owner_id, $7 lease seconds, $8 ttl seconds. One round trip: our new
# row, or the row that holds the key, with the database's "now" to judge it by.
RESERVE = f"""
WITH {_CLOCK},
inserted AS (
    INSERT INTO idempotency_records AS r (
        scope, operation, idempotency_key, request_hash, status, owner_id, fencing_token,
        lease_expires_at, attempts, body_compressed, body_omitted,
        created_at, updated_at, expires_at)
    SELECT $2, $3, $4, $5, 'IN_PROGRESS', $6, {_NEXT_TOKEN},
        clock.now + make_interval(secs => $7), 1, false, false,
        clock.now, clock.now, clock.now + make_interval(secs => $8)
    FROM clock
    ON CONFLICT DO NOTHING
    RETURNING r.*
)
SELECT true AS reserved, clock.now AS db_now, inserted.* FROM inserted, clock
UNION ALL
SELECT false, clock.now, r.* FROM idempotency_records r, clock
WHERE {_KEY} AND NOT EXISTS (SELECT FROM inserted)
"""

# When the key's holder committed after the reserve's snapshot began, neither half of the
# reserve sees it; this plain read does.
SELECT_WITH_NOW = f"""
WITH {_CLOCK}
SELECT false AS reserved, clock.now AS db_now, r.* FROM idempotency_records r, clock
WHERE {_KEY}
"""

SELECT = """
SELECT r.* FROM idempotency_records r
WHERE r.scope = $1 AND r.operation = $2 AND r.idempotency_key = $3
"""

# $5 seen status, $6 seen owner, $7 seen token: the compare-and-set; $8 request_hash,
# $9 new owner, $10 lease seconds, $11 ttl seconds. An expired row starts a new life (new
# TTL, attempts from 1); otherwise the history stays. Either way the new owner's token is
# the sequence's next, fencing the old owner off.
TAKE_OVER = f"""
WITH {_CLOCK}
UPDATE idempotency_records r SET
    request_hash = $8, status = 'IN_PROGRESS', owner_id = $9,
    lease_expires_at = clock.now + make_interval(secs => $10),
    response_status = NULL, response_headers = NULL, response_body = NULL,
    body_compressed = false, body_omitted = false, updated_at = clock.now,
    fencing_token = {_NEXT_TOKEN},
    attempts = CASE WHEN r.expires_at <= clock.now THEN 1 ELSE r.attempts + 1 END,
    created_at = CASE WHEN r.expires_at <= clock.now THEN clock.now ELSE r.created_at END,
    expires_at = CASE WHEN r.expires_at <= clock.now
        THEN clock.now + make_interval(secs => $11) ELSE r.expires_at END
FROM clock
WHERE {_KEY} AND r.status = $5 AND r.owner_id = $6 AND r.fencing_token = $7 AND {_NOT_LIVE}
RETURNING r.*
"""

# $7 lease seconds.
RENEW_LEASE = f"""
WITH {_CLOCK}
UPDATE idempotency_records r
SET lease_expires_at = clock.now + make_interval(secs => $7), updated_at = clock.now
FROM clock
WHERE {_KEY} AND {_FENCE}
"""

# $7 status, $8..$12 the answer, $13 ttl seconds. A row past its expiry (its execution
# outlived the TTL) keeps the answer a full TTL from now, so the client's retry replays it.
FINALIZE = f"""
WITH {_CLOCK}
UPDATE idempotency_records r SET
    status = $7, updated_at = clock.now,
    response_status = $8, response_headers = $9::json, response_body = $10,
    body_compressed = $11, body_omitted = $12,
    expires_at = CASE WHEN r.expires_at <= clock.now
        THEN clock.now + make_interval(secs => $13) ELSE r.expires_at END
FROM clock
WHERE {_KEY} AND {_FENCE}
"""

# $5 owner_id. Owner ids are unique per claim, so the owner id alone fences this write; the
# lease ends now, since nobody holds the record any more.
RELEASE_UNSENT = f"""
WITH {_CLOCK}
UPDATE idempotency_records r
SET status = 'FAILED_RETRYABLE', lease_expires_at = clock.now, updated_at = clock.now
FROM clock
WHERE {_KEY} AND r.status = 'IN_PROGRESS' AND r.owner_id = $5
"""

# Readiness: true when this connection's server takes writes (not a standby, and neither the
# database nor the session is set read-only).
WRITABLE = """
SELECT NOT pg_is_in_recovery() AND current_setting('transaction_read_only') = 'off'
"""

# Readiness: the Alembic revision, on the request path's own connection.
MIGRATED = "SELECT to_regclass('alembic_version') IS NOT NULL"
SCHEMA_REVISION = "SELECT version_num FROM alembic_version"

# The operators' statements: the admin API, the sweeper, the stuck-record gauge. A record in
# flight under a live lease is never removed; see ``RecordStore.delete``.
DELETE_UNLESS_LIVE = f"""
WITH {_CLOCK}
DELETE FROM idempotency_records r USING clock
WHERE {_KEY} AND {_NOT_LIVE}
"""

EXPIRE_UNLESS_LIVE = f"""
WITH {_CLOCK}
UPDATE idempotency_records r SET expires_at = clock.now, updated_at = clock.now
FROM clock
WHERE {_KEY} AND {_NOT_LIVE}
"""

# $1 idempotency key, $2 operation or NULL for every operation, $3 limit.
FIND_BY_KEY = """
SELECT r.* FROM idempotency_records r
WHERE r.idempotency_key = $1 AND ($2::text IS NULL OR r.operation = $2)
ORDER BY r.created_at DESC
LIMIT $3
"""

_STUCK = "r.status = 'IN_PROGRESS' AND r.lease_expires_at <= clock.now"

# $2 limit.
LIST_STUCK = f"""
WITH {_CLOCK}
SELECT r.* FROM idempotency_records r, clock
WHERE {_STUCK}
ORDER BY r.lease_expires_at
LIMIT $2
"""

# $2 limit: counting stops there, however many owners died.
COUNT_STUCK = f"""
WITH {_CLOCK}
SELECT count(*) FROM (SELECT FROM idempotency_records r, clock WHERE {_STUCK} LIMIT $2) stuck
"""

# Any fixed number, the same in every gateway: the key of the sweepers' advisory lock.
SWEEP_LOCK_ID = 0x1DE4_9A7E

# Transaction-scoped: it holds through PgBouncer in transaction mode, where a session lock
# would not (the next statement may run on another server connection).
TRY_SWEEP_LOCK = "SELECT pg_try_advisory_xact_lock($1)"

# $2 batch size. SKIP LOCKED passes over rows an owner is finalizing right now instead of
# waiting on them; a live execution is never deleted, whatever its TTL says.
SWEEP_BATCH = f"""
WITH {_CLOCK}
DELETE FROM idempotency_records
WHERE (scope, operation, idempotency_key) IN (
    SELECT r.scope, r.operation, r.idempotency_key FROM idempotency_records r, clock
    WHERE r.expires_at <= clock.now AND {_NOT_LIVE}
    LIMIT $2
    FOR UPDATE OF r SKIP LOCKED
)
"""

# $1 upstream, $2 state, $3 when.
SET_BREAKER_OVERRIDE = """
INSERT INTO breaker_overrides (upstream, state, updated_at) VALUES ($1, $2, $3)
ON CONFLICT (upstream) DO UPDATE SET state = excluded.state, updated_at = excluded.updated_at
"""
CLEAR_BREAKER_OVERRIDE = "DELETE FROM breaker_overrides WHERE upstream = $1"
BREAKER_OVERRIDES = "SELECT upstream, state FROM breaker_overrides"

# Invalidations are stamped and pruned with the database's clock, never a gateway host's.
PUBLISH_INVALIDATION = """
INSERT INTO cache_invalidations (scope, operation, idempotency_key, created_at)
VALUES ($1, $2, $3, now())
"""
NEWEST_INVALIDATION = "SELECT coalesce(max(id), 0) FROM cache_invalidations"
# $1 seconds.
RECENT_INVALIDATIONS = """
SELECT id FROM cache_invalidations WHERE created_at > now() - make_interval(secs => $1)
"""
# $1 the last id read, $2 seconds.
INVALIDATIONS_AFTER = """
SELECT id, scope, operation, idempotency_key FROM cache_invalidations
WHERE id > $1 OR created_at > now() - make_interval(secs => $2)
ORDER BY id
"""
# $1 seconds.
PRUNE_INVALIDATIONS = """
DELETE FROM cache_invalidations WHERE created_at < now() - make_interval(secs => $1)
"""

# Group commit (``storage.group_commit``): the reserves, and the finalizes, of one event-loop
# iteration as one statement each. $2.. are arrays, one element per request, no key twice.
_BATCH_KEY = (
    "r.scope = b.scope AND r.operation = b.operation AND r.idempotency_key = b.idempotency_key"
)

# $2 scopes, $3 operations, $4 keys, $5 request hashes, $6 owner ids, $7 leases, $8 ttls
# (seconds). Rows go in in the order given, which every gateway sorts the same way, so two
# batches never wait on each other's new rows in a cycle. Each request gets its new row, or
# the row that holds its key, with the database's "now" to judge it by, exactly as RESERVE.
RESERVE_BATCH = f"""
WITH {_CLOCK},
b AS (
    SELECT * FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], $6::text[],
        $7::float8[], $8::float8[]) WITH ORDINALITY
    AS b(scope, operation, idempotency_key, request_hash, owner_id, lease, ttl, ord)
),
inserted AS (
    INSERT INTO idempotency_records AS r (
        scope, operation, idempotency_key, request_hash, status, owner_id, fencing_token,
        lease_expires_at, attempts, body_compressed, body_omitted,
        created_at, updated_at, expires_at)
    SELECT b.scope, b.operation, b.idempotency_key, b.request_hash, 'IN_PROGRESS', b.owner_id,
        {_NEXT_TOKEN}, clock.now + make_interval(secs => b.lease), 1, false, false,
        clock.now, clock.now, clock.now + make_interval(secs => b.ttl)
    FROM b, clock
    ORDER BY b.ord
    ON CONFLICT DO NOTHING
    RETURNING r.*
)
SELECT true AS reserved, clock.now AS db_now, inserted.* FROM inserted, clock
UNION ALL
SELECT false, clock.now, r.* FROM b JOIN idempotency_records r ON {_BATCH_KEY}, clock
WHERE NOT EXISTS (
    SELECT FROM inserted i WHERE i.scope = b.scope AND i.operation = b.operation
        AND i.idempotency_key = b.idempotency_key)
"""

# The keys a batch's reserve saw neither inserted nor held (their holders committed after its
# snapshot began): $2 scopes, $3 operations, $4 keys.
SELECT_BATCH_WITH_NOW = f"""
WITH {_CLOCK}
SELECT false AS reserved, clock.now AS db_now, r.*
FROM unnest($2::text[], $3::text[], $4::text[]) AS b(scope, operation, idempotency_key)
JOIN idempotency_records r ON {_BATCH_KEY}, clock
"""

# $2 scopes, $3 operations, $4 keys, $5 owner ids, $6 fencing tokens, $7 statuses, $8..$12
# the answers, $13 ttls. Each row is written only where ITS owner and token match, as in
# FINALIZE; the ordinals of the rows written tell each request whether its write won. A row
# is locked only where its fence matches, so two batches wait on each other only when each
# names a row the other owns (two stale owners at once); PostgreSQL's deadlock detector then
# fails one batch, whose owners try again as after any store error.
FINALIZE_BATCH = f"""
WITH {_CLOCK},
b AS (
    SELECT * FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], $6::bigint[],
        $7::text[], $8::int[], $9::text[], $10::bytea[], $11::bool[], $12::bool[],
        $13::float8[]) WITH ORDINALITY
    AS b(scope, operation, idempotency_key, owner_id, fencing_token, status,
        response_status, response_headers, response_body, body_compressed, body_omitted,
        ttl, ord)
)
UPDATE idempotency_records r SET
    status = b.status, updated_at = clock.now,
    response_status = b.response_status, response_headers = b.response_headers::json,
    response_body = b.response_body,
    body_compressed = b.body_compressed, body_omitted = b.body_omitted,
    expires_at = CASE WHEN r.expires_at <= clock.now
        THEN clock.now + make_interval(secs => b.ttl) ELSE r.expires_at END
FROM b, clock
WHERE {_BATCH_KEY}
    AND r.status = 'IN_PROGRESS' AND r.owner_id = b.owner_id AND r.fencing_token = b.fencing_token
RETURNING b.ord
"""
