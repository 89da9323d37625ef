"""Schema changes run only through Alembic; this is how the CLI and the tests call it."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from functools import cache
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory
from sqlalchemy.exc import DBAPIError

from idempotency_gateway.database_url import normalize_database_url
from idempotency_gateway.extras import require_database_driver
from idempotency_gateway.storage.base import RecordStore

# Processes that start together (workers of one server) may race on SQLite's schema; a few
# short pauses let the one that got there first finish.
_MIGRATION_ATTEMPTS = 5
_MIGRATION_RETRY_PAUSE = 0.2


def migrations_directory() -> Path:
    package = Path(__file__).parent
    # A wheel carries the scripts inside the package; a checkout keeps them at its root.
    installed = package / "migrations"
    return installed if installed.is_dir() else package.parent.parent / "migrations"


def alembic_config(database_url: str) -> Config:
    config = Config()
    config.set_main_option("script_location", str(migrations_directory()))
    # Alembic's config is a ConfigParser: a literal % (URL-encoded passwords) must be doubled.
    config.set_main_option(
        "sqlalchemy.url", normalize_database_url(database_url).replace("%", "%%")
    )
    return config


def upgrade_to_head(database_url: str) -> None:
    """Bring the schema to the head revision. Blocking.

    Callable anywhere an app module runs, the import of a module that uvicorn (``--workers``,
    ``--reload``) or gunicorn loads included: the migration env runs an event loop of its own,
    which cannot start inside the server's running one, so there it runs on a thread. Several
    processes may call it at once: on PostgreSQL they take turns on an advisory lock (see
    ``migrations/env.py``); on SQLite a process that lost the race finds the schema at head.
    """
    require_database_driver(database_url)
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        _upgrade_racing_others(database_url)
        return
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="migrate") as thread:
        thread.submit(_upgrade_racing_others, database_url).result()


def _upgrade_racing_others(database_url: str) -> None:
    config = alembic_config(database_url)
    for attempt in range(1, _MIGRATION_ATTEMPTS + 1):
        try:
            command.upgrade(config, "head")
            return
        except DBAPIError:
            # Another process ran the same step between our read of the revision and our
            # write; once it has finished, our next look finds the schema at head.
            if attempt == _MIGRATION_ATTEMPTS:
                raise
            time.sleep(_MIGRATION_RETRY_PAUSE * attempt)


async def upgrade_to_head_async(database_url: str) -> None:
    await asyncio.to_thread(upgrade_to_head, database_url)


@cache
def head_revision() -> str | None:
    config = Config()
    config.set_main_option("script_location", str(migrations_directory()))
    return ScriptDirectory.from_config(config).get_current_head()


async def schema_state(store: RecordStore) -> str:
    """``"ok"`` when the database's schema is at the migration head, else what is wrong: a
    gateway on an older schema would fail every keyed request, so it is not ready."""
    current, head = await store.schema_revision(), head_revision()
    if current == head:
        return "ok"
    if current is None:
        return f"not migrated (head is {head}): run idempotency-gateway migrate"
    return f"at revision {current}, head is {head}: run idempotency-gateway migrate"
