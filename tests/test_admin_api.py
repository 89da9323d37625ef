"""The operator API on the admin listener does what contract section 8 promises.

Proves that every ``/admin`` endpoint answers only the right bearer token (401 problems with
``WWW-Authenticate: Bearer`` otherwise, and a 404 problem saying the API is off when no token
is configured) while health, readiness and metrics stay open; that a record is found by its
scope hash or by the client's raw credential (which never comes back), with the stored body on
request; that deleting or expiring a record really lets its key execute again, Redis entry
included; that an owner killed mid-flight shows up as stuck once its lease ran out; that
breakers are listed with their counts, forced open (503, no upstream call) and back to normal,
on every gateway sharing the database; and that a real ``serve`` process keeps the admin API
and its OpenAPI docs on the admin port only.

Most tests run the gateway in the test's loop and serve its admin app (``gateway.admin``) on a
second loopback port; the multi-process ones run ``idempotency-gateway serve``. Forced breakers
are shared through PostgreSQL by every gateway, so each test forces only an upstream with a
name of its own and the ``payments`` fixture removes that override afterwards.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio
from pydantic import SecretStr
from sqlalchemy import delete, inspect

from idempotency_gateway.config import ADMIN_TOKEN_ENV, ConfigError, GatewayConfig
from idempotency_gateway.idempotency.keys import key_hash
from idempotency_gateway.main import Gateway, create_gateway
from idempotency_gateway.replay.cache import cache_key
from idempotency_gateway.replay.redis_adapter import INVALIDATED
from idempotency_gateway.storage.schema import breaker_overrides
from tests.support import (
    GatewayProcess,
    RecordingUpstream,
    eventually,
    free_port,
    serve_asgi,
    write_config,
)
from tests.support.charges import CHARGE, CHARGES
from tests.support.database import on_database
from tests.support.gateway import CLI_SERVER_OPTIONS, gateway_config, route
from tests.support.keyed import (
    AUTHORIZATION,
    is_replay,
    keyed_gateway_config,
    record_key,
    send_keyed,
)
from tests.support.problems import assert_problem
from tests.support.raw_http import exchange, request_bytes
from tests.support.servers import TEST_SCOPE_SECRET
from tests.support.upstream import BEHAVIOR_HEADER

# Many gateways with an admin listener: seconds. The fast loop keeps the admin API in
# test_operator_store_errors and test_admin_docs_offline.
pytestmark = pytest.mark.slow

TOKEN = "admin-token-for-tests"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
OPERATION = f"POST {CHARGES}"
ADMIN_PATHS = {
    "/healthz",
    "/readyz",
    "/metrics",
    "/admin/records",
    "/admin/records/stuck",
    "/admin/records/by-key",
    "/admin/records/expire",
    "/admin/breakers",
    "/admin/breakers/{upstream}",
}


# ----------------------------------------------------------------------------- helpers


@dataclass(frozen=True)
class AdminGateway:
    app: Gateway
    proxy: httpx.AsyncClient
    admin: httpx.AsyncClient
    """The admin listener; sends no credentials unless the call adds ``ADMIN``."""


@contextlib.asynccontextmanager
async def serve_with_admin(
    config: GatewayConfig,
    *,
    database_url: str,
    redis_url: str | None = None,
    token: str | None = TOKEN,
    override_sync_interval: float | None = None,
) -> AsyncIterator[AdminGateway]:
    """The gateway (lifespan on: override sync and sweeper run) on one loopback port and its
    admin app on another."""
    gateway = create_gateway(
        config,
        database_url=database_url,
        redis_url=redis_url,
        admin_token=SecretStr(token) if token is not None else None,
        scope_secret=SecretStr(TEST_SCOPE_SECRET),
    )
    if override_sync_interval is not None:
        gateway.overrides.interval = override_sync_interval
    async with (
        serve_asgi(gateway, **CLI_SERVER_OPTIONS) as proxy_url,
        serve_asgi(gateway.admin, lifespan="off") as admin_url,
        httpx.AsyncClient(base_url=proxy_url, timeout=10.0, trust_env=False) as proxy,
        httpx.AsyncClient(base_url=admin_url, timeout=10.0, trust_env=False) as admin,
    ):
        yield AdminGateway(gateway, proxy, admin)


def payments_config(upstream_url: str, payments: str) -> GatewayConfig:
    """Route ``/`` (key required) to the upstream named ``payments``, one attempt a request."""
    return keyed_gateway_config(
        upstream_url,
        upstreams={payments: {"url": upstream_url, "retry": {"max_attempts": 1}}},
        routes=[route("/", upstream=payments, key="required")],
    )


def by_scope(key: str, **extra: Any) -> dict[str, Any]:
    """Query parameters naming the record of a ``send_keyed`` request by its scope hash."""
    return {"operation": OPERATION, "key": key, "scope": record_key(key).tenant, **extra}


def by_credential(key: str, **extra: Any) -> dict[str, Any]:
    return {"operation": OPERATION, "key": key, **extra}


def breaker_named(listing: httpx.Response, name: str) -> dict[str, Any]:
    assert listing.status_code == 200, listing.text
    (view,) = [view for view in listing.json() if view["name"] == name]
    return dict(view)


async def breaker_state(gateway: AdminGateway, name: str) -> str:
    return str(
        breaker_named(await gateway.admin.get("/admin/breakers", headers=ADMIN), name)["state"]
    )


async def charge(gateway: AdminGateway) -> httpx.Response:
    """A keyed charge with a key never used before."""
    return await send_keyed(gateway.proxy, f"charge-{uuid.uuid4().hex}")


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture
async def payments(postgres_url: str) -> AsyncIterator[str]:
    """An upstream name of this test's own; any override forced on it is removed at the end,
    so no other test's gateway ever sees it."""
    name = f"payments-{uuid.uuid4().hex[:12]}"
    yield name
    await on_database(
        postgres_url,
        lambda connection: connection.execute(
            delete(breaker_overrides).where(breaker_overrides.c.upstream == name)
        ),
    )


