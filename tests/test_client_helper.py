"""The client helper (``idempotency_gateway.client``) against the real gateway over loopback.

``idempotency_key`` derives one stable key from business ids. ``IdempotentClient`` sends the same
key on every attempt, waits out a 409 until the first request's answer is replayed, honours
``Retry-After``, stops at its overall deadline, stops at once on answers a retry cannot change
(400, 422, any replayed answer, under either marker name the gateway may be set to, or only the
one it is told), retries a request that never left, and never resends an unkeyed POST that may
have executed. Pauses go through a fake ``sleep`` on a hand-moved clock, so the
test records them instead of waiting; the gateway does not retry by itself here
(``max_attempts: 1``), so every extra upstream execution is the client's doing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest

from idempotency_gateway.client import IETF_REPLAY_HEADER, IdempotentClient, idempotency_key
from idempotency_gateway.config import DEFAULT_REPLAY_HEADER
from tests.support import RecordingUpstream, free_port
from tests.support.charges import CHARGE, CHARGES, keyed_headers
from tests.support.clock import ManualClock
from tests.support.gateway import (
    PRIMARY,
    GatewayLauncher,
    RunningGateway,
    gateway_config,
    route,
)

# ------------------------------------------------------------------------ idempotency_key


def test_idempotency_key_is_stable_across_calls_processes_and_releases() -> None:
    assert idempotency_key("order", 1042) == idempotency_key("order", 1042)
    assert idempotency_key("order", 1042) == idempotency_key("order", "1042")
    # Pinned: a key stored before an upgrade must still match the retry sent after it.
    assert idempotency_key("order", 1042) == (
        "0ffad89ccc2da00134811611f70dff42d6df70eb2382bd7b61e73f5b2cee6fc4"
    )
    assert idempotency_key("order", 1042, namespace="charges") == (
        "96d06c6dd9d9f43d7121f03496242af2aef8fd862957873a20e29194dc7ce02b"
    )


def test_idempotency_key_differs_for_different_ids_and_namespaces() -> None:
    keys = [
        idempotency_key("order", 1042),
        idempotency_key("order", 1043),
        idempotency_key("refund", 1042),
        idempotency_key("order", 1042, namespace="charges"),
        idempotency_key("order", 1042, namespace="refunds"),
        idempotency_key("order", 1042, 1),
        # Boundaries between ids count: ("ab", "c") is not ("a", "bc") nor ("abc",).
        idempotency_key("ab", "c"),
        idempotency_key("a", "bc"),
        idempotency_key("abc"),
        idempotency_key(""),
    ]
    assert len(set(keys)) == len(keys)


def test_idempotency_key_is_never_empty_and_always_a_valid_header_value() -> None:
    for key in (idempotency_key(""), idempotency_key("x" * 10_000), idempotency_key("é", 0)):
        assert len(key) == 64
        assert all(character in "0123456789abcdef" for character in key)
    with pytest.raises(ValueError, match="at least one business id"):
        idempotency_key()


# ------------------------------------------------------------------------ IdempotentClient


@pytest.fixture
async def gateway(
    upstream: RecordingUpstream, postgres_url: str, request: pytest.FixtureRequest
) -> AsyncIterator[RunningGateway]:
    """Key optional on ``/``; no retries inside the gateway. Parametrized indirectly, the
    parameter is the gateway's ``replay_header``."""
    marker = getattr(request, "param", DEFAULT_REPLAY_HEADER)
    config = gateway_config(
        upstream.url,
        upstreams={PRIMARY: {"url": upstream.url, "retry": {"max_attempts": 1}}},
        routes=[route("/")],
        replay_header=marker,
    )
    async with GatewayLauncher() as launcher:
        yield await launcher.start(config, database_url=postgres_url)


@pytest.fixture
def sent() -> list[httpx.Request]:
    """Every request the client put on the wire, in order."""
    return []


MakeClient = Callable[..., IdempotentClient]


@pytest.fixture
async def make_client(
    gateway: RunningGateway, clock: ManualClock, sent: list[httpx.Request]
) -> AsyncIterator[MakeClient]:
    """``make_client(base_url=gateway, timeout=10, **IdempotentClient options)`` on fake time;
    the clients are closed at the end."""
    clients: list[IdempotentClient] = []

    async def record(request: httpx.Request) -> None:
        sent.append(request)

    def make(
        *, base_url: str | None = None, timeout: float = 10.0, **options: Any
    ) -> IdempotentClient:
        http = httpx.AsyncClient(
            base_url=base_url or gateway.url,
            timeout=timeout,
            trust_env=False,
            event_hooks={"request": [record]},
        )
        client = IdempotentClient(
            http=http, sleep=clock.sleep, clock=clock, uniform=clock.uniform, **options
        )
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.http.aclose()


