"""The servers the suite needs, and ``--sqlite-only``, the run that does without them.

By default every test runs and a missing PostgreSQL or Redis fails the run: a store test that
did not run proves nothing. ``pytest --sqlite-only`` (or ``GATEWAY_TEST_SQLITE_ONLY=1``) is for
a machine with neither server: the SQLite half of every store-parametrized test and every test
that needs no server run; each test that needs PostgreSQL or Redis is skipped with the reason,
and the summary says how many were. CI never takes this shortcut: the option is refused when
``CI`` is set, and ``scripts/test`` (what CI runs) starts both servers and refuses it too.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator

import asyncpg
import pytest
import redis

from idempotency_gateway.database_url import asyncpg_dsn_of, normalize_database_url
from idempotency_gateway.migrate import upgrade_to_head

DEFAULT_TEST_DATABASE_URL = "postgresql+asyncpg://postgres@127.0.0.1:5432/idempotency_gateway_test"
# Database 15 belongs to the tests alone. It is never flushed: test sessions may run side by
# side, so every test uses unique keys, and every entry expires with its record.
DEFAULT_TEST_REDIS_URL = "redis://127.0.0.1:6379/15"
SQLITE_ONLY_VARIABLE = "GATEWAY_TEST_SQLITE_ONLY"
# The fixtures through which a test reaches each server; a test needs the server if any of
# them is in its fixture closure.
SERVER_FIXTURES = {
    "postgres_url": "PostgreSQL",
    "empty_postgres_database": "PostgreSQL",
    "redis_url": "Redis",
}
# A store-parametrized fixture (``database_url``) asks for the server only in its
# ``postgresql`` half, so its other half runs without one.
STORE_PARAMETER_VALUE = "postgresql"
SKIPPED = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--sqlite-only",
        action="store_true",
        help="run without PostgreSQL and Redis: tests that need either are skipped "
        f"(also {SQLITE_ONLY_VARIABLE}=1; refused when CI is set)",
    )


def sqlite_only(config: pytest.Config) -> bool:
    return bool(config.getoption("sqlite_only")) or os.environ.get(SQLITE_ONLY_VARIABLE) == "1"


def pytest_configure(config: pytest.Config) -> None:
    if sqlite_only(config) and os.environ.get("CI"):
        raise pytest.UsageError(
            "--sqlite-only skips every test that needs PostgreSQL or Redis; CI runs them all"
        )


def servers_needed(item: pytest.Item) -> list[str]:
    """The servers ``item`` talks to, from its fixtures and its store parameter."""
    names = getattr(item, "fixturenames", ())
    needed = {server for fixture, server in SERVER_FIXTURES.items() if fixture in names}
    callspec = getattr(item, "callspec", None)
    if callspec is not None and STORE_PARAMETER_VALUE in callspec.params.values():
        needed.add("PostgreSQL")
    return sorted(needed)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not sqlite_only(config):
        return
    skipped = 0
    for item in items:
        needed = servers_needed(item)
        if needed:
            skipped += 1
            reason = f"--sqlite-only: needs {' and '.join(needed)}"
            item.add_marker(pytest.mark.skip(reason=reason))
    config.stash[SKIPPED] = skipped


def pytest_report_header(config: pytest.Config) -> str | None:
    if not sqlite_only(config):
        return None
    return "--sqlite-only: no PostgreSQL, no Redis; tests that need them are skipped"


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    skipped = config.stash.get(SKIPPED, 0)
    if skipped:
        terminalreporter.write_sep(
            "!",
            f"--sqlite-only: {skipped} tests that need PostgreSQL or Redis did NOT run",
            yellow=True,
            bold=True,
        )


def refuse_in_sqlite_only(config: pytest.Config, server: str) -> None:
    """For a server fixture reached some way the collection could not see (getfixturevalue)."""
    if sqlite_only(config):
        pytest.skip(f"--sqlite-only: needs {server}")


@pytest.fixture(scope="session")
def postgres_url(request: pytest.FixtureRequest) -> str:
    refuse_in_sqlite_only(request.config, "PostgreSQL")
    # In the driver-explicit form the tests' own SQLAlchemy engines need: a plain
    # ``postgresql://`` would make SQLAlchemy reach for psycopg, which is not installed.
    url = normalize_database_url(
        os.environ.get("GATEWAY_TEST_DATABASE_URL", DEFAULT_TEST_DATABASE_URL)
    )
    upgrade_to_head(url)
    return url


@pytest.fixture(scope="session")
def redis_url(request: pytest.FixtureRequest) -> str:
    """The tests' own Redis database; fails loudly when Redis does not answer."""
    refuse_in_sqlite_only(request.config, "Redis")
    url = os.environ.get("GATEWAY_TEST_REDIS_URL", DEFAULT_TEST_REDIS_URL)
    client = redis.Redis.from_url(url)
    try:
        client.ping()
    finally:
        client.close()
    return url


@pytest.fixture
async def empty_postgres_database(postgres_url: str) -> AsyncIterator[str]:
    """A fresh PostgreSQL database nobody migrated, on the test server, dropped afterwards."""
    name = f"igw_empty_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(asyncpg_dsn_of(postgres_url))
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
        base, _, _ = postgres_url.rpartition("/")
        yield f"{base}/{name}"
    finally:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
