"""The operator paths meet a database that does not answer the way the request path does:
every driver error becomes ``StoreUnavailable`` (``store_errors``), so the admin API answers a
503 problem with Retry-After and changes nothing, and the background loops degrade instead of
dying. The database is a loopback port nobody listens on: every connect is refused for real.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest
from pydantic import SecretStr

from idempotency_gateway.errors import StoreUnavailable
from idempotency_gateway.main import Gateway, create_gateway
from idempotency_gateway.replay.cache import CachedAnswer, InProcessCache
from idempotency_gateway.storage.records import RecordKey, Status, StoredResponse
from tests.support.gateway import gateway_config, unreachable_database_url
from tests.support.servers import TEST_SCOPE_SECRET, serve_asgi
from tests.support.waiting import eventually

TOKEN = "operator-token-for-tests"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
PROBLEM_JSON = "application/problem+json"
KEY = RecordKey("anonymous", "POST /v1/charges", "operator-store-errors")


@contextlib.asynccontextmanager
async def admin_without_database() -> AsyncIterator[tuple[Gateway, httpx.AsyncClient]]:
    gateway = create_gateway(
        gateway_config("http://127.0.0.1:9"),
        database_url=unreachable_database_url(),
        admin_token=SecretStr(TOKEN),
        scope_secret=SecretStr(TEST_SCOPE_SECRET),
    )
    async with (
        serve_asgi(gateway.admin, lifespan="off") as url,
        httpx.AsyncClient(base_url=url, timeout=10.0, trust_env=False) as client,
    ):
        yield gateway, client
    await gateway.store.close()


def assert_store_unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.headers["content-type"].startswith(PROBLEM_JSON)
    assert response.headers["retry-after"] == "1"
    problem = response.json()
    assert problem["type"].endswith(":store-unavailable"), problem
    assert problem["retryable"] is True


async def test_forcing_a_breaker_without_a_database_is_a_503_and_forces_nothing() -> None:
    async with admin_without_database() as (gateway, admin):
        response = await admin.put(
            "/admin/breakers/primary", json={"state": "forced_open"}, headers=ADMIN
        )
        assert_store_unavailable(response)
        assert gateway.overrides.override_of("primary") is None
        listing = await admin.get("/admin/breakers", headers=ADMIN)
        assert listing.json()[0]["state"] == "closed"


async def test_deleting_a_record_without_a_database_is_a_503() -> None:
    async with admin_without_database() as (_gateway, admin):
        response = await admin.delete(
            "/admin/records",
            params={"operation": KEY.operation, "key": KEY.idempotency_key, "scope": KEY.tenant},
            headers=ADMIN,
        )
        assert_store_unavailable(response)


@pytest.mark.parametrize("loop", ["overrides", "invalidations"])
async def test_the_background_loops_degrade_when_the_database_is_gone(loop: str) -> None:
    async with admin_without_database() as (gateway, _admin):
        assert isinstance(gateway.cache, InProcessCache)
        assert gateway.invalidations is not None
        answer = CachedAnswer(KEY, "hash", Status.SUCCEEDED, StoredResponse(200, [], b"{}"), 2**40)
        await gateway.cache.put(answer)
        if loop == "overrides":
            with pytest.raises(StoreUnavailable):
                await gateway.overrides.sync_once()
            task = asyncio.create_task(gateway.overrides.run())
            degradation = gateway.overrides.degradation
        else:
            with pytest.raises(StoreUnavailable):
                await gateway.invalidations.poll_once()
            task = asyncio.create_task(gateway.invalidations.run())
            degradation = gateway.invalidations.degradation
        try:
            # The loop keeps running (a raw driver error would have ended the task).
            await eventually(lambda: degradation.failures > 0 and not task.done())
            if loop == "invalidations":
                # It cannot know what it missed: the whole per-process cache goes.
                assert await gateway.cache.get(KEY) is None
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
