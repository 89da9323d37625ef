"""``IdempotencyMiddleware`` as a library inside a user's own FastAPI app (contract section 1).

The app is served by uvicorn over loopback with a real store (PostgreSQL and SQLite): replays,
422 and 409, the fencing token handed to the endpoint, an endpoint reporting that it did not
execute, and a ``{path_prefix: policy}`` mapping that leaves other paths alone. The first test
is the README's example, run as written.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request

from idempotency_gateway import IdempotencyConfig, IdempotencyMiddleware, Outcome, RecordStore
from idempotency_gateway.idempotency.keys import ANONYMOUS_TENANT
from idempotency_gateway.storage.base import Claim
from idempotency_gateway.storage.records import RecordKey
from tests.support import serve_asgi
from tests.support.clock import ManualClock
from tests.support.problems import assert_problem
from tests.support.servers import PROJECT_ROOT

# Whole applications served in process: seconds. test_library_production keeps the
# library mode in the fast loop.
pytestmark = pytest.mark.slow

CHARGE = {"amount": 1250, "currency": "eur"}
SCOPE_SECRET = "a long random secret of this deployment"


@contextlib.asynccontextmanager
async def serving(api: FastAPI) -> AsyncIterator[httpx.AsyncClient]:
    """The app served by uvicorn over loopback (lifespan on), and a client for it."""
    async with (
        serve_asgi(api) as url,
        httpx.AsyncClient(base_url=url, timeout=10.0, trust_env=False) as client,
    ):
        yield client


async def test_readme_example_replays_a_retried_charge(
    store: RecordStore, unique: Callable[[str], str]
) -> None:
    # store = open_store(DATABASE_URL, StoreConfig()), on a migrated database
    api = FastAPI()
    api.add_middleware(
        IdempotencyMiddleware,
        store=store,
        policy={"/v1/charges": IdempotencyConfig(key="required")},
        scope_secret=SCOPE_SECRET,
    )
    charges_created: list[str] = []

    @api.post("/v1/charges")
    async def create_charge(request: Request) -> dict[str, object]:
        execution = request.state.idempotency  # key and fencing token of this execution
        charges_created.append(execution.idempotency_key)
        return {"id": f"ch_{len(charges_created)}", "fencing_token": execution.fencing_token}

    key = unique("order-1234-charge")
    async with serving(api) as client:
        first = await client.post("/v1/charges", json=CHARGE, headers={"Idempotency-Key": key})
        retry = await client.post("/v1/charges", json=CHARGE, headers={"Idempotency-Key": key})

    assert first.status_code == 200
    assert first.json()["id"] == "ch_1"
    assert first.json()["fencing_token"] >= 1
    assert retry.status_code == 200
    assert retry.content == first.content
    assert retry.headers["idempotent-replayed"] == "true"
    assert charges_created == [key]  # the endpoint ran once


# ------------------------------------------------------------------ one app for the rest


class ChargesApi:
    """A user's FastAPI app: ``POST /v1/charges`` counts executions, ``/v1/refunds`` too.

    ``hold`` makes the next charge wait for ``release`` (and sets ``arrived``);
    ``not_executed_once`` makes the next charge report ``Outcome.NOT_EXECUTED``.
    """

    def __init__(self, store: RecordStore, policy: Any) -> None:
        self.executions: list[dict[str, Any]] = []
        self.hold = False
        self.arrived = asyncio.Event()
        self.release = asyncio.Event()
        self.not_executed_once = False
        self.app = FastAPI()
        self.app.add_middleware(
            IdempotencyMiddleware, store=store, policy=policy, scope_secret=SCOPE_SECRET
        )
        self.app.post("/v1/charges")(self._create_charge)
        self.app.post("/v1/refunds")(self._create_refund)

    async def _create_charge(self, request: Request) -> dict[str, Any]:
        execution = request.state.idempotency
        seen = {
            "number": len(self.executions) + 1,
            "key": execution.idempotency_key,
            "state_token": execution.fencing_token,
            "header_token": request.headers.get("idempotency-fencing-token"),
            "body": await request.json(),
        }
        self.executions.append(seen)
        if self.hold:
            self.hold = False
            self.arrived.set()
            await self.release.wait()
        if self.not_executed_once:
            self.not_executed_once = False
            # Say, the payment processor answered "not processed": the key may run again.
            execution.report(Outcome.NOT_EXECUTED)
        return seen

    async def _create_refund(self, request: Request) -> dict[str, Any]:
        self.executions.append({"number": len(self.executions) + 1, "path": request.url.path})
        return self.executions[-1]


async def charge(
    client: httpx.AsyncClient, key: str | None, body: Any = None, **headers: str
) -> httpx.Response:
    sent = {"Idempotency-Key": key} if key is not None else {}
    sent.update(headers)
    return await client.post("/v1/charges", json=CHARGE if body is None else body, headers=sent)


async def test_different_body_with_the_same_key_is_422(
    store: RecordStore, unique: Callable[[str], str]
) -> None:
    api = ChargesApi(store, IdempotencyConfig(key="required"))
    key = unique("lib-mismatch")

    async with serving(api.app) as client:
        first = await charge(client, key)
        reused = await charge(client, key, {"amount": 1, "currency": "eur"})

    assert first.status_code == 200
    assert_problem(reused, 422, "idempotency-key-reused")
    assert len(api.executions) == 1


async def test_duplicate_while_the_endpoint_runs_is_409_then_replayed(
    store: RecordStore, unique: Callable[[str], str]
) -> None:
    api = ChargesApi(store, IdempotencyConfig(key="required"))
    api.hold = True
    key = unique("lib-in-flight")

    async with serving(api.app) as client:
        first = asyncio.create_task(charge(client, key))
        await asyncio.wait_for(api.arrived.wait(), 10)
        duplicate = await charge(client, key)
        api.release.set()
        original = await first
        replay = await charge(client, key)

    problem = assert_problem(duplicate, 409, "request-in-flight")
    assert duplicate.headers["retry-after"] == "1"
    assert problem["retryable"] is True
    assert original.status_code == 200
    assert replay.content == original.content
    assert replay.headers["idempotent-replayed"] == "true"
    assert len(api.executions) == 1


async def test_endpoint_sees_the_fencing_token_in_header_and_state(
    store: RecordStore, unique: Callable[[str], str]
) -> None:
    api = ChargesApi(store, IdempotencyConfig(key="required"))
    key = unique("lib-token")

    async with serving(api.app) as client:
        # A token the client makes up never reaches the endpoint.
        response = await charge(client, key, **{"Idempotency-Fencing-Token": "0"})

    assert response.status_code == 200
    [seen] = api.executions
    assert seen["key"] == key
    # The store's token in both places, never the client's forgery.
    assert seen["header_token"] == str(seen["state_token"])
    assert seen["state_token"] >= 1


async def test_endpoint_confirming_its_lease_after_a_takeover_does_nothing(
    store: RecordStore, clock: ManualClock, unique: Callable[[str], str]
) -> None:
    api = FastAPI()
    api.add_middleware(
        IdempotencyMiddleware,
        store=store,
        policy=IdempotencyConfig(key="required"),
        scope_secret=SCOPE_SECRET,
    )
    arrived, release = asyncio.Event(), asyncio.Event()
    side_effects: list[str] = []

    @api.post("/v1/charges")
    async def create_charge(request: Request) -> dict[str, object]:
        execution = request.state.idempotency
        arrived.set()
        await release.wait()
        await execution.confirm(fresh=True)  # after its own pause: always asks the database
        side_effects.append(execution.idempotency_key)
        return {"id": "ch_1"}

    key = unique("lib-confirm")
    async with serving(api) as client:
        first = asyncio.create_task(charge(client, key))
        await arrived.wait()
        record_key = RecordKey(ANONYMOUS_TENANT, "POST /v1/charges", key)
        held = await store.get(record_key)
        assert held is not None
        clock.advance(IdempotencyConfig().lease + 1)  # the owner stalled past its lease
        claim = Claim(held.request_hash, "another-owner", lease=30.0, ttl=3600.0)
        taken = await store.take_over(held, claim)
        assert taken is not None
        release.set()
        answer = await first

    assert side_effects == []
    # The taker's record stands; the stalled owner's client is told to ask again.
    assert_problem(answer, 409, "request-in-flight")
    assert await store.get(record_key) == taken


async def test_endpoint_reporting_not_executed_leaves_the_key_executable(
    store: RecordStore, unique: Callable[[str], str]
) -> None:
    api = ChargesApi(store, IdempotencyConfig(key="required"))
    api.not_executed_once = True
    key = unique("lib-not-executed")

    async with serving(api.app) as client:
        first = await charge(client, key)
        retry = await charge(client, key)
        replay = await charge(client, key)

    assert first.status_code == 200  # the answer was fine, but nothing happened
    assert retry.status_code == 200
    assert "idempotent-replayed" not in retry.headers
    first_token, second_token = (seen["state_token"] for seen in api.executions)
    assert first_token < second_token
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.content == retry.content
    assert len(api.executions) == 2


async def test_policy_mapping_protects_only_its_prefix(
    store: RecordStore, unique: Callable[[str], str]
) -> None:
    api = ChargesApi(store, {"/v1/charges": IdempotencyConfig(key="required")})
    key = unique("lib-mapping")

    async with serving(api.app) as client:
        refunds = [
            await client.post("/v1/refunds", json={}, headers={"Idempotency-Key": key})
            for _ in range(2)
        ]
        keyless_charge = await charge(client, None)

    assert [refund.status_code for refund in refunds] == [200, 200]
    assert [refund.json()["number"] for refund in refunds] == [1, 2]
    assert all("idempotent-replayed" not in refund.headers for refund in refunds)
    assert_problem(keyless_charge, 400, "idempotency-key-missing")
    assert len(api.executions) == 2


def test_the_library_loads_no_server_redis_or_client_package() -> None:
    """What the base install leaves out is never imported by the middleware's path, so that
    path runs without those extras (tests/test_package.py runs it on the base install alone;
    asyncpg is imported when present, for its error classes)."""
    program = (
        "import sys\n"
        "from idempotency_gateway import (IdempotencyMiddleware, InProcessCache, RecordStore,\n"
        "    RedisCache, idempotency_lifespan, idempotent, upgrade_to_head)\n"
        "extras = ('redis', 'uvicorn', 'uvloop', 'httptools', 'fastapi', 'httpx', 'aiohttp')\n"
        "print(sorted(name for name in extras if name in sys.modules))\n"
    )

    loaded = subprocess.run(
        [sys.executable, "-c", program],
        # The checkout's own package, however the test run put it on the path.
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )

    assert loaded.stdout.strip() == "[]"
