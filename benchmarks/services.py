"""PostgreSQL and Redis for a run: a fresh, migrated bench database; Redis if it answers."""

from __future__ import annotations

import asyncio
import subprocess
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from benchmarks.processes import StartError, clean_environment, venv_tool

DEFAULT_SERVER_URL = "postgresql://postgres@127.0.0.1:5432"
DEFAULT_DATABASE = "idempotency_gateway_bench"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/14"


def _plain(url: str) -> str:
    """asyncpg and the gateway both accept ``postgresql://``; drop a SQLAlchemy driver suffix."""
    parts = urlsplit(url)
    return urlunsplit(parts._replace(scheme="postgresql"))


def with_database(server_url: str, database: str) -> str:
    parts = urlsplit(_plain(server_url))
    return urlunsplit(parts._replace(path="/" + database))


async def _recreate(server_url: str, database: str) -> None:
    if not database.replace("_", "").isalnum():
        raise StartError(f"not a plain database name: {database!r}")
    connection = await asyncpg.connect(with_database(server_url, "postgres"), timeout=5)
    try:
        await connection.execute(f'DROP DATABASE IF EXISTS "{database}"')
        await connection.execute(f'CREATE DATABASE "{database}"')
    finally:
        await connection.close()


def prepare_database(server_url: str, database: str, *, recreate: bool) -> str:
    """The database's URL, created afresh when ``recreate``, migrated with the gateway's CLI."""
    url = with_database(server_url, database) if recreate else _plain(server_url)
    if recreate:
        asyncio.run(_recreate(server_url, database))
    result = subprocess.run(
        [venv_tool("idempotency-gateway"), "migrate", "--wait", "5"],
        env=clean_environment({"GATEWAY_DATABASE_URL": url}),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    if result.returncode != 0:
        raise StartError(f"idempotency-gateway migrate failed:\n{result.stdout}{result.stderr}")
    return url


async def _postgres_version(url: str) -> str:
    connection = await asyncpg.connect(url, timeout=5)
    try:
        version: str = await connection.fetchval("SHOW server_version")
        return version
    finally:
        await connection.close()


def postgres_version(url: str) -> str:
    try:
        return asyncio.run(_postgres_version(url))
    except (OSError, asyncpg.PostgresError, TimeoutError) as exc:
        return f"unknown ({type(exc).__name__})"


async def _commits(url: str) -> int:
    connection = await asyncpg.connect(url, timeout=5)
    try:
        commits: int = await connection.fetchval(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = current_database()"
        )
        return commits
    finally:
        await connection.close()


def committed_transactions(url: str) -> int | None:
    """``pg_stat_database.xact_commit`` of the bench database: every commit on it so far,
    as far as its server processes have reported them (each reports within a second of
    going idle, so read it a second after the load stops)."""
    try:
        return asyncio.run(_commits(url))
    except (OSError, asyncpg.PostgresError, TimeoutError):
        return None


def redis_version(url: str) -> str | None:
    """Redis's version when it answers at ``url``, else ``None``."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2)
    try:
        info = client.info("server")
        return str(info.get("redis_version", "unknown"))
    except redis.RedisError:
        return None
    finally:
        client.close()


def flush_redis_database(url: str) -> None:
    """Empty the bench's own Redis database (only ever called for the default, db 14)."""
    import redis

    client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=2)
    try:
        client.flushdb()
    finally:
        client.close()
