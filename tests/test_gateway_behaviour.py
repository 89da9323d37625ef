"""What a client sees from the gateway over real HTTP (contract sections 4 and 5).

The real gateway (``create_gateway``, lifespan on) runs on loopback in front of a recording
upstream, on PostgreSQL and on SQLite. Each test walks one row of the contract section 5 table or
one edge of the record state machine and asserts the status, the RFC 9457 problem document, and
the exact number of times the upstream executed the request.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
import pytest

from idempotency_gateway.storage.base import RecordStore
from idempotency_gateway.storage.records import RecordKey, Status
from tests.support import RecordingUpstream, eventually, free_port
from tests.support.charges import CHARGE, CHARGES, keyed_headers
from tests.support.gateway import (
    RunningGateway,
    StartGateway,
    route,
    unreachable_database_url,
)
from tests.support.problems import assert_problem as shared_assert_problem

# An upstream the record alone speaks for: one attempt per request, so every execution is one
# the record allowed.
SINGLE_ATTEMPT = {"max_attempts": 1}


@pytest.fixture
async def gateway(start_gateway: StartGateway, database_url: str) -> RunningGateway:
    """The default gateway (one key-required route, one attempt) on each store."""
    return await start_gateway(database_url, keyed=True)


async def post_charge(
    gateway: RunningGateway,
    key: str | None,
    *,
    behavior: str | None = None,
    headers: dict[str, str] | None = None,
    **request: Any,
) -> httpx.Response:
    """POST a charge (``CHARGE`` as JSON unless ``content``/``json`` is given)."""
    sent = keyed_headers(key, behavior=behavior, headers=headers)
    if "content" not in request and "json" not in request:
        request["json"] = CHARGE
    return await gateway.client.post(CHARGES, headers=sent, **request)


def assert_problem(
    response: httpx.Response,
    status: int,
    *,
    slug: str,
    retryable: bool,
    request_id: str | None = None,
) -> dict[str, Any]:
    """Our problem ``slug``, also saying whether a retry may help and which request it
    answers."""
    problem = shared_assert_problem(response, status, slug)
    assert problem["retryable"] is retryable
    # A replayed problem carries the id of the request that produced it.
    assert problem["request_id"] == (request_id or response.headers["x-request-id"])
    return problem


def assert_replay_of(original: httpx.Response, replay: httpx.Response) -> None:
    assert replay.status_code == original.status_code
    assert replay.content == original.content
    assert replay.headers["idempotent-replayed"] == "true"
    assert "idempotent-replayed" not in original.headers
    # Upstream headers are stored and replayed with the body.
    assert replay.headers["x-upstream-execution"] == original.headers["x-upstream-execution"]
    assert replay.headers["content-type"] == original.headers["content-type"]


def charge_record(key: str) -> RecordKey:
    # No Authorization header: scope "anonymous"; the operation is METHOD + path.
    return RecordKey("anonymous", f"POST {CHARGES}", key)


# --------------------------------------------------------------------------- replay


async def test_first_request_executes_and_the_repeat_is_replayed(
    gateway: RunningGateway,
    upstream: RecordingUpstream,
    store: RecordStore,
    unique: Callable[[str], str],
) -> None:
    key = unique("replay")

    first = await post_charge(gateway, key)
    assert first.status_code == 201
    assert first.json()["execution"] == 1
    assert upstream.count(key) == 1
    # The answer is complete only once it is durable: an immediate retry must replay, not 409.
    record = await store.get(charge_record(key))
    assert record is not None
    assert record.status is Status.SUCCEEDED

    replay = await post_charge(gateway, key)
    assert_replay_of(first, replay)
    assert upstream.count(key) == 1


async def test_reordered_json_with_other_whitespace_is_the_same_request(
    gateway: RunningGateway,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
) -> None:
    key = unique("canonical-json")
    json_type = {"Content-Type": "application/json"}

    first = await post_charge(
        gateway, key, content=b'{"amount":1000,"currency":"usd"}', headers=json_type
    )
    retry = await post_charge(
        gateway, key, content=b'{\n  "currency" : "usd",\n  "amount" : 1000\n}', headers=json_type
    )

    assert first.status_code == 201
    assert_replay_of(first, retry)
    assert upstream.count(key) == 1


async def test_same_key_under_two_credentials_is_two_records(
    gateway: RunningGateway,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
) -> None:
    key = unique("tenants")
    tenant_a = {"Authorization": "Bearer a"}
    tenant_b = {"Authorization": "Bearer b"}

    first_a = await post_charge(gateway, key, headers=tenant_a)
    first_b = await post_charge(gateway, key, headers=tenant_b)
    assert (first_a.status_code, first_b.status_code) == (201, 201)
    assert upstream.count(key) == 2

    assert_replay_of(first_a, await post_charge(gateway, key, headers=tenant_a))
    assert_replay_of(first_b, await post_charge(gateway, key, headers=tenant_b))
    assert first_a.json()["execution"] != first_b.json()["execution"]
    assert upstream.count(key) == 2


async def test_key_and_fencing_token_are_forwarded_upstream(
    gateway: RunningGateway,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
) -> None:
    key = unique("forwarded")

    # A client cannot choose its own fencing token: the gateway's replaces it.
    response = await post_charge(gateway, key, headers={"Idempotency-Fencing-Token": "0"})

    assert response.status_code == 201
    [execution] = upstream.executions_for(key)
    assert execution.header_values("Idempotency-Key") == [key]
    token = response.json()["fencing_token"]
    assert execution.header_values("Idempotency-Fencing-Token") == [str(token)]
    assert token >= 1


# ---------------------------------------------------------------------- the key itself


async def test_missing_key_on_a_required_route_is_400_and_never_proxied(
    gateway: RunningGateway, upstream: RecordingUpstream
) -> None:
    response = await post_charge(gateway, None)

    assert_problem(response, 400, slug="idempotency-key-missing", retryable=False)
    assert upstream.total == 0


async def test_missing_key_on_an_optional_route_is_proxied_unprotected(
    start_gateway: StartGateway, upstream: RecordingUpstream
) -> None:
    # No store round trip for an uncovered request: proven by a store that cannot be reached.
    gateway = await start_gateway(
        unreachable_database_url(), keyed=True, routes=[route("/", key="optional")]
    )

    answers = [await post_charge(gateway, None) for _ in range(2)]

    assert [answer.status_code for answer in answers] == [201, 201]
    assert [answer.json()["execution"] for answer in answers] == [1, 2]
    assert all("idempotent-replayed" not in answer.headers for answer in answers)
    assert [execution.idempotency_key for execution in upstream.executions] == [None, None]


async def test_route_with_key_off_never_stores_anything(
    start_gateway: StartGateway, upstream: RecordingUpstream, unique: Callable[[str], str]
) -> None:
    gateway = await start_gateway(
        unreachable_database_url(), keyed=True, routes=[route("/", key="off")]
    )
    key = unique("off")

    answers = [await post_charge(gateway, key) for _ in range(2)]

    assert [answer.status_code for answer in answers] == [201, 201]
    assert all("idempotent-replayed" not in answer.headers for answer in answers)
    assert upstream.count(key) == 2
    # Not protected, so the gateway has no token to forward.
    assert [execution.fencing_token for execution in upstream.executions_for(key)] == [None, None]


@pytest.mark.parametrize(
    "key_fields",
    [
        pytest.param([("Idempotency-Key", "has space")], id="space"),
        pytest.param([("Idempotency-Key", "k" * 256)], id="256-characters"),
        pytest.param([("Idempotency-Key", "one"), ("Idempotency-Key", "two")], id="two-fields"),
        pytest.param([("Idempotency-Key", '"unterminated')], id="broken-sf-string"),
    ],
)
async def test_malformed_key_is_400_and_nothing_executes(
    gateway: RunningGateway,
    upstream: RecordingUpstream,
    key_fields: list[tuple[str, str]],
) -> None:
    response = await gateway.client.post(CHARGES, headers=key_fields, json=CHARGE)

    assert_problem(response, 400, slug="idempotency-key-invalid", retryable=False)
    assert upstream.total == 0


async def test_longest_valid_key_is_accepted(
    gateway: RunningGateway,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
) -> None:
    key = unique("max").ljust(255, "k")

    first = await post_charge(gateway, key)
    assert first.status_code == 201
    assert_replay_of(first, await post_charge(gateway, key))
    assert upstream.count(key) == 1


async def test_key_reused_with_a_different_body_is_422_and_not_executed(
    gateway: RunningGateway,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
) -> None:
    key = unique("mismatch")

    first = await post_charge(gateway, key)
    different = await post_charge(gateway, key, json={"amount": 999, "currency": "usd"})

    assert first.status_code == 201
    assert_problem(different, 422, slug="idempotency-key-reused", retryable=False)
    assert upstream.count(key) == 1
    # The original answer is untouched by the rejected reuse.
    assert_replay_of(first, await post_charge(gateway, key))


# -------------------------------------------------------------------------- in flight


async def test_duplicate_while_in_flight_is_409_then_replayed(
    gateway: RunningGateway,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
) -> None:
    key = unique("in-flight")
    first = asyncio.create_task(post_charge(gateway, key, behavior="gate=first"))
    await upstream.wait_arrived("first")

    duplicate = await post_charge(gateway, key, behavior="gate=first")

    assert_problem(duplicate, 409, slug="request-in-flight", retryable=True)
    assert duplicate.headers["retry-after"] == "1"
    assert not first.done()
    upstream.release("first")
    original = await first
    assert original.status_code == 201
    assert_replay_of(original, await post_charge(gateway, key))
    assert upstream.count(key) == 1


async def test_fifty_concurrent_duplicates_while_the_first_is_held_get_409(
    gateway: RunningGateway,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
) -> None:
    key = unique("fifty-held")
    requests = [
        asyncio.create_task(post_charge(gateway, key, behavior="gate=held")) for _ in range(50)
    ]
    await upstream.wait_arrived("held")

    await eventually(
        lambda: sum(request.done() for request in requests) == 49,
        message="49 duplicates answered while the first is held",
    )
    duplicates = [request.result() for request in requests if request.done()]
    for duplicate in duplicates:
        assert_problem(duplicate, 409, slug="request-in-flight", retryable=True)
    upstream.release("held")
    answers = await asyncio.gather(*requests)

    [original] = [answer for answer in answers if answer.status_code != 409]
    assert original.status_code == 201
    assert upstream.count(key) == 1
    assert upstream.arrivals("held") == 1
    assert_replay_of(original, await post_charge(gateway, key))


async def test_fifty_concurrent_duplicates_execute_exactly_once(
    gateway: RunningGateway,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
) -> None:
    key = unique("fifty-racing")

    answers = await asyncio.gather(*(post_charge(gateway, key) for _ in range(50)))

    assert upstream.count(key) == 1
    [executed] = upstream.executions_for(key)
    bodies = {answer.content for answer in answers if answer.status_code == 201}
    assert len(bodies) == 1
    assert json.loads(bodies.pop())["execution"] == executed.number
    for answer in answers:
        if answer.status_code == 409:
            assert_problem(answer, 409, slug="request-in-flight", retryable=True)
        else:
            assert answer.status_code == 201
    originals = [answer for answer in answers if answer.status_code == 201]
    assert sum("idempotent-replayed" not in answer.headers for answer in originals) == 1


# ---------------------------------------------------------- limits and the store itself


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
async def test_body_over_the_limit_is_413_before_any_store_access(
    start_gateway: StartGateway,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
    framing: str,
) -> None:
    # A store that cannot be reached would answer 503: 413 proves the store was not asked.
    gateway = await start_gateway(
        unreachable_database_url(),
        keyed=True,
        limits={"max_request_body": "1KiB"},
        store={"connect_timeout": "300ms"},
    )
    body = b"z" * 2048

    async def chunked() -> AsyncIterator[bytes]:
        yield body[:1000]
        yield body[1000:]

    content = body if framing == "content-length" else chunked()
    response = await post_charge(gateway, unique("too-large"), content=content)

    assert_problem(response, 413, slug="request-body-too-large", retryable=False)
    assert upstream.total == 0


async def test_store_unavailable_fails_closed_with_503_and_never_proxies(
    start_gateway: StartGateway, upstream: RecordingUpstream, unique: Callable[[str], str]
) -> None:
    gateway = await start_gateway(
        unreachable_database_url(),
        keyed=True,
        store={"connect_timeout": "300ms"},
        store_unavailable="fail_closed",
    )

    response = await post_charge(gateway, unique("store-down"))

    assert_problem(response, 503, slug="store-unavailable", retryable=True)
    assert response.headers["retry-after"] == "1"
    assert upstream.total == 0


async def test_store_unavailable_with_pass_through_proxies_unprotected(
    start_gateway: StartGateway, upstream: RecordingUpstream, unique: Callable[[str], str]
) -> None:
    gateway = await start_gateway(
        unreachable_database_url(),
        keyed=True,
        store={"connect_timeout": "300ms"},
        store_unavailable="pass_through",
    )
    key = unique("pass-through")

    response = await post_charge(gateway, key)

    assert response.status_code == 201
    assert response.json()["key"] == key
    assert upstream.count(key) == 1


# ------------------------------------------------------------------- upstream failures


async def test_unreachable_upstream_is_502_retryable_and_the_key_may_run_again(
    start_gateway: StartGateway,
    store: RecordStore,
    database_url: str,
    unique: Callable[[str], str],
) -> None:
    gateway = await start_gateway(
        database_url,
        keyed=True,
        upstreams={"down": {"url": f"http://127.0.0.1:{free_port()}", "retry": SINGLE_ATTEMPT}},
        routes=[route("/", key="required", upstream="down")],
    )
    key = unique("unreachable")

    first = await post_charge(gateway, key)

    assert_problem(first, 502, slug="upstream-unreachable", retryable=True)
    record = await store.get(charge_record(key))
    assert record is not None
    assert (record.status, record.response) == (Status.FAILED_RETRYABLE, None)
    first_token = record.fencing_token

    # Not replayed: the retry is a new execution attempt with the next fencing token.
    retry = await post_charge(gateway, key)
    assert_problem(retry, 502, slug="upstream-unreachable", retryable=True)
    assert "idempotent-replayed" not in retry.headers
    record = await store.get(charge_record(key))
    assert record is not None
    assert (record.status, record.attempts) == (Status.FAILED_RETRYABLE, 2)
    assert record.fencing_token > first_token


AMBIGUOUS_FAILURES = [
    pytest.param("hang", 504, "upstream-timeout", id="timeout"),
    pytest.param("reset", 502, "upstream-connection-lost", id="connection-reset"),
]


@dataclass(frozen=True)
class AmbiguousFailure:
    """A first request whose upstream execution may or may not have happened."""

    gateway: RunningGateway
    key: str
    first: httpx.Response
    stored_status: Status


class FailAmbiguously(Protocol):
    def __call__(self, *, on_ambiguous: str, behavior: str) -> Awaitable[AmbiguousFailure]: ...


@pytest.fixture
def fail_ambiguously(
    start_gateway: StartGateway,
    store: RecordStore,
    database_url: str,
    unique: Callable[[str], str],
) -> FailAmbiguously:
    """``await fail_ambiguously(on_ambiguous=..., behavior=...)``: start a gateway whose route
    has that ``on_ambiguous`` policy, send one new key with the upstream ``behavior`` (``hang``
    past per_try, or ``reset`` after reading the body) and return its answer and stored status."""

    async def fail(*, on_ambiguous: str, behavior: str) -> AmbiguousFailure:
        gateway = await start_gateway(
            database_url,
            keyed=True,
            routes=[route("/", key="required", on_ambiguous=on_ambiguous)],
            timeouts={"per_try": "500ms", "total": "5s"},
        )
        key = unique(f"ambiguous-{on_ambiguous}-{behavior}")
        first = await post_charge(gateway, key, behavior=behavior)
        record = await store.get(charge_record(key))
        assert record is not None
        return AmbiguousFailure(gateway, key, first, record.status)

    return fail


@pytest.mark.parametrize(("behavior", "status", "slug"), AMBIGUOUS_FAILURES)
async def test_ambiguous_failure_under_fail_is_final_and_replayed(
    fail_ambiguously: FailAmbiguously,
    upstream: RecordingUpstream,
    behavior: str,
    status: int,
    slug: str,
) -> None:
    failure = await fail_ambiguously(on_ambiguous="fail", behavior=behavior)
    first, key = failure.first, failure.key

    assert_problem(first, status, slug=slug, retryable=False)
    assert failure.stored_status is Status.FAILED_FINAL
    # The retry (this time the upstream would answer) must not risk a second execution.
    retry = await post_charge(failure.gateway, key)
    assert retry.status_code == status
    assert retry.content == first.content
    assert retry.headers["idempotent-replayed"] == "true"
    assert_problem(retry, status, slug=slug, retryable=False, request_id=first.json()["request_id"])
    assert upstream.count(key) == 1


@pytest.mark.parametrize(("behavior", "status", "slug"), AMBIGUOUS_FAILURES)
async def test_ambiguous_failure_under_retry_executes_again_with_the_next_token(
    fail_ambiguously: FailAmbiguously,
    upstream: RecordingUpstream,
    behavior: str,
    status: int,
    slug: str,
) -> None:
    failure = await fail_ambiguously(on_ambiguous="retry", behavior=behavior)
    key = failure.key

    # The problem tells the client the truth: a retry with this key will execute.
    assert_problem(failure.first, status, slug=slug, retryable=True)
    assert failure.stored_status is Status.FAILED_RETRYABLE
    retry = await post_charge(failure.gateway, key)
    assert retry.status_code == 201
    assert "idempotent-replayed" not in retry.headers
    assert upstream.count(key) == 2
    first_token, retry_token = (e.fencing_token for e in upstream.executions_for(key))
    assert first_token is not None
    assert retry_token is not None
    assert first_token < retry_token
    assert retry.json()["fencing_token"] == retry_token


async def test_upstream_503_is_retryable_and_the_retry_executes_with_token_2(
    gateway: RunningGateway,
    upstream: RecordingUpstream,
    store: RecordStore,
    unique: Callable[[str], str],
) -> None:
    key = unique("upstream-503")

    first = await post_charge(gateway, key, behavior="status=503")
    assert first.status_code == 503
    record = await store.get(charge_record(key))
    assert record is not None
    assert record.status is Status.FAILED_RETRYABLE

    retry = await post_charge(gateway, key)

    assert retry.status_code == 201
    assert "idempotent-replayed" not in retry.headers
    assert upstream.count(key) == 2
    first_token, retry_token = (e.fencing_token for e in upstream.executions_for(key))
    assert first_token is not None
    assert retry_token is not None
    assert first_token < retry_token
    assert_replay_of(retry, await post_charge(gateway, key))
    assert upstream.count(key) == 2


@pytest.mark.parametrize("upstream_status", [500, 400])
async def test_deterministic_upstream_failure_is_final_and_replayed(
    gateway: RunningGateway,
    upstream: RecordingUpstream,
    store: RecordStore,
    unique: Callable[[str], str],
    upstream_status: int,
) -> None:
    key = unique(f"upstream-{upstream_status}")

    first = await post_charge(gateway, key, behavior=f"status={upstream_status}")
    retry = await post_charge(gateway, key)

    assert first.status_code == upstream_status
    assert_replay_of(first, retry)
    assert upstream.count(key) == 1
    record = await store.get(charge_record(key))
    assert record is not None
    assert record.status is Status.FAILED_FINAL


# ------------------------------------------------------------------ expiry, disconnects


async def test_expired_record_executes_again_with_token_1(
    start_gateway: StartGateway,
    upstream: RecordingUpstream,
    database_url: str,
    unique: Callable[[str], str],
) -> None:
    gateway = await start_gateway(
        database_url, keyed=True, routes=[route("/", key="required", ttl="1s", lease="1s")]
    )
    key = unique("expiry")
    first = await post_charge(gateway, key)
    assert first.status_code == 201

    async def executed_again() -> httpx.Response | None:
        response = await post_charge(gateway, key)
        assert response.status_code == 201
        if response.headers.get("idempotent-replayed") == "true":
            assert response.content == first.content
            return None
        return response

    second = await eventually(executed_again, timeout=5.0, interval=0.1)

    assert upstream.count(key) == 2
    # A new life of the key, and still a larger token than the first life's.
    first_token, second_token = (e.fencing_token for e in upstream.executions_for(key))
    assert first_token is not None
    assert second_token is not None
    assert first_token < second_token
    assert second.json()["execution"] == 2


async def test_client_disconnect_does_not_cancel_the_execution(
    gateway: RunningGateway,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
) -> None:
    key = unique("disconnect")
    body = json.dumps(CHARGE).encode()
    host, port = gateway.url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    writer.write(
        f"POST {CHARGES} HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Idempotency-Key: {key}\r\nX-Test-Behavior: gate=abandoned\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()
    await upstream.wait_arrived("abandoned")

    writer.close()
    await writer.wait_closed()
    # A full round trip through the gateway after the close: the disconnect has been seen.
    duplicate = await post_charge(gateway, key)
    assert_problem(duplicate, 409, slug="request-in-flight", retryable=True)
    assert upstream.inflight == 1
    upstream.release("abandoned")

    async def replayed() -> httpx.Response | None:
        response = await post_charge(gateway, key)
        return response if response.status_code != 409 else None

    retry = await eventually(replayed)
    assert retry.status_code == 201
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.json()["execution"] == 1
    assert upstream.count(key) == 1


# -------------------------------------------------------------------- response bodies


async def test_streamed_response_reaches_the_client_before_it_ends_and_replays_whole(
    gateway: RunningGateway,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
) -> None:
    key = unique("stream")
    headers = {"Idempotency-Key": key, "X-Test-Behavior": "stream=5,chunk=1024,stream-gate=tail"}

    async with gateway.client.stream("POST", CHARGES, headers=headers, json=CHARGE) as response:
        assert response.status_code == 200
        chunks = response.aiter_raw()
        received = b""
        while len(received) < 4 * 1024:
            received += await anext(chunks)
        # Four chunks arrived while the upstream is still held before its last one.
        assert upstream.inflight == 1
        upstream.release("tail")
        async for chunk in chunks:
            received += chunk

    assert received == b"x" * 5 * 1024
    replay = await post_charge(gateway, key)
    assert replay.status_code == 200
    assert replay.content == received
    assert replay.headers["idempotent-replayed"] == "true"
    assert upstream.count(key) == 1


async def test_answer_over_the_storage_cap_is_delivered_but_replayed_without_body(
    start_gateway: StartGateway,
    upstream: RecordingUpstream,
    database_url: str,
    unique: Callable[[str], str],
) -> None:
    gateway = await start_gateway(
        database_url, keyed=True, routes=[route("/", key="required", max_stored_body="1KiB")]
    )
    key = unique("oversized")

    first = await post_charge(gateway, key, behavior="body=4096")
    replay = await post_charge(gateway, key)

    assert first.status_code == 200
    assert first.content == b"y" * 4096
    assert "idempotency-body-omitted" not in first.headers
    assert replay.status_code == 200
    assert replay.content == b""
    assert replay.headers["idempotency-body-omitted"] == "true"
    assert replay.headers["idempotent-replayed"] == "true"
    assert replay.headers["x-upstream-execution"] == first.headers["x-upstream-execution"]
    assert replay.headers["content-type"] == "application/octet-stream"
    assert upstream.count(key) == 1


async def test_answer_cut_mid_stream_is_stored_as_outcome_unknown(
    gateway: RunningGateway,
    upstream: RecordingUpstream,
    store: RecordStore,
    unique: Callable[[str], str],
) -> None:
    key = unique("cut")
    headers = {
        "Idempotency-Key": key,
        "X-Test-Behavior": "stream=3,chunk=1024,stream-gate=cut",
        "X-Request-Id": "cut-request-1",
    }

    async with gateway.client.stream("POST", CHARGES, headers=headers, json=CHARGE) as response:
        assert response.status_code == 200
        await upstream.wait_arrived("cut")
        # The upstream dies with its last chunk unsent: the client's body must not look whole.
        await upstream.close()
        with pytest.raises(httpx.TransportError):
            await response.aread()

    retry = await post_charge(gateway, key)

    assert_problem(retry, 504, slug="outcome-unknown", retryable=False, request_id="cut-request-1")
    assert retry.headers["idempotent-replayed"] == "true"
    record = await store.get(charge_record(key))
    assert record is not None
    assert record.status is Status.FAILED_FINAL
    assert upstream.count(key) == 1
