"""The database URL: a libpq host list works everywhere the gateway opens PostgreSQL, a URL it
cannot read stops it at start naming the variable, and a connection refused a write as
read-only is dropped with every other connection of its pool.

The failover itself (a primary killed, its standby promoted, gateways on the host list) is
``tests/faults/test_failover.py``.
"""

from __future__ import annotations

import uuid
from urllib.parse import quote

import asyncpg
import pytest
from sqlalchemy.engine import make_url

from idempotency_gateway.cli import main
from idempotency_gateway.config import ConfigError, StoreConfig, environment_settings
from idempotency_gateway.database_url import asyncpg_dsn_of, normalize_database_url
from idempotency_gateway.errors import StoreUnavailable
from idempotency_gateway.migrate import upgrade_to_head_async
from idempotency_gateway.storage import open_store
from idempotency_gateway.storage.base import Claim, Removal
from idempotency_gateway.storage.records import RecordKey
from tests.support import eventually, free_port


@pytest.mark.parametrize(
    ("written", "sqlalchemy", "asyncpg_form"),
    [
        (
            "postgresql://gw:p%40ss@db1:5433,db2/records?target_session_attrs=read-write",
            "postgresql+asyncpg://gw:p%40ss@/records"
            "?host=db1%3A5433&host=db2%3A5432&target_session_attrs=read-write",
            "postgresql://gw:p%40ss@/records"
            "?host=db1%3A5433%2Cdb2%3A5432&target_session_attrs=read-write",
        ),
        (
            "postgres://db1:5432,db2:5432/records",
            "postgresql+asyncpg:///records?host=db1%3A5432&host=db2%3A5432",
            "postgresql:///records?host=db1%3A5432%2Cdb2%3A5432",
        ),
        (
            "postgresql://gw@db1:5432/records",
            "postgresql+asyncpg://gw@db1:5432/records",
            "postgresql://gw@db1:5432/records",
        ),
    ],
)
def test_a_host_list_is_spelled_for_each_driver(
    written: str, sqlalchemy: str, asyncpg_form: str
) -> None:
    assert normalize_database_url(written) == sqlalchemy
    assert asyncpg_dsn_of(written) == asyncpg_form
    hosts = make_url(sqlalchemy).query.get("host")
    assert hosts is None or len(hosts) == 2


def test_sqlite_urls_are_left_alone_but_for_the_driver() -> None:
    assert normalize_database_url("sqlite:///a,b.db") == "sqlite:///a,b.db"
    assert normalize_database_url("sqlite+aiosqlite:///a,b.db") == "sqlite:///a,b.db"


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("postgresql://gw:hunter2@db1:x,db2/records", "not host:port"),
        ("postgresql://gw:hunter2@db1,,db2/records", "empty entry"),
        ("postgresql://gw:hunter2@[::1]:5432,db2/records", "IPv6"),
        ("postgresql://gw:hunter2@db1:5432:5433/records", "not a database URL"),
        ("hunter2 is no url", "must start with one of postgresql://"),
    ],
)
def test_an_unreadable_url_is_an_error_naming_the_variable(
    url: str, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATEWAY_DATABASE_URL", url)
    with pytest.raises(ConfigError) as caught:
        environment_settings()
    message = str(caught.value)
    assert message.startswith("the environment: GATEWAY_DATABASE_URL: ")
    assert reason in message
    assert "hunter2" not in message


def test_migrate_refuses_an_unreadable_url_with_exit_code_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GATEWAY_DATABASE_URL", "postgresql://gw:hunter2@db1,,db2/records")
    assert main(["migrate"]) == 2
    error = capsys.readouterr().err
    assert "GATEWAY_DATABASE_URL" in error
    assert "hunter2" not in error


def _with_dead_host_first(postgres_url: str) -> str:
    """``postgres_url`` as a host list whose first host refuses connections."""
    url = make_url(postgres_url)
    return (
        f"postgresql://{url.username}@127.0.0.1:{free_port()},{url.host}:{url.port}/"
        f"{url.database}?target_session_attrs=read-write"
    )


async def test_every_path_follows_the_host_list_to_the_writable_server(
    postgres_url: str,
) -> None:
    url = _with_dead_host_first(postgres_url)
    await upgrade_to_head_async(url)  # Alembic, through the SQLAlchemy engine
    store = open_store(url, StoreConfig())
    try:
        key = RecordKey("scope", "POST /v1/charges", f"hosts-{uuid.uuid4()}")
        claim = Claim(
            request_hash="h", owner_id=f"owner-{uuid.uuid4().hex[:16]}", lease=5.0, ttl=60.0
        )
        reservation = await store.reserve(key, claim)  # the asyncpg request pool
        assert reservation.reserved
        stored = await store.get(key)
        assert stored is not None
        assert stored.owner_id == claim.owner_id
        assert await store.schema_revision() is not None  # the SQLAlchemy engine
        # A live claim is spared: the delete finds it in flight (the SQLAlchemy engine).
        assert await store.delete(key) is Removal.IN_FLIGHT
    finally:
        await store.close()


async def _sessions_named(admin: asyncpg.Connection, name: str) -> int:
    count = await admin.fetchval(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1", name
    )
    return int(count)


async def test_a_write_refused_as_read_only_drops_the_pooled_connections(
    postgres_url: str,
) -> None:
    """A server that turned standby refuses writes with SQLSTATE 25006; a read-only session
    gets the same refusal from a primary, so it stands in for one here."""
    name = f"read-only-{uuid.uuid4().hex[:12]}"
    options = quote(f"-c default_transaction_read_only=on -c application_name={name}")
    url = make_url(postgres_url).render_as_string(hide_password=False) + f"?options={options}"
    # No floor of kept connections: the sessions counted are the ones the statements opened.
    store = open_store(url, StoreConfig(pool_size=2, pool_min_size=0))
    admin = await asyncpg.connect(asyncpg_dsn_of(postgres_url))
    try:
        key = RecordKey("scope", "POST /v1/charges", f"read-only-{uuid.uuid4()}")
        assert await store.get(key) is None  # reads work, and leave a pooled connection
        assert await _sessions_named(admin, name) == 1
        claim = Claim(request_hash="h", owner_id="owner", lease=5.0, ttl=60.0)
        with pytest.raises(StoreUnavailable):
            await store.reserve(key, claim)

        async def dropped() -> bool:
            return await _sessions_named(admin, name) == 0

        await eventually(dropped, timeout=5.0, message="the read-only connection was closed")
    finally:
        await admin.close()
        await store.close()