@pytest.fixture
async def gateway(
    upstream: RecordingUpstream, payments: str, postgres_url: str
) -> AsyncIterator[AdminGateway]:
    async with serve_with_admin(
        payments_config(upstream.url, payments), database_url=postgres_url
    ) as served:
        yield served


# ------------------------------------------------------------------------------ tokens


@dataclass(frozen=True)
class AdminCall:
    method: str
    path: str
    needs_record: bool = False
    json: dict[str, Any] | None = None


ADMIN_CALLS = {
    "get-record": AdminCall("GET", "/admin/records", needs_record=True),
    "list-stuck": AdminCall("GET", "/admin/records/stuck"),
    "find-by-key": AdminCall("GET", "/admin/records/by-key", needs_record=True),
    "delete-record": AdminCall("DELETE", "/admin/records", needs_record=True),
    "expire-record": AdminCall("POST", "/admin/records/expire", needs_record=True),
    "list-breakers": AdminCall("GET", "/admin/breakers"),
    "force-breaker": AdminCall("PUT", "/admin/breakers/{payments}", json={"state": "normal"}),
}
WRONG_CREDENTIALS = {
    "wrong token": f"Bearer {TOKEN}-wrong",
    "token without scheme": TOKEN,
    "other scheme": f"Basic {TOKEN}",
    "token prefix": f"Bearer {TOKEN[:-1]}",
    "scheme alone": "Bearer",
    "token glued to the scheme": f"Bearer{TOKEN}",
}
# RFC 9110 section 11.1: the scheme is case-insensitive, and one or more spaces follow it.
RIGHT_CREDENTIALS = [f"bearer {TOKEN}", f"BEARER {TOKEN}", f"bEaReR {TOKEN}", f"Bearer   {TOKEN}"]


async def call_admin(
    gateway: AdminGateway, call: AdminCall, key: str, payments: str, headers: dict[str, str]
) -> httpx.Response:
    return await gateway.admin.request(
        call.method,
        call.path.format(payments=payments),
        params=by_scope(key) if call.needs_record else None,
        json=call.json,
        headers=headers,
    )


async def test_every_admin_endpoint_answers_only_the_right_bearer_token(
    gateway: AdminGateway, payments: str, unique: Callable[[str], str]
) -> None:
    for name, call in ADMIN_CALLS.items():
        key = unique(f"auth-{name}")
        assert (await send_keyed(gateway.proxy, key)).status_code == 201
        before = await gateway.app.store.get(record_key(key))

        missing = await call_admin(gateway, call, key, payments, headers={})
        assert_problem(missing, 401, "unauthorized", name)
        assert missing.headers["WWW-Authenticate"] == "Bearer", name
        for credential in WRONG_CREDENTIALS.values():
            wrong = await call_admin(gateway, call, key, payments, {"Authorization": credential})
            assert_problem(wrong, 401, "unauthorized", f"{name} with {credential!r}")
            assert wrong.headers["WWW-Authenticate"] == "Bearer", name
        # Refused calls changed nothing.
        assert await gateway.app.store.get(record_key(key)) == before, name

        allowed = await call_admin(gateway, call, key, payments, ADMIN)
        assert allowed.status_code == 200, (name, allowed.text)