def keys_sent(sent: list[httpx.Request]) -> list[str | None]:
    return [request.headers.get("Idempotency-Key") for request in sent]


async def charge_past_the_helper(
    gateway: RunningGateway, key: str, *, behavior: str | None = None
) -> httpx.Response:
    """A keyed charge sent straight to the gateway, as another client would: it sets up the
    record the helper then meets, and is not counted in ``sent``."""
    headers = keyed_headers(key, behavior=behavior)
    return await gateway.client.post(CHARGES, json=CHARGE, headers=headers)


def assert_sent_once_without_a_pause(sent: list[httpx.Request], clock: ManualClock) -> None:
    """The client's answer is final after one request: it neither retried nor slept."""
    assert len(sent) == 1
    assert clock.sleeps == []


async def test_in_flight_409_is_waited_out_until_the_answer_is_replayed(
    make_client: MakeClient,
    gateway: RunningGateway,
    upstream: RecordingUpstream,
    clock: ManualClock,
    sent: list[httpx.Request],
    unique: Callable[[str], str],
) -> None:
    key = unique("held")
    first = asyncio.create_task(charge_past_the_helper(gateway, key, behavior="gate=held"))
    await upstream.wait_arrived("held")

    async def first_request_finishes(_pause: float) -> None:
        upstream.release("held")
        await first

    clock.on_sleep = first_request_finishes
    client = make_client()

    response = await client.post(
        CHARGES, key=key, json=CHARGE, headers={"X-Test-Behavior": "gate=held"}
    )

    original = await first
    assert original.status_code == 201
    assert response.status_code == 201
    assert response.headers["idempotent-replayed"] == "true"
    assert response.content == original.content
    assert clock.sleeps == [1.0]  # the 409's Retry-After
    assert keys_sent(sent) == [key, key]
    assert upstream.count(key) == 1


async def test_key_reused_with_a_different_request_is_422_at_once(
    make_client: MakeClient,
    gateway: RunningGateway,
    upstream: RecordingUpstream,
    clock: ManualClock,
    sent: list[httpx.Request],
    unique: Callable[[str], str],
) -> None:
    key = unique("reused")
    assert (await charge_past_the_helper(gateway, key)).is_success

    response = await make_client().post(CHARGES, key=key, json={**CHARGE, "amount": 1})

    assert response.status_code == 422
    assert_sent_once_without_a_pause(sent, clock)
    assert upstream.count(key) == 1


async def test_malformed_key_is_400_at_once(
    make_client: MakeClient,
    upstream: RecordingUpstream,
    clock: ManualClock,
    sent: list[httpx.Request],
) -> None:
    response = await make_client().post(CHARGES, key="has space", json=CHARGE)

    assert response.status_code == 400
    assert_sent_once_without_a_pause(sent, clock)
    assert upstream.total == 0


MARKERS = pytest.mark.parametrize(
    "gateway", [DEFAULT_REPLAY_HEADER, IETF_REPLAY_HEADER], ids=["stripe", "ietf"], indirect=True
)


@MARKERS
async def test_a_replayed_answer_is_final_even_with_a_retryable_status(
    make_client: MakeClient,
    gateway: RunningGateway,
    upstream: RecordingUpstream,
    clock: ManualClock,
    sent: list[httpx.Request],
    unique: Callable[[str], str],
) -> None:
    key = unique("replayed-500")
    stored = await charge_past_the_helper(gateway, key, behavior="status=500")
    assert stored.status_code == 500

    # No replay_header given: the helper knows both names the gateway may mark a replay with.
    response = await make_client().post(CHARGES, key=key, json=CHARGE)

    # The gateway will replay this 500 forever: retrying only adds load and delay.
    assert response.status_code == 500
    assert response.headers[gateway.app.config.replay_header] == "true"
    assert_sent_once_without_a_pause(sent, clock)
    assert upstream.count(key) == 1


