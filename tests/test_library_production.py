"""Library mode in a production app: failures, lifespan, request ids and metrics, markers.

A user's FastAPI app served by uvicorn over loopback on both stores: a handler that raises on
a keyed request gets the app's own 500, stored and replayed to every retry while the server
still logs the exception; ``idempotency_lifespan`` starts the store, sweeps expired records
and closes what it was given; each request gets an ``X-Request-Id`` and the gateway's request
metrics labelled by route; ``Depends(idempotent(...))`` protects one endpoint (or a router's)
with no path prefix given.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Annotated

import pytest
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from prometheus_client import REGISTRY

from idempotency_gateway import (
    Execution,
    IdempotencyConfig,
    IdempotencyMiddleware,
    InProcessCache,
    RecordStore,
    StoreConfig,
    SweeperConfig,
    idempotency_lifespan,
    idempotent,
)
from idempotency_gateway.config import CacheConfig
from idempotency_gateway.idempotency.keys import ANONYMOUS_TENANT
from idempotency_gateway.idempotency.policy import PolicySource
from idempotency_gateway.operations.lifespan import Lifespan
from idempotency_gateway.storage import open_store
from idempotency_gateway.storage.base import Claim
from idempotency_gateway.storage.records import RecordKey, Status
from tests.support import eventually
from tests.support.clock import ManualClock
from tests.support.problems import assert_problem
from tests.test_library_mode import CHARGE, SCOPE_SECRET, charge, serving

CHARGES = "POST /v1/charges"
CHARGE_KEY_REQUIRED = idempotent(IdempotencyConfig(key="required"))
# The sweeper test's store runs in 1998: only its own records are ever expired for it, so
# it never deletes another test's rows on the shared PostgreSQL database.
LONG_AGO = datetime(1998, 1, 1, tzinfo=UTC)


class ChargeFailed(RuntimeError):
    pass


def protected_app(
    store: RecordStore,
    policy: PolicySource | None,
    *,
    cache: InProcessCache | None = None,
    lifespan: Lifespan | None = None,
) -> FastAPI:
    """A user's FastAPI app with the middleware added as the README shows."""
    api = FastAPI(lifespan=lifespan)
    api.add_middleware(
        IdempotencyMiddleware, store=store, policy=policy, cache=cache, scope_secret=SCOPE_SECRET
    )
    return api


def failing_app(store: RecordStore, *, with_handler: bool) -> tuple[FastAPI, list[str]]:
    api = protected_app(store, {"/v1/charges": IdempotencyConfig()})
    runs: list[str] = []

    @api.post("/v1/charges")
    async def create_charge(request: Request) -> dict[str, object]:
        runs.append(request.headers.get("idempotency-key", "-"))
        raise ChargeFailed("the processor said no")

    if with_handler:

        @api.exception_handler(Exception)
        async def on_failure(_request: Request, error: Exception) -> JSONResponse:
            return JSONResponse({"error": type(error).__name__, "run": len(runs)}, 500)

    return api, runs


async def test_a_raising_handler_gives_the_apps_500_to_every_retry(
    store: RecordStore, unique: Callable[[str], str], caplog: pytest.LogCaptureFixture
) -> None:
    api, runs = failing_app(store, with_handler=True)
    key = unique("lib-raises")

    with caplog.at_level(logging.ERROR, logger="uvicorn.error"):
        async with serving(api) as client:
            first = await charge(client, key)
            retry = await charge(client, key)
            keyless = await charge(client, None)

    assert first.status_code == 500
    assert first.json() == {"error": "ChargeFailed", "run": 1}  # the app's own handler
    assert "idempotent-replayed" not in first.headers
    assert retry.status_code == 500
    assert retry.content == first.content
    assert retry.headers["idempotent-replayed"] == "true"
    # Without a key the same handler answers: the key changes nothing about the answer.
    assert keyless.json() == {"error": "ChargeFailed", "run": 2}
    assert runs == [key, "-"]
    record = await store.get(RecordKey(ANONYMOUS_TENANT, CHARGES, key))
    assert record is not None
    assert record.status is Status.FAILED_FINAL
    # The server still logged each failure, the keyed one included.
    logged = [r.exc_info[1] for r in caplog.records if r.exc_info is not None]
    assert [type(error) for error in logged] == [ChargeFailed, ChargeFailed]


async def test_a_raising_handler_without_an_error_handler_gets_starlettes_500(
    store: RecordStore, unique: Callable[[str], str]
) -> None:
    api, runs = failing_app(store, with_handler=False)
    key = unique("lib-raises-plain")

    async with serving(api) as client:
        first = await charge(client, key)
        retry = await charge(client, key)

    assert (first.status_code, first.text) == (500, "Internal Server Error")
    assert (retry.status_code, retry.text) == (500, "Internal Server Error")
    assert retry.headers["idempotent-replayed"] == "true"
    assert runs == [key]