async def test_the_bearer_scheme_is_accepted_in_any_case(gateway: AdminGateway) -> None:
    for credential in RIGHT_CREDENTIALS:
        answer = await gateway.admin.get("/admin/breakers", headers={"Authorization": credential})
        assert answer.status_code == 200, (credential, answer.text)


@pytest.mark.parametrize("token", ["", " ", "short-token-15ch"[:15]])
def test_an_empty_or_short_admin_token_is_refused_naming_the_variable(
    token: str, postgres_url: str
) -> None:
    with pytest.raises(ConfigError, match=ADMIN_TOKEN_ENV):
        create_gateway(
            gateway_config("http://127.0.0.1:9"),
            database_url=postgres_url,
            admin_token=SecretStr(token),
            scope_secret=SecretStr(TEST_SCOPE_SECRET),
        )


async def test_admin_api_is_off_and_says_so_without_a_configured_token(
    upstream: RecordingUpstream, payments: str, postgres_url: str, unique: Callable[[str], str]
) -> None:
    config = payments_config(upstream.url, payments)
    async with serve_with_admin(config, database_url=postgres_url, token=None) as gateway:
        key = unique("off")
        assert (await send_keyed(gateway.proxy, key)).status_code == 201

        for name, call in ADMIN_CALLS.items():
            for headers in ({}, ADMIN):
                answer = await call_admin(gateway, call, key, payments, headers)
                problem = assert_problem(answer, 404, "admin-api-off", name)
                assert "GATEWAY_ADMIN_TOKEN" in problem["detail"]
        assert (await gateway.admin.get("/healthz")).status_code == 200
        assert await gateway.app.store.get(record_key(key)) is not None


async def test_health_readiness_and_metrics_need_no_token(gateway: AdminGateway) -> None:
    health = await gateway.admin.get("/healthz")
    ready = await gateway.admin.get("/readyz")
    metrics = await gateway.admin.get("/metrics")

    assert health.status_code == 200
    assert health.json() == {"status": "ok"}
    assert ready.status_code == 200
    assert ready.json()["store"] == "ok"
    assert metrics.status_code == 200
    assert metrics.headers["content-type"].startswith("text/plain")
    assert "idempotency_gateway_requests_total" in metrics.text


# ----------------------------------------------------------------------------- records


@pytest.fixture
async def records_gateway(
    upstream: RecordingUpstream, payments: str, database_url: str
) -> AsyncIterator[AdminGateway]:
    """The admin gateway on each store (PostgreSQL and SQLite)."""
    async with serve_with_admin(
        payments_config(upstream.url, payments), database_url=database_url
    ) as served:
        yield served


async def test_record_is_found_by_scope_hash_and_by_raw_credential(
    records_gateway: AdminGateway, unique: Callable[[str], str]
) -> None:
    key = unique("lookup")
    answer = await send_keyed(records_gateway.proxy, key)
    assert answer.status_code == 201

    by_hash = await records_gateway.admin.get("/admin/records", params=by_scope(key), headers=ADMIN)
    by_secret = await records_gateway.admin.get(
        "/admin/records",
        params=by_credential(key),
        headers={**ADMIN, "X-Scope-Credential": AUTHORIZATION},
    )

    assert by_hash.status_code == 200, by_hash.text
    assert by_secret.status_code == 200, by_secret.text
    view = by_hash.json()
    assert by_secret.json() == view
    assert view["scope"] == record_key(key).tenant
    assert view["operation"] == OPERATION
    assert view["idempotency_key"] == key
    assert view["status"] == "SUCCEEDED"
    assert view["attempts"] == 1
    assert view["fencing_token"] >= 1
    assert view["response"]["status"] == 201
    assert view["response"]["body_size"] == len(answer.content)
    assert view["response"]["body_omitted"] is False
    assert view["response"]["body_base64"] is None
    # The credential is hashed, never echoed.
    secret = AUTHORIZATION.removeprefix("Bearer ")
    assert secret not in by_secret.text
    assert secret not in by_hash.text


