"""One clock on PostgreSQL: gateways whose host clocks disagree by far more than a lease still
agree on who holds a key, because every lease and expiry is written and judged with the
database's clock.

Two real gateway processes share one database; one runs two minutes in the future under
libfaketime (``scripts/test`` installs it). A duplicate sent to either while the other's
execution is in flight gets 409, never a second execution, and the rows the skewed gateway
writes carry the database's time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import datetime, timedelta
from email.utils import parsedate_to_datetime
from pathlib import Path

import asyncpg
import httpx
import pytest

from idempotency_gateway.config import StoreConfig
from idempotency_gateway.idempotency.store import RecordStore, asyncpg_dsn_of
from tests.support import GatewayProcess, RecordingUpstream, write_config
from tests.support.gateway import route
from tests.support.keyed import keyed_gateway_config, record_key, send_keyed

LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
SKEW = timedelta(minutes=2)
LEASE = 3.0
# Margin for statements and scheduling on a loaded machine; far below the skew.
SLACK = timedelta(seconds=20)


def skewed_env(database_url: str) -> dict[str, str]:
    assert LIBFAKETIME.exists(), "libfaketime is missing: run scripts/test, which installs it"
    return {
        "GATEWAY_DATABASE_URL": database_url,
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME": f"+{int(SKEW.total_seconds())}s",
        # Only the wall clock is skewed; timers and timeouts keep running at the real pace.
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


async def database_now(database_url: str) -> datetime:
    connection = await asyncpg.connect(asyncpg_dsn_of(database_url))
    try:
        now: datetime = await connection.fetchval("SELECT now()")
    finally:
        await connection.close()
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
        config_path, env={"GATEWAY_DATABASE_URL": postgres_url}, log_dir=tmp_path, name="honest"
    )
    ahead = GatewayProcess(
        config_path, env=skewed_env(postgres_url), log_dir=tmp_path, name="ahead"
    )
    store = RecordStore.from_url(postgres_url, StoreConfig())
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