async def test_lifespan_starts_the_store_sweeps_and_closes_the_cache(
    database_url: str, unique: Callable[[str], str]
) -> None:
    clock = ManualClock(now=LONG_AGO)
    store = open_store(database_url, StoreConfig(), clock=clock.utc)
    cache = InProcessCache.sized_by(CacheConfig())
    expired, kept = (RecordKey(ANONYMOUS_TENANT, CHARGES, unique(n)) for n in ("old", "new"))
    for key, ttl in ((expired, 60.0), (kept, 3600.0)):
        claim = Claim("f" * 64, os.urandom(16).hex(), lease=30.0, ttl=ttl)
        assert (await store.reserve(key, claim)).reserved
    clock.advance(61)
    sweeping = idempotency_lifespan(store, cache=cache, sweeper=SweeperConfig(interval=0.05))
    api = protected_app(store, IdempotencyConfig(), cache=cache, lifespan=sweeping)

    @api.post("/v1/charges")
    async def create_charge() -> dict[str, str]:
        return {"id": "ch_1"}

    async def swept() -> bool:
        return await store.get(expired) is None

    try:
        async with serving(api) as client:
            await eventually(swept, message="the sweeper never deleted the expired record")
            assert await store.get(kept) is not None
            answered = await charge(client, unique("lib-lifespan"))
            assert answered.status_code == 200
            assert len(cache) == 1
        assert len(cache) == 0  # closed with the app
    finally:
        await store.close()


def requests_counted(route: str, outcome: str, status_class: str) -> float:
    value = REGISTRY.get_sample_value(
        "idempotency_gateway_requests_total",
        {"route": route, "outcome": outcome, "status_class": status_class},
    )
    return value or 0.0


async def test_requests_get_ids_and_the_gateways_metrics_by_route(
    store: RecordStore, unique: Callable[[str], str]
) -> None:
    api = protected_app(store, {"/v1/charges": IdempotencyConfig(key="required")})

    @api.post("/v1/charges")
    async def create_charge() -> dict[str, str]:
        return {"id": "ch_1"}

    executed = requests_counted("/v1/charges", "executed", "2xx")
    replayed = requests_counted("/v1/charges", "replayed", "2xx")
    key = unique("lib-metrics")
    async with serving(api) as client:
        first = await charge(client, key)
        retry = await charge(client, key, **{"X-Request-Id": "req-from-the-client"})

    assert first.status_code == retry.status_code == 200
    assert first.headers["x-request-id"]
    assert retry.headers["x-request-id"] == "req-from-the-client"
    assert requests_counted("/v1/charges", "executed", "2xx") == executed + 1
    assert requests_counted("/v1/charges", "replayed", "2xx") == replayed + 1


async def test_endpoints_marked_idempotent_are_protected_and_others_are_not(
    store: RecordStore, unique: Callable[[str], str]
) -> None:
    api = protected_app(store, None)
    runs: list[str] = []

    @api.post("/v1/charges")
    async def create_charge(
        execution: Annotated[Execution | None, Depends(CHARGE_KEY_REQUIRED)],
    ) -> dict[str, object]:
        assert execution is not None
        runs.append("charge")
        return {"run": len(runs), "fencing_token": execution.fencing_token}

    @api.post("/v1/refunds")
    async def create_refund() -> dict[str, object]:
        runs.append("refund")
        return {"run": len(runs)}

    payouts = APIRouter(prefix="/v1/payouts", dependencies=[Depends(idempotent())])

    @payouts.post("/{account}")
    async def create_payout(account: str) -> dict[str, object]:
        runs.append(f"payout {account}")
        return {"run": len(runs)}

    api.include_router(payouts)
    transfers = APIRouter()

    @transfers.post("/transfers")
    async def create_transfer() -> dict[str, object]:
        runs.append("transfer")
        return {"run": len(runs)}

    # Marked where it is included, under a prefix of its own.
    api.include_router(transfers, prefix="/v2", dependencies=[Depends(idempotent())])
    key = unique("lib-marked")
    async with serving(api) as client:
        keyless = await charge(client, None)
        charges = [await charge(client, key) for _ in range(2)]
        refunds = [
            await client.post("/v1/refunds", json=CHARGE, headers={"Idempotency-Key": key})
            for _ in range(2)
        ]
        payout = [
            await client.post("/v1/payouts/acct_1", json={}, headers={"Idempotency-Key": key})
            for _ in range(2)
        ]
        transfer = [
            await client.post("/v2/transfers", json={}, headers={"Idempotency-Key": key})
            for _ in range(2)
        ]

    assert_problem(keyless, 400, "idempotency-key-missing")
    assert charges[0].json()["fencing_token"] >= 1
    assert charges[1].content == charges[0].content
    assert charges[1].headers["idempotent-replayed"] == "true"
    assert [refund.json()["run"] for refund in refunds] == [2, 3]  # not protected
    assert payout[1].content == payout[0].content
    assert payout[1].headers["idempotent-replayed"] == "true"
    assert transfer[1].content == transfer[0].content
    assert transfer[1].headers["idempotent-replayed"] == "true"
    assert runs == ["charge", "refund", "refund", "payout acct_1", "transfer"]
    # The marked route's record is named by its path, under the route's own operation.
    record = await store.get(RecordKey(ANONYMOUS_TENANT, "POST /v1/payouts/acct_1", key))
    assert record is not None
    assert record.status is Status.SUCCEEDED
    assert requests_counted("/v1/payouts/{account}", "replayed", "2xx") >= 1