async def test_a_key_is_found_in_every_scope_and_operation_it_was_used_in(
    records_gateway: AdminGateway, unique: Callable[[str], str]
) -> None:
    key = unique("by-key")
    other_client = {"Idempotency-Key": key, "Authorization": f"Bearer sk_{uuid.uuid4().hex}"}
    sent = [
        await send_keyed(records_gateway.proxy, key),
        await records_gateway.proxy.post(CHARGES, json=CHARGE, headers=other_client),
        await send_keyed(records_gateway.proxy, key, path="/v1/refunds"),
        await send_keyed(records_gateway.proxy, unique("by-key-other")),
    ]
    assert [answer.status_code for answer in sent] == [201] * 4

    async def by_key(**params: Any) -> list[dict[str, Any]]:
        answer = await records_gateway.admin.get(
            "/admin/records/by-key", params=params, headers=ADMIN
        )
        assert answer.status_code == 200, answer.text
        return list(answer.json())

    everywhere = await by_key(key=key)
    charges = await by_key(key=key, operation=OPERATION)
    one = await by_key(key=key, limit=1)
    unknown = await by_key(key=unique("never-sent"))

    mine = record_key(key).tenant
    assert sorted((match["scope"] == mine, match["operation"]) for match in everywhere) == [
        (False, OPERATION),
        (True, OPERATION),
        (True, "POST /v1/refunds"),
    ]
    assert len({match["scope"] for match in everywhere}) == 2
    assert {match["key_hash"] for match in everywhere} == {key_hash(key)}
    assert {match["status"] for match in everywhere} == {"SUCCEEDED"}
    assert all(match["created_at"] <= match["expires_at"] for match in everywhere)
    assert "idempotency_key" not in everywhere[0]
    assert {match["operation"] for match in charges} == {OPERATION}
    assert len(charges) == 2
    assert len(one) == 1
    assert one[0] in everywhere
    assert unknown == []
    # Found through an index, not a scan of every scope.
    indexes = await on_database(
        records_gateway.app.database_url,
        lambda connection: inspect(connection).get_indexes("idempotency_records"),
    )
    assert ["idempotency_key"] in [index["column_names"] for index in indexes]


@pytest.mark.parametrize(
    "params",
    [{"key": ""}, {"key": "k" * 256}, {"key": "k", "limit": "0"}, {"key": "k", "limit": "1001"}],
)
async def test_a_lookup_by_key_out_of_bounds_is_a_422_problem(
    records_gateway: AdminGateway, params: dict[str, str]
) -> None:
    answer = await records_gateway.admin.get("/admin/records/by-key", params=params, headers=ADMIN)
    assert_problem(answer, 422, "invalid-admin-request")


async def test_record_lookup_returns_the_stored_body_on_request(
    records_gateway: AdminGateway, unique: Callable[[str], str]
) -> None:
    key = unique("lookup-body")
    answer = await send_keyed(records_gateway.proxy, key)

    found = await records_gateway.admin.get(
        "/admin/records", params=by_scope(key, include_body="true"), headers=ADMIN
    )

    assert found.status_code == 200, found.text
    assert base64.b64decode(found.json()["response"]["body_base64"]) == answer.content


RECORD_CALLS = {
    "get": ("GET", "/admin/records"),
    "delete": ("DELETE", "/admin/records"),
    "expire": ("POST", "/admin/records/expire"),
}


async def test_record_calls_answer_404_for_an_unknown_key(
    records_gateway: AdminGateway, unique: Callable[[str], str]
) -> None:
    for name, (method, path) in RECORD_CALLS.items():
        unknown = await records_gateway.admin.request(
            method, path, params=by_scope(unique("never-sent")), headers=ADMIN
        )

        assert_problem(unknown, 404, "not-found", name)


async def test_record_calls_need_exactly_one_form_of_scope(
    records_gateway: AdminGateway, unique: Callable[[str], str]
) -> None:
    key = unique("one-scope")
    await send_keyed(records_gateway.proxy, key)
    before = await records_gateway.app.store.get(record_key(key))

    for name, (method, path) in RECORD_CALLS.items():
        both = await records_gateway.admin.request(
            method,
            path,
            params=by_scope(key),
            headers={**ADMIN, "X-Scope-Credential": AUTHORIZATION},
        )
        neither = await records_gateway.admin.request(
            method, path, params=by_credential(key), headers=ADMIN
        )

        for answer in (both, neither):
            problem = assert_problem(answer, 422, "invalid-admin-request", name)
            assert "X-Scope-Credential" in problem["detail"], name
    assert await records_gateway.app.store.get(record_key(key)) == before


REMOVALS = {
    "delete": ("DELETE", "/admin/records", {"deleted": True}),
    "expire": ("POST", "/admin/records/expire", {"expired": True}),
}


