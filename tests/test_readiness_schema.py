"""``/readyz`` tells the truth about the schema: on a database that was never migrated the
gateway is not ready (503, and the body says to migrate), and it turns ready once the schema
is at the migration head; meanwhile keyed requests get a problem that says the schema is
missing, in words, never the driver's exception (SQLite's store too). A real gateway process
on a PostgreSQL database created for the test.
"""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest

from idempotency_gateway.config import StoreConfig
from idempotency_gateway.errors import StoreUnavailable
from idempotency_gateway.migrate import head_revision, upgrade_to_head_async
from idempotency_gateway.storage import open_store
from idempotency_gateway.storage.base import (
    SCHEMA_MISSING_DETAIL,
)
from idempotency_gateway.storage.records import RecordKey
from tests.support import GatewayProcess, RecordingUpstream, write_config
from tests.support.keyed import keyed_gateway_config, send_keyed

pytestmark = pytest.mark.slow


async def test_readyz_is_503_until_the_schema_is_at_the_head(
    tmp_path: Path, empty_postgres_database: str, upstream: RecordingUpstream
) -> None:
    config = write_config(tmp_path, keyed_gateway_config(upstream.url).model_dump(mode="json"))
    gateway = GatewayProcess(
        config, env={"GATEWAY_DATABASE_URL": empty_postgres_database}, log_dir=tmp_path
    )
    try:
        await gateway.start()
        async with (
            httpx.AsyncClient(base_url=gateway.admin_url, trust_env=False) as admin,
            httpx.AsyncClient(base_url=gateway.url, timeout=10.0, trust_env=False) as client,
        ):
            before = await admin.get("/readyz")
            keyed_before = await send_keyed(client, f"before-{uuid.uuid4().hex}")

            await upgrade_to_head_async(empty_postgres_database)

            after = await admin.get("/readyz")
            keyed_after = await send_keyed(client, f"after-{uuid.uuid4().hex}")
    finally:
        await gateway.stop()
        log = gateway.log_tail()
        print(f"--- gateway log tail ---\n{log}")

    assert before.status_code == 503
    assert before.json()["status"] == "not ready"
    assert before.json()["store"] == "ok"
    assert "not migrated" in before.json()["schema"]
    assert str(head_revision()) in before.json()["schema"]
    # What readiness protects from: every keyed request fails on this database.
    assert keyed_before.status_code == 503
    # The problem says what is wrong in words; the driver's class name goes to the log only.
    problem = keyed_before.json()
    assert problem["type"].endswith(":store-unavailable"), problem
    assert problem["detail"] == SCHEMA_MISSING_DETAIL, problem
    assert "Error" not in keyed_before.text, problem
    assert "UndefinedTableError" in log
    assert after.status_code == 200
    assert after.json()["schema"] == "ok"
    assert keyed_after.status_code == 201


async def test_a_sqlite_store_without_its_tables_says_so_in_words(tmp_path: Path) -> None:
    store = open_store(f"sqlite+aiosqlite:///{tmp_path / 'empty.db'}", StoreConfig())
    try:
        with pytest.raises(StoreUnavailable) as refused:
            await store.get(RecordKey("anonymous", "POST /v1/charges", "never-migrated"))
    finally:
        await store.close()
    assert refused.value.detail == SCHEMA_MISSING_DETAIL
    # The driver's own words stay in the exception chain, for the log.
    assert "no such table" in str(refused.value.__cause__)
