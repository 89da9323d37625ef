"""One clock on PostgreSQL: gateways whose host clocks disagree by far more than a lease still
agree on who holds a key, on which admin deletes they have seen and on when a cached answer
has expired, because every lease, expiry and invalidation is written and judged with the
database's clock (or, in Redis, as a relative TTL).

Real gateway processes share one database; one runs with its host clock skewed under
libfaketime (``scripts/test`` installs it):

- two minutes ahead: a duplicate sent to either gateway while the other's execution is in
  flight gets 409, never a second execution, and the rows it writes carry the database's time;
- fifteen minutes ahead, without Redis: admin deletes published through any gateway reach
  every other gateway's in-process replay cache, and the invalidation rows carry the
  database's time (a host-clock stamp would be pruned before the others read it, or prune
  theirs);
- a minute behind, with the in-process cache and with Redis: once the database says a record
  expired, the skewed gateway executes the key afresh instead of replaying the old answer.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime, timedelta
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import redis.asyncio

from idempotency_gateway.config import StoreConfig
from idempotency_gateway.database_url import asyncpg_dsn_of
from idempotency_gateway.operations.cache_invalidations import POLL_INTERVAL
from idempotency_gateway.replay.cache import cache_key
from idempotency_gateway.storage import open_store
from tests.support import GatewayProcess, RecordingUpstream, eventually, write_config
from tests.support.charges import CHARGES
from tests.support.clock import skewed_clock_env
from tests.support.gateway import route
from tests.support.keyed import is_replay, keyed_gateway_config, record_key, send_keyed

pytestmark = pytest.mark.slow

SKEW = timedelta(minutes=2)
LEASE = 3.0
# Margin for statements and scheduling on a loaded machine; far below the skew.
SLACK = timedelta(seconds=20)
# Several gateway processes import and start at once; a loaded machine takes its time.
STARTUP_TIMEOUT = 60.0


def skewed_env(database_url: str) -> dict[str, str]:
    return {"GATEWAY_DATABASE_URL": database_url, **skewed_clock_env(SKEW)}


async def ask_database(database_url: str, query: str, *args: object) -> Any:
    """One value, as the database itself computes it (its own clock in ``now()``)."""
    connection = await asyncpg.connect(asyncpg_dsn_of(database_url))
    try:
        return await connection.fetchval(query, *args)
    finally:
        await connection.close()


async def database_now(database_url: str) -> datetime:
    now: datetime = await ask_database(database_url, "SELECT now()")
    return now


@pytest.mark.multiprocess
async def test_gateways_with_skewed_clocks_never_steal_a_live_lease(
    tmp_path: Path,
    postgres_url: str,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
) -> None:
    # ``retry`` would execute again on a stolen lease; ``fail`` would answer "outcome unknown".
    config = keyed_gateway_config(
        upstream.url,
        routes=[route("/", key="required", lease=f"{LEASE:g}s", on_ambiguous="retry")],
    )
    config_path = write_config(tmp_path, config.model_dump(mode="json"))
    honest = GatewayProcess(
        config_path,
        env={"GATEWAY_DATABASE_URL": postgres_url},
        log_dir=tmp_path,
        startup_timeout=STARTUP_TIMEOUT,
        name="honest",
    )
    ahead = GatewayProcess(
        config_path,
        env=skewed_env(postgres_url),
        log_dir=tmp_path,
        startup_timeout=STARTUP_TIMEOUT,
        name="ahead",
    )
    store = open_store(postgres_url, StoreConfig())
    on_honest_key, on_ahead_key = unique("owned-by-honest"), unique("owned-by-ahead")
    try:
        await asyncio.gather(honest.start(), ahead.start())
        async with (
            httpx.AsyncClient(base_url=honest.url, timeout=30.0, trust_env=False) as to_honest,
            httpx.AsyncClient(base_url=ahead.url, timeout=30.0, trust_env=False) as to_ahead,
        ):
            # The skew is real: the gateway's own Date header is two minutes ahead.
            async with httpx.AsyncClient(trust_env=False) as admin:
                probe = await admin.get(f"{ahead.admin_url}/healthz")
            assert (
                parsedate_to_datetime(probe.headers["date"]) - await database_now(postgres_url)
                > SKEW - SLACK
            )

            first_honest = asyncio.create_task(
                send_keyed(to_honest, on_honest_key, behavior="gate=honest")
            )
            first_ahead = asyncio.create_task(
                send_keyed(to_ahead, on_ahead_key, behavior="gate=ahead")
            )
            await upstream.wait_arrived("honest")
            await upstream.wait_arrived("ahead")

            # By the skewed host clock both leases ran out long ago; by the database's they
            # are live.
            assert (await send_keyed(to_ahead, on_honest_key)).status_code == 409
            assert (await send_keyed(to_honest, on_ahead_key)).status_code == 409

            written = await store.get(record_key(on_ahead_key))
            assert written is not None
            now = await database_now(postgres_url)
            assert written.created_at <= now
            assert written.lease_expires_at - now < timedelta(seconds=LEASE) + SLACK
            assert written.expires_at - written.created_at == timedelta(
                seconds=config.routes[0].idempotency.ttl
            )

            upstream.release("honest")
            upstream.release("ahead")
            originals = await asyncio.gather(first_honest, first_ahead)
            replays = [
                await send_keyed(to_ahead, on_honest_key),
                await send_keyed(to_honest, on_ahead_key),
            ]
    finally:
        await store.close()
        await asyncio.gather(honest.stop(), ahead.stop())
        for gateway in (honest, ahead):
            print(f"--- gateway {gateway.name} log tail ---\n{gateway.log_tail()}")

    assert [response.status_code for response in originals] == [201, 201]
    assert upstream.count(on_honest_key) == 1
    assert upstream.count(on_ahead_key) == 1
    assert [r.content for r in replays] == [r.content for r in originals]


ADMIN_TOKEN = "one-clock-admin-token"
# Far past the retention of invalidation rows (ten minutes): a host-clock stamp or prune
# by this gateway would put its rows, or everyone else's, past it at once.
FAR_AHEAD = timedelta(minutes=15)
BEHIND = timedelta(seconds=-60)
# The promise for an admin delete: one poll interval plus a query; the slack absorbs load.
INVALIDATION_BOUND = POLL_INTERVAL + 5.0
# Long enough that a replay right after the first answer still finds the record live on a
# loaded machine; short, because the test waits it out.
SHORT_TTL = 6.0
# Redis starts a TTL when the SET arrives and counts whole milliseconds.
TTL_SLACK_MS = 50


def execution_of(response: httpx.Response) -> int:
    assert response.status_code == 201, response.text
    number: int = response.json()["execution"]
    return number


async def admin_delete(gateway: GatewayProcess, key: str) -> None:
    async with httpx.AsyncClient(trust_env=False, timeout=30.0) as admin:
        deleted = await admin.delete(
            f"{gateway.admin_url}/admin/records",
            params={"operation": f"POST {CHARGES}", "key": key, "scope": record_key(key).tenant},
            headers={"Authorization": f"Bearer {ADMIN_TOKEN}"},
        )
    assert deleted.status_code == 200, deleted.text


async def record_expired(database_url: str, key: str) -> bool:
    """Whether the database's clock has passed the record's expiry."""
    expired: bool = await ask_database(
        database_url,
        "SELECT expires_at <= now() FROM idempotency_records WHERE idempotency_key = $1",
        key,
    )
    return expired


@pytest.mark.multiprocess
async def test_admin_deletes_reach_every_gateway_whatever_its_host_clock(
    tmp_path: Path,
    postgres_url: str,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
) -> None:
    config_path = write_config(tmp_path, keyed_gateway_config(upstream.url).model_dump(mode="json"))
    honest_env = {"GATEWAY_DATABASE_URL": postgres_url, "GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN}
    first, second = (
        GatewayProcess(
            config_path,
            env=honest_env,
            log_dir=tmp_path,
            startup_timeout=STARTUP_TIMEOUT,
            name=name,
        )
        for name in ("first", "second")
    )
    ahead = GatewayProcess(
        config_path,
        env={**honest_env, **skewed_clock_env(FAR_AHEAD)},
        log_dir=tmp_path,
        startup_timeout=STARTUP_TIMEOUT,
        name="ahead",
    )
    gateways = (first, second, ahead)
    clients = {
        gateway.name: httpx.AsyncClient(base_url=gateway.url, timeout=30.0, trust_env=False)
        for gateway in gateways
    }

    async def warmed(key: str) -> int:
        """Execute through ``first``; every gateway then holds the answer in its cache."""
        original = execution_of(await send_keyed(clients["first"], key))
        for name in ("second", "ahead"):
            replay = await send_keyed(clients[name], key)
            assert (execution_of(replay), is_replay(replay)) == (original, True)
        return original

    async def answers_afresh(name: str, key: str, old: int) -> None:
        async def no_longer_old() -> bool:
            return execution_of(await send_keyed(clients[name], key)) != old

        await eventually(
            no_longer_old,
            timeout=INVALIDATION_BOUND,
            interval=0.1,
            message=f"{name} dropped the deleted answer",
        )

    on_honest, on_ahead = unique("deleted-through-honest"), unique("deleted-through-ahead")
    try:
        await asyncio.gather(*(gateway.start() for gateway in gateways))
        # Deleted through an honest gateway: the one far ahead reads the row and leaves it
        # for the others (pruning by its own clock would delete it before they read it).
        old = await warmed(on_honest)
        await admin_delete(first, on_honest)
        await answers_afresh("second", on_honest, old)
        await answers_afresh("ahead", on_honest, old)

        # Deleted through the gateway far ahead: its row carries the database's time.
        old = await warmed(on_ahead)
        await admin_delete(ahead, on_ahead)
        stamp_age = await ask_database(
            postgres_url,
            "SELECT now() - max(created_at) FROM cache_invalidations WHERE idempotency_key = $1",
            on_ahead,
        )
        assert abs(stamp_age) < SLACK
        await answers_afresh("first", on_ahead, old)
        await answers_afresh("second", on_ahead, old)
    finally:
        for client in clients.values():
            await client.aclose()
        await asyncio.gather(*(gateway.stop() for gateway in gateways))
        for gateway in gateways:
            print(f"--- gateway {gateway.name} log tail ---\n{gateway.log_tail()}")

    # Each key: the first execution, and one more after its delete, whoever answered.
    assert upstream.count(on_honest) == 2
    assert upstream.count(on_ahead) == 2


@pytest.mark.multiprocess
@pytest.mark.parametrize("cache", ["in-process", "redis"])
async def test_a_gateway_behind_never_replays_an_answer_the_database_says_expired(
    cache: str,
    tmp_path: Path,
    postgres_url: str,
    redis_url: str,
    redis_client: redis.asyncio.Redis,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
) -> None:
    config = keyed_gateway_config(
        upstream.url, routes=[route("/", key="required", ttl=f"{SHORT_TTL:g}s", lease="3s")]
    )
    env = {"GATEWAY_DATABASE_URL": postgres_url, **skewed_clock_env(BEHIND)}
    if cache == "redis":
        env["GATEWAY_REDIS_URL"] = redis_url
    behind = GatewayProcess(
        write_config(tmp_path, config.model_dump(mode="json")),
        env=env,
        log_dir=tmp_path,
        startup_timeout=STARTUP_TIMEOUT,
        name="behind",
    )
    key = unique("short-lived")
    try:
        await behind.start()
        async with httpx.AsyncClient(base_url=behind.url, timeout=30.0, trust_env=False) as client:
            original = await send_keyed(client, key)
            replay = await send_keyed(client, key)
            if cache == "redis":
                # Its remaining life as the database counts it, not a minute more.
                ttl_ms = await redis_client.pttl(cache_key(record_key(key)))
                assert 0 < ttl_ms <= SHORT_TTL * 1000 + TTL_SLACK_MS
            await eventually(
                lambda: record_expired(postgres_url, key),
                timeout=SHORT_TTL + 10.0,
                interval=0.2,
                message="the database says the record expired",
            )
            afresh = await send_keyed(client, key)
    finally:
        await behind.stop()
        print(f"--- gateway log tail ---\n{behind.log_tail()}")

    assert (execution_of(replay), is_replay(replay)) == (execution_of(original), True)
    assert not is_replay(afresh), "a gateway behind replayed an expired answer"
    assert execution_of(afresh) != execution_of(original)
    assert upstream.count(key) == 2