async def remove_and_run_again(
    gateway: AdminGateway,
    upstream: RecordingUpstream,
    key: str,
    removal: tuple[str, str, dict[str, bool]],
    between: Callable[[], Any] | None = None,
) -> None:
    """Execute ``key``, see it replayed, remove it through the admin API, then see the same
    request execute a second time (and replay that second answer)."""
    method, path, expected = removal
    first = await send_keyed(gateway.proxy, key)
    replay = await send_keyed(gateway.proxy, key)
    assert first.status_code == 201
    assert is_replay(replay)
    assert upstream.count(key) == 1

    removed = await gateway.admin.request(method, path, params=by_scope(key), headers=ADMIN)

    assert removed.status_code == 200, removed.text
    assert removed.json() == expected
    if between is not None:
        await between()
    again = await send_keyed(gateway.proxy, key)
    assert again.status_code == 201
    assert not is_replay(again)
    assert again.json()["execution"] != first.json()["execution"]
    assert upstream.count(key) == 2
    assert is_replay(await send_keyed(gateway.proxy, key))
    assert upstream.count(key) == 2


@pytest.mark.parametrize("removal", REMOVALS.values(), ids=REMOVALS.keys())
async def test_removed_record_lets_its_key_execute_again(
    records_gateway: AdminGateway,
    upstream: RecordingUpstream,
    removal: tuple[str, str, dict[str, bool]],
    unique: Callable[[str], str],
) -> None:
    await remove_and_run_again(records_gateway, upstream, unique("removed"), removal)


@pytest.mark.parametrize("removal", REMOVALS)
async def test_a_record_in_flight_is_not_removed_under_its_owner(
    records_gateway: AdminGateway,
    upstream: RecordingUpstream,
    removal: str,
    unique: Callable[[str], str],
) -> None:
    """Removed while its owner's attempt is upstream, the record would let a duplicate
    execute beside it. Refused (409) while the lease is live: the key executes once."""
    method, path, _ = REMOVALS[removal]
    key, gate = unique("in-flight"), unique("gate")
    owner = asyncio.create_task(send_keyed(records_gateway.proxy, key, behavior=f"gate={gate}"))
    try:
        await upstream.wait_arrived(gate)

        refused = await records_gateway.admin.request(
            method, path, params=by_scope(key), headers=ADMIN
        )
        duplicate = await send_keyed(records_gateway.proxy, key)
    finally:
        upstream.release(gate)
    first = await owner

    problem = assert_problem(refused, 409, "record-in-flight")
    assert "lease" in problem["detail"]
    assert_problem(duplicate, 409, "request-in-flight")
    assert first.status_code == 201
    assert upstream.count(key) == 1
    assert is_replay(await send_keyed(records_gateway.proxy, key))
    # Once settled, the record is the operator's to remove.
    removed = await records_gateway.admin.request(method, path, params=by_scope(key), headers=ADMIN)
    assert removed.status_code == 200, removed.text


async def test_expired_record_stays_readable_until_it_runs_again(
    records_gateway: AdminGateway, unique: Callable[[str], str]
) -> None:
    key = unique("expired-readable")
    await send_keyed(records_gateway.proxy, key)

    expired = await records_gateway.admin.post(
        "/admin/records/expire", params=by_scope(key), headers=ADMIN
    )
    found = await records_gateway.admin.get("/admin/records", params=by_scope(key), headers=ADMIN)

    assert expired.status_code == 200
    assert found.status_code == 200
    assert found.json()["status"] == "SUCCEEDED"
    assert datetime.fromisoformat(found.json()["expires_at"]) <= datetime.now(UTC)


@pytest.mark.parametrize("removal", REMOVALS.values(), ids=REMOVALS.keys())
async def test_a_removal_redis_cannot_take_changes_nothing_so_a_retry_is_safe(
    upstream: RecordingUpstream,
    payments: str,
    postgres_url: str,
    removal: tuple[str, str, dict[str, bool]],
    unique: Callable[[str], str],
) -> None:
    """The cache entry goes first or nothing changes: a 503 that followed a change invited a
    retry that changed the record again, after retried requests had already executed it anew
    (one expire meant, three executions had)."""
    method, path, _ = removal
    key = unique("redis-down-removal")
    config = payments_config(upstream.url, payments)
    unreachable = f"redis://127.0.0.1:{free_port()}/0"
    async with serve_with_admin(
        config, database_url=postgres_url, redis_url=unreachable
    ) as gateway:
        await send_keyed(gateway.proxy, key)
        before = await gateway.app.store.get(record_key(key))

        for _ in range(3):  # the operator retries, as the problem says
            refused = await gateway.admin.request(method, path, params=by_scope(key), headers=ADMIN)
            problem = assert_problem(refused, 503, "cache-unavailable")
            assert "nothing was changed" in problem["detail"]

        assert await gateway.app.store.get(record_key(key)) == before
        assert is_replay(await send_keyed(gateway.proxy, key))
        assert upstream.count(key) == 1


