"""``open_store`` opens the backend a URL names, on that backend's own driver alone: one
asyncpg pool per process for PostgreSQL (the operators' statements share it with the request
path), ``sqlite3`` for SQLite, and no driver at all imported before a URL asks for one.
``RecordStore.from_url`` still works for one release, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest

from idempotency_gateway.config import StoreConfig
from idempotency_gateway.database_url import asyncpg_dsn_of
from idempotency_gateway.operations.cache_invalidations import CacheInvalidations
from idempotency_gateway.replay.cache import InProcessCache
from idempotency_gateway.storage import open_store
from idempotency_gateway.storage.base import Claim, RecordStore, Removal
from idempotency_gateway.storage.records import RecordKey
from tests.support.servers import PROJECT_ROOT

OPERATION = "POST /v1/open-store"


def _claim() -> Claim:
    return Claim(request_hash="h", owner_id=uuid.uuid4().hex, lease=30.0, ttl=60.0)


async def test_each_url_opens_its_backend_and_the_store_works(database_url: str) -> None:
    store = open_store(database_url, StoreConfig())
    try:
        expected = "PostgresRecordStore" if database_url.startswith("postgres") else "Sqlite"
        assert type(store).__name__.startswith(expected)
        key = RecordKey("scope", OPERATION, f"open-{uuid.uuid4()}")
        claim = _claim()
        assert (await store.reserve(key, claim)).reserved
        stored = await store.get(key)
        assert stored is not None
        assert stored.owner_id == claim.owner_id
        assert await store.delete(key) is Removal.IN_FLIGHT
    finally:
        await store.close()


async def test_record_store_from_url_forwards_to_open_store_with_a_deprecation_warning(
    sqlite_url: str,
) -> None:
    with pytest.warns(DeprecationWarning, match="open_store"):
        store = RecordStore.from_url(sqlite_url, StoreConfig())
    try:
        assert type(store) is type(open_store(sqlite_url, StoreConfig()))
        assert await store.get(RecordKey("scope", OPERATION, "absent")) is None
    finally:
        await store.close()


@pytest.mark.parametrize(
    "url",
    [
        "mysql://gateway:hunter2@db/records",
        "http://gateway:hunter2@db/records",
        "hunter2 is no url",
    ],
)
def test_a_url_of_no_backend_is_a_value_error_that_keeps_the_password_out(url: str) -> None:
    with pytest.raises(ValueError, match="postgresql://") as refused:
        open_store(url, StoreConfig())
    assert "hunter2" not in str(refused.value)


def _modules_after(program: str) -> set[str]:
    """The top-level packages loaded once ``program`` ran, in a fresh interpreter."""
    probe = (
        f"{program}\nimport sys\nprint(' '.join(sorted({{m.split('.')[0] for m in sys.modules}})))"
    )
    output = subprocess.run(
        [sys.executable, "-c", probe],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONPATH": f"{PROJECT_ROOT / 'app'}:{PROJECT_ROOT}", "PATH": ""},
    )
    return set(output.stdout.split())


def test_importing_the_storage_wing_imports_no_database_driver() -> None:
    loaded = _modules_after("import idempotency_gateway.storage, idempotency_gateway.storage.base")
    assert "idempotency_gateway" in loaded
    assert not loaded & {"asyncpg", "sqlalchemy", "aiosqlite"}


def test_a_sqlite_store_imports_neither_asyncpg_nor_sqlalchemy(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'records.db'}"
    loaded = _modules_after(
        "from idempotency_gateway.config import StoreConfig\n"
        "from idempotency_gateway.storage import open_store\n"
        f"open_store({url!r}, StoreConfig())"
    )
    assert "sqlite3" in loaded
    assert not loaded & {"asyncpg", "sqlalchemy", "aiosqlite"}


def test_a_postgres_store_imports_asyncpg_but_not_sqlalchemy(postgres_url: str) -> None:
    loaded = _modules_after(
        "from idempotency_gateway.config import StoreConfig\n"
        "from idempotency_gateway.storage import open_store\n"
        f"open_store({postgres_url!r}, StoreConfig())"
    )
    assert "asyncpg" in loaded
    assert "sqlalchemy" not in loaded


async def test_a_postgres_store_holds_one_pool_for_every_path(postgres_url: str) -> None:
    """The request path, the admin reads and removals, the stuck-record gauge, the sweep,
    breaker overrides and cache invalidations all run on one pool: with room for one
    connection, the store has exactly one session on the server."""
    name = f"one-pool-{uuid.uuid4().hex[:12]}"
    store = open_store(
        f"{postgres_url}?application_name={name}", StoreConfig(pool_size=1, pool_min_size=1)
    )
    admin = await asyncpg.connect(asyncpg_dsn_of(postgres_url))
    upstream = f"one-pool-{uuid.uuid4().hex[:12]}"
    try:
        await store.start()
        key = RecordKey("scope", OPERATION, f"pool-{uuid.uuid4()}")
        assert (await store.reserve(key, _claim())).reserved
        assert await store.get(key) is not None
        assert [record.key for record in await store.find_by_key(key.idempotency_key, limit=5)] == [
            key
        ]
        assert await store.expire(key) is Removal.IN_FLIGHT
        await store.list_stuck(limit=1)
        await store.count_stuck(limit=1)
        assert await store.sweep(batch_size=100, max_batches=1) is not None
        await store.set_breaker_override(upstream, "open", datetime.now(UTC))
        assert (await store.breaker_overrides())[upstream] == "open"
        await store.set_breaker_override(upstream, None, datetime.now(UTC))
        invalidations = CacheInvalidations(store, InProcessCache(max_entries=4, max_bytes=1 << 16))
        await invalidations.poll_once()
        await invalidations.publish(key)
        await invalidations.poll_once()
        assert await store.schema_revision() is not None
        await store.ping()

        sessions = await admin.fetchval(
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", name
        )
        assert sessions == 1
    finally:
        await admin.execute("DELETE FROM breaker_overrides WHERE upstream = $1", upstream)
        await admin.close()
        await store.close()


async def test_invalidations_are_read_back_by_id_on_either_backend(database_url: str) -> None:
    store = open_store(database_url, StoreConfig())
    try:
        seen, _recent = await store.newest_invalidations(within=timedelta(seconds=30))
        key = RecordKey("scope", OPERATION, f"invalidated-{uuid.uuid4()}")
        await store.publish_invalidation(key)
        after = await store.invalidations_after(
            seen, within=timedelta(seconds=30), keep=timedelta(minutes=10)
        )
        assert [invalidation.key for invalidation in after if invalidation.id > seen] == [key]
    finally:
        await store.close()