@pytest.mark.parametrize("gateway", [IETF_REPLAY_HEADER], ids=["ietf"], indirect=True)
async def test_a_named_replay_header_is_the_only_marker_recognized(
    make_client: MakeClient,
    gateway: RunningGateway,
    upstream: RecordingUpstream,
    clock: ManualClock,
    sent: list[httpx.Request],
    unique: Callable[[str], str],
) -> None:
    key = unique("named-marker")
    assert (await charge_past_the_helper(gateway, key, behavior="status=500")).status_code == 500

    told = await make_client(replay_header=IETF_REPLAY_HEADER).post(CHARGES, key=key, json=CHARGE)
    assert told.status_code == 500
    assert_sent_once_without_a_pause(sent, clock)

    # Told Stripe's name, the helper sees no replay in the IETF marker: a 500 to retry.
    misled = make_client(replay_header=DEFAULT_REPLAY_HEADER, max_attempts=3)
    answer = await misled.post(CHARGES, key=key, json=CHARGE)

    assert answer.status_code == 500
    assert answer.headers[IETF_REPLAY_HEADER] == "true"
    assert len(sent) == 1 + 3
    assert len(clock.sleeps) == 2
    assert upstream.count(key) == 1


async def test_retry_after_from_the_answer_sets_the_pause(
    make_client: MakeClient,
    upstream: RecordingUpstream,
    clock: ManualClock,
    sent: list[httpx.Request],
    unique: Callable[[str], str],
) -> None:
    key = unique("retry-after")

    response = await make_client().post(
        CHARGES,
        key=key,
        json=CHARGE,
        headers={"X-Test-Behavior": "status-first=503,retry-after=2"},
    )

    assert response.status_code == 201
    assert clock.sleeps == [2.0]
    assert keys_sent(sent) == [key, key]
    # The 503 left the key retryable: the second attempt executed under the next token.
    first_token, second_token = (e.fencing_token for e in upstream.executions_for(key))
    assert first_token is not None
    assert second_token is not None
    assert first_token < second_token


async def test_overall_deadline_stops_retrying(
    make_client: MakeClient,
    upstream: RecordingUpstream,
    clock: ManualClock,
    sent: list[httpx.Request],
    unique: Callable[[str], str],
) -> None:
    key = unique("deadline")
    client = make_client(max_attempts=10, deadline=10.0)

    response = await client.post(
        CHARGES, key=key, json=CHARGE, headers={"X-Test-Behavior": "status=503,retry-after=4"}
    )

    # Attempts at t=0, 4 and 8; another pause of 4s would end past t=10.
    assert response.status_code == 503
    assert clock.sleeps == [4.0, 4.0]
    assert len(sent) == 3
    assert upstream.count(key) == 3


@pytest.mark.parametrize("key", ["order-7", None], ids=["keyed", "unkeyed-POST"])
async def test_connection_refused_is_retried_then_raised(
    make_client: MakeClient, clock: ManualClock, sent: list[httpx.Request], key: str | None
) -> None:
    client = make_client(
        base_url=f"http://127.0.0.1:{free_port()}", max_attempts=3, base=0.1, cap=5.0
    )

    with pytest.raises(httpx.ConnectError):
        await client.request("POST", CHARGES, key=key, json=CHARGE)

    # Never sent, so safe to resend even without a key.
    assert len(sent) == 3
    assert keys_sent(sent) == [key] * 3
    assert clock.jitter_bounds == [(0.0, 0.1), (0.0, 0.2)]
    assert clock.sleeps == [0.1, 0.2]


async def test_unkeyed_post_answered_503_is_not_retried(
    make_client: MakeClient,
    upstream: RecordingUpstream,
    clock: ManualClock,
    sent: list[httpx.Request],
) -> None:
    response = await make_client().request(
        "POST", CHARGES, json=CHARGE, headers={"X-Test-Behavior": "status=503"}
    )

    assert response.status_code == 503
    assert_sent_once_without_a_pause(sent, clock)
    assert upstream.total == 1


async def test_unkeyed_post_whose_answer_timed_out_is_not_retried(
    make_client: MakeClient,
    upstream: RecordingUpstream,
    clock: ManualClock,
    sent: list[httpx.Request],
) -> None:
    client = make_client(timeout=0.3)

    with pytest.raises(httpx.ReadTimeout):
        await client.request("POST", CHARGES, json=CHARGE, headers={"X-Test-Behavior": "gate=slow"})

    upstream.release("slow")  # lets the gateway finish before it shuts down
    assert_sent_once_without_a_pause(sent, clock)
    assert upstream.total == 1


def test_idempotency_key_namespace_cannot_be_forged_from_ids() -> None:
    # A namespace that spells out a length prefix must not collide with an extra id.
    forged = idempotency_key("z", namespace="x\0\0\0\x01y")
    assert forged != idempotency_key("y", "z", namespace="x")