@pytest.mark.parametrize("removal", REMOVALS.values(), ids=REMOVALS.keys())
async def test_removed_record_loses_its_redis_entry_too(
    upstream: RecordingUpstream,
    payments: str,
    postgres_url: str,
    redis_url: str,
    redis_client: redis.asyncio.Redis,
    removal: tuple[str, str, dict[str, bool]],
    unique: Callable[[str], str],
) -> None:
    key = unique("removed-redis")
    entry = cache_key(record_key(key))
    config = payments_config(upstream.url, payments)

    async def redis_entry_is_gone() -> None:
        # The answer is out; the marker in its place keeps a late replay from putting it back.
        assert await redis_client.get(entry) == INVALIDATED

    async with serve_with_admin(config, database_url=postgres_url, redis_url=redis_url) as gateway:
        await send_keyed(gateway.proxy, key)
        await eventually(lambda: redis_client.exists(entry), message="the answer is cached")

        await remove_and_run_again(gateway, upstream, key, removal, between=redis_entry_is_gone)


# ------------------------------------------------------------------------------ stuck


@pytest.mark.multiprocess
async def test_owner_killed_mid_flight_is_listed_as_stuck_once_its_lease_ran_out(
    tmp_path: Path,
    upstream: RecordingUpstream,
    payments: str,
    postgres_url: str,
    unique: Callable[[str], str],
) -> None:
    key = unique("stuck")
    config = keyed_gateway_config(upstream.url, routes=[route("/", key="required", lease="1s")])
    owner = GatewayProcess(
        write_config(tmp_path, config.model_dump(mode="json")),
        env={"GATEWAY_DATABASE_URL": postgres_url},
        log_dir=tmp_path,
        name="owner",
    )

    async def stuck_keys(gateway: AdminGateway) -> list[dict[str, Any]]:
        listing = await gateway.admin.get(
            "/admin/records/stuck", params={"limit": 1000}, headers=ADMIN
        )
        assert listing.status_code == 200, listing.text
        return [view for view in listing.json() if view["idempotency_key"] == key]

    async with (
        serve_with_admin(
            payments_config(upstream.url, payments), database_url=postgres_url
        ) as operator,
        owner,
        httpx.AsyncClient(base_url=owner.url, timeout=10.0, trust_env=False) as client,
    ):
        request = asyncio.create_task(
            client.post(
                CHARGES,
                json=CHARGE,
                headers={
                    "Authorization": AUTHORIZATION,
                    "Idempotency-Key": key,
                    BEHAVIOR_HEADER: "gate=stuck",
                },
            )
        )
        await upstream.wait_arrived("stuck")
        await owner.kill()
        with pytest.raises(httpx.TransportError):
            await request

        (stuck,) = await eventually(
            lambda: stuck_keys(operator), timeout=10.0, message="the record is listed as stuck"
        )

    assert stuck["status"] == "IN_PROGRESS"
    assert stuck["scope"] == record_key(key).tenant
    assert stuck["fencing_token"] >= 1
    assert datetime.fromisoformat(stuck["lease_expires_at"]) <= datetime.now(UTC)
    assert upstream.count(key) == 1


# ----------------------------------------------------------------------------- breakers


async def test_breakers_are_listed_with_state_and_counts(
    gateway: AdminGateway, payments: str, unique: Callable[[str], str]
) -> None:
    idle = await gateway.admin.get("/admin/breakers", headers=ADMIN)
    assert {view["name"] for view in idle.json()} == {payments, "primary"}
    assert breaker_named(idle, payments) == {
        "name": payments,
        "state": "closed",
        "calls": 0,
        "failures": 0,
        "slow_calls": 0,
        "override": None,
    }

    for _ in range(2):
        assert (await charge(gateway)).status_code == 201
    failed = await send_keyed(gateway.proxy, unique("unavailable"), behavior="status=503")
    assert failed.status_code == 503

    busy = breaker_named(await gateway.admin.get("/admin/breakers", headers=ADMIN), payments)
    assert (busy["state"], busy["calls"], busy["failures"]) == ("closed", 3, 1)


