"""Schema changes run only through Alembic; this is how the CLI and the tests call it."""

from __future__ import annotations

import asyncio
from functools import cache
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.script import ScriptDirectory

from idempotency_gateway.idempotency.store import RecordStore, normalize_database_url


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
    """Blocking: the migration env runs its own event loop."""
    command.upgrade(alembic_config(database_url), "head")


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