async def test_forced_open_breaker_refuses_without_calling_the_upstream_until_normal(
    gateway: AdminGateway, upstream: RecordingUpstream, payments: str
) -> None:
    forced = await gateway.admin.put(
        f"/admin/breakers/{payments}", json={"state": "forced_open"}, headers=ADMIN
    )
    assert forced.status_code == 200, forced.text
    assert (forced.json()["state"], forced.json()["override"]) == ("forced_open", "forced_open")

    refused = await charge(gateway)
    problem = assert_problem(refused, 503, "circuit-open")
    assert problem["retryable"] is True
    assert refused.headers["Retry-After"]
    assert upstream.total == 0

    normal = await gateway.admin.put(
        f"/admin/breakers/{payments}", json={"state": "normal"}, headers=ADMIN
    )
    assert normal.status_code == 200, normal.text
    assert (normal.json()["state"], normal.json()["override"]) == ("closed", None)
    assert (await charge(gateway)).status_code == 201
    assert upstream.total == 1


async def test_forced_breaker_reaches_every_gateway_sharing_the_database(
    gateway: AdminGateway, upstream: RecordingUpstream, payments: str, postgres_url: str
) -> None:
    config = payments_config(upstream.url, payments)
    # Syncing faster than the default 2 s only makes the test quicker: what it shows is that
    # the override travels through the database.
    async with serve_with_admin(
        config, database_url=postgres_url, override_sync_interval=0.2
    ) as other:

        async def set_here_and_wait_until_other_reports(state: str, reported: str) -> None:
            """PUT the override on ``gateway`` only; ``other`` learns it from the database."""
            answer = await gateway.admin.put(
                f"/admin/breakers/{payments}", json={"state": state}, headers=ADMIN
            )
            assert answer.status_code == 200

            async def other_reports_it() -> bool:
                return await breaker_state(other, payments) == reported

            await eventually(other_reports_it, timeout=10.0, interval=0.1)

        await set_here_and_wait_until_other_reports("forced_open", reported="forced_open")
        assert_problem(await charge(other), 503, "circuit-open")
        assert upstream.total == 0

        await set_here_and_wait_until_other_reports("normal", reported="closed")
        assert (await charge(other)).status_code == 201
        assert upstream.total == 1


async def test_breaker_commands_are_validated(gateway: AdminGateway, payments: str) -> None:
    unknown = await gateway.admin.put(
        f"/admin/breakers/{payments}-unknown", json={"state": "forced_open"}, headers=ADMIN
    )
    sideways = await gateway.admin.put(
        f"/admin/breakers/{payments}", json={"state": "sideways"}, headers=ADMIN
    )
    automatic = await gateway.admin.put(
        f"/admin/breakers/{payments}", json={"state": "open"}, headers=ADMIN
    )
    no_body = await gateway.admin.put(f"/admin/breakers/{payments}", headers=ADMIN)

    assert_problem(unknown, 404, "not-found")
    for invalid in (sideways, automatic, no_body):
        assert_problem(invalid, 422, "invalid-admin-request")
    assert "state" in sideways.json()["detail"]
    assert await breaker_state(gateway, payments) == "closed"


# ------------------------------------------------------------------ the real listener


@pytest.mark.multiprocess
async def test_served_gateway_keeps_admin_api_and_docs_on_the_admin_port(
    tmp_path: Path, upstream: RecordingUpstream, payments: str, postgres_url: str
) -> None:
    config = payments_config(upstream.url, payments).model_dump(mode="json")
    process = GatewayProcess(
        write_config(tmp_path, config),
        env={"GATEWAY_DATABASE_URL": postgres_url, "GATEWAY_ADMIN_TOKEN": TOKEN},
        log_dir=tmp_path,
    )
    async with process, httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        schema = await client.get(process.admin_url + "/openapi.json")
        docs = await client.get(process.admin_url + "/docs")
        breakers = await client.get(process.admin_url + "/admin/breakers", headers=ADMIN)
        refused = await client.get(process.admin_url + "/admin/breakers")
        # On the proxy port the same path is just another request for the upstream.
        proxied = await client.get(process.url + "/admin/breakers", headers=ADMIN)

    assert schema.status_code == 200
    assert ADMIN_PATHS.issubset(schema.json()["paths"])
    assert docs.status_code == 200
    assert docs.headers["content-type"].startswith("text/html")
    assert "/openapi.json" in docs.text
    assert breaker_named(breakers, payments)["state"] == "closed"
    assert refused.status_code == 401
    assert proxied.status_code == 201
    assert [execution.path for execution in upstream.executions] == ["/admin/breakers"]


# ------------------------------------------------------------------- errors are problems


@pytest.mark.parametrize(
    ("method", "path", "status", "slug"),
    [
        ("GET", "/no-such-endpoint", 404, "not-found"),
        ("GET", "/admin/no-such-endpoint", 404, "not-found"),
        ("POST", "/admin/breakers", 405, "method-not-allowed"),
        ("DELETE", "/healthz", 405, "method-not-allowed"),
    ],
)
async def test_unknown_paths_and_methods_are_problems(
    gateway: AdminGateway, method: str, path: str, status: int, slug: str
) -> None:
    answer = await gateway.admin.request(method, path, headers=ADMIN)

    problem = assert_problem(answer, status, slug)
    assert problem["title"]
    if status == 405:
        assert "GET" in answer.headers["allow"]


async def test_request_validation_errors_are_problems_naming_the_field(
    gateway: AdminGateway,
) -> None:
    answer = await gateway.admin.get("/admin/records/stuck", params={"limit": 0}, headers=ADMIN)

    problem = assert_problem(answer, 422, "invalid-admin-request")
    assert "limit" in problem["detail"]


@pytest.mark.parametrize("field", ["key", "operation", "scope"])
async def test_nul_in_a_record_query_parameter_is_422_and_changes_nothing(
    records_gateway: AdminGateway, unique: Callable[[str], str], field: str
) -> None:
    key = unique("nul-param")
    await send_keyed(records_gateway.proxy, key)
    before = await records_gateway.app.store.get(record_key(key))
    assert before is not None

    for name, (method, path) in RECORD_CALLS.items():
        params = by_scope(key)
        params[field] = params[field] + "\x00"
        answer = await records_gateway.admin.request(method, path, params=params, headers=ADMIN)

        problem = assert_problem(answer, 422, "invalid-admin-request", name)
        assert "NUL" in problem["detail"]
    assert await records_gateway.app.store.get(record_key(key)) == before


async def test_nul_in_an_admin_path_parameter_is_422(gateway: AdminGateway) -> None:
    answer = await gateway.admin.put(
        "/admin/breakers/payments%00x", json={"state": "forced_open"}, headers=ADMIN
    )

    assert_problem(answer, 422, "invalid-admin-request")


async def test_nul_is_checked_only_after_the_token(gateway: AdminGateway) -> None:
    answer = await gateway.admin.get(
        "/admin/records", params={"operation": "x", "key": "a\x00", "scope": "anonymous"}
    )

    assert_problem(answer, 401, "unauthorized")


@pytest.mark.parametrize("credentials", [{}, ADMIN], ids=["no-token", "token"])
async def test_an_admin_body_over_its_bound_is_refused_without_reading_it_whole(
    gateway: AdminGateway, payments: str, credentials: dict[str, str]
) -> None:
    """Admin bodies are a few bytes of JSON: one declared at 500 MiB is refused at once (the
    client has sent 1 KiB of it and stops there), and a chunked one once it passes the bound;
    with or without the token, which FastAPI would check only after reading the body."""
    port = gateway.admin.base_url.port
    assert port is not None
    headers = [(b"Content-Type", b"application/json")]
    headers += [(name.encode(), value.encode()) for name, value in credentials.items()]
    declared = request_bytes(
        b"PUT",
        f"/admin/breakers/{payments}".encode(),
        headers,
        b'{"state": "normal", "x": "' + b"a" * 1024,
        content_length=500 * 2**20,
    )
    reply = await asyncio.to_thread(exchange, port, declared)

    assert reply is not None
    assert (reply.status, reply.slug()) == (413, "request-body-too-large")

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"state": "normal", "x": "'
        for _ in range(100):
            yield b"a" * 1024

    streamed = await gateway.admin.put(
        f"/admin/breakers/{payments}", content=chunks(), headers=credentials
    )
    assert_problem(streamed, 413, "request-body-too-large")
    # Nothing changed, and a small admin body is still taken.
    forced = await gateway.admin.put(
        f"/admin/breakers/{payments}", json={"state": "forced_open"}, headers=ADMIN
    )
    assert forced.status_code == 200, forced.text


async def test_a_trailing_slash_is_a_404_problem_not_a_redirect_to_the_clients_host(
    gateway: AdminGateway,
) -> None:
    port = gateway.admin.base_url.port
    assert port is not None
    raw = request_bytes(b"GET", b"/admin/breakers/", [(b"Host", b"evil.example")])

    reply = await asyncio.to_thread(exchange, port, raw.replace(b"Host: 127.0.0.1\r\n", b""))

    assert reply is not None
    assert (reply.status, reply.slug()) == (404, "not-found")
    assert "location" not in reply.headers
