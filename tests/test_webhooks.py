"""Webhook routes against real gateway processes: verified first, then delivered once.

One gateway process (PostgreSQL records, the recording upstream) serves a route per scheme,
each signed with the sender's own signing code (tests/support/webhooks.py). A delivery sent
again, however re-signed, reaches the upstream once and gets the stored answer; a forged,
stale, future-dated or unsigned one is a 401 that records nothing, so the real delivery with
the same id still executes; a delivery id is found by header or JSON Pointer, and the same id
from two tenants is two deliveries. A storm of one delivery over two more processes on the
same database reaches the upstream once.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
import stripe

from idempotency_gateway.config import UNSIGNED_OPT_OUT
from tests.support import GatewayProcess, RecordingUpstream, eventually, write_config
from tests.support.gateway import gateway_config, route
from tests.support.problems import assert_problem
from tests.support.raw_http import exchange, request_bytes
from tests.support.upstream import BEHAVIOR_HEADER, Execution
from tests.support.webhooks import (
    GITHUB_PAYLOAD,
    GITHUB_SECRET,
    GITHUB_VECTOR,
    STANDARD_OLD_SECRET,
    STANDARD_SECRET,
    STRIPE_SECRET,
    github_signature,
    standard_headers,
    stripe_signature,
    unix_now,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

STANDARD, GITHUB, STRIPE, SHOPS = "/hooks/standard", "/hooks/github", "/hooks/stripe", "/shops"
SENDER_A, SENDER_B = "/hooks/sender-a", "/hooks/sender-b"
UNSIGNED = "/hooks/unsigned"
# Past both schemes' 300 s default and the Stripe route's 120 s.
STALE = 400
STRIPE_TOLERANCE = 120
SECRETS = {
    "TEST_STANDARD_SECRET": STANDARD_SECRET,
    "TEST_STANDARD_OLD_SECRET": STANDARD_OLD_SECRET,
    "TEST_GITHUB_SECRET": GITHUB_SECRET,
    "TEST_STRIPE_SECRET": STRIPE_SECRET,
}
SIGNATURE_INVALID = "webhook-signature-invalid"


def webhook_route(
    prefix: str,
    *,
    signature: dict[str, Any],
    delivery_id: dict[str, str],
    tenant: dict[str, str],
    **idempotency: Any,
) -> dict[str, Any]:
    webhook = {"delivery_id": delivery_id, "tenant": tenant, "signature": signature}
    return route(prefix, methods=["POST"], webhook=webhook, **idempotency)


def webhook_config(upstream_url: str) -> dict[str, Any]:
    github = {"scheme": "github", "secrets": ["TEST_GITHUB_SECRET"]}
    github_delivery = {"header": "X-GitHub-Delivery"}
    routes = [
        webhook_route(
            STANDARD,
            signature={
                "scheme": "standard-webhooks",
                "secrets": ["TEST_STANDARD_SECRET", "TEST_STANDARD_OLD_SECRET"],
            },
            delivery_id={"header": "webhook-id"},
            tenant={"name": "acme"},
        ),
        webhook_route(
            GITHUB, signature=github, delivery_id=github_delivery, tenant={"name": "github"}
        ),
        webhook_route(
            STRIPE,
            signature={
                "scheme": "stripe",
                "secrets": ["TEST_STRIPE_SECRET"],
                "tolerance": f"{STRIPE_TOLERANCE}s",
            },
            delivery_id={"json_pointer": "/id"},
            tenant={"name": "stripe"},
        ),
        # One sender for many shops: the id sits in an array under a key holding a "/".
        webhook_route(
            SHOPS,
            signature=github,
            delivery_id={"json_pointer": "/events/0/meta~1id"},
            tenant={"header": "X-Shop-Domain"},
        ),
        # One operation name: only the tenant tells the two senders' records apart.
        *(
            webhook_route(
                prefix,
                signature=github,
                delivery_id=github_delivery,
                tenant={"name": name},
                operation="deliveries",
            )
            for prefix, name in ((SENDER_A, "sender-a"), (SENDER_B, "sender-b"))
        ),
        route(
            UNSIGNED,
            methods=["POST"],
            webhook={
                "delivery_id": {"header": "X-Delivery"},
                "tenant": {"name": "internal"},
                "unsigned": UNSIGNED_OPT_OUT,
            },
        ),
    ]
    config = gateway_config(upstream_url, routes=routes, retry={"max_attempts": 1})
    return config.model_dump(mode="json")


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def upstream() -> AsyncIterator[RecordingUpstream]:
    async with RecordingUpstream() as recording:
        yield recording


def webhook_gateway(
    tmp_path_factory: pytest.TempPathFactory,
    postgres_url: str,
    upstream: RecordingUpstream,
    name: str,
) -> GatewayProcess:
    directory = tmp_path_factory.mktemp(name)
    return GatewayProcess(
        write_config(directory, webhook_config(upstream.url)),
        env={"GATEWAY_DATABASE_URL": postgres_url, **SECRETS},
        log_dir=directory,
        name=name,
    )


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def gateway(
    tmp_path_factory: pytest.TempPathFactory, postgres_url: str, upstream: RecordingUpstream
) -> AsyncIterator[GatewayProcess]:
    process = webhook_gateway(tmp_path_factory, postgres_url, upstream, "webhooks")
    async with process:
        yield process
    print(f"--- gateway log tail ---\n{process.log_tail()}")


@pytest_asyncio.fixture(loop_scope="module")
async def client(gateway: GatewayProcess) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gateway.url, timeout=30.0) as http:
        yield http


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def event(delivery_id: str) -> bytes:
    return json.dumps({"id": delivery_id, "type": "invoice.paid", "marker": delivery_id}).encode()


def carrying(upstream: RecordingUpstream, marker: str) -> list[Execution]:
    """The upstream's executions whose body or webhook id holds ``marker``."""
    return [
        execution
        for execution in upstream.executions
        if marker.encode() in execution.body or execution.headers.get("webhook-id") == marker
    ]


async def post_standard(
    client: httpx.AsyncClient,
    delivery_id: str,
    *,
    secret: str = STANDARD_SECRET,
    at: int | None = None,
    extra: dict[str, str] | None = None,
) -> httpx.Response:
    body = event(delivery_id)
    headers = {**standard_headers(secret, delivery_id, body, at=at), **(extra or {})}
    return await client.post(STANDARD, content=body, headers=headers)


def assert_refused(response: httpx.Response, *, hidden: str = "") -> str:
    """A 401 ``webhook-signature-invalid`` whose detail names no signature it expected."""
    detail = str(assert_problem(response, 401, SIGNATURE_INVALID)["detail"])
    if hidden:
        assert hidden not in response.text
    return detail


async def test_a_standard_webhooks_delivery_sent_again_reaches_the_upstream_once(
    client: httpx.AsyncClient, upstream: RecordingUpstream
) -> None:
    delivery_id = new_id("msg")
    first = await post_standard(client, delivery_id)
    # The sender's retry: the same id and body, signed again later.
    again = await post_standard(client, delivery_id, at=unix_now() + 1)

    assert first.status_code == 201, first.text
    assert "Idempotent-Replayed" not in first.headers
    assert again.status_code == 201
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    (executed,) = carrying(upstream, delivery_id)
    # The upstream gets the delivery as sent, signature and all, to verify itself if it will.
    assert executed.body == event(delivery_id)
    assert executed.headers["webhook-signature"].startswith("v1,")


async def test_a_secret_being_rotated_out_still_verifies(
    client: httpx.AsyncClient, upstream: RecordingUpstream
) -> None:
    delivery_id = new_id("msg")
    response = await post_standard(client, delivery_id, secret=STANDARD_OLD_SECRET)
    assert response.status_code == 201, response.text
    assert len(carrying(upstream, delivery_id)) == 1


async def test_a_forged_delivery_first_poisons_nothing(
    client: httpx.AsyncClient, upstream: RecordingUpstream
) -> None:
    """The attack a signature stops: a fake sent first under the next delivery id."""
    delivery_id = new_id("msg")
    forger = "whsec_" + "Zm9yZ2VkLXNlY3JldC1ndWVzc2VkLWJ5LWFuLWF0dGFja2Vy"
    forged = await post_standard(client, delivery_id, secret=forger)
    expected = standard_headers(STANDARD_SECRET, delivery_id, event(delivery_id))
    assert_refused(forged, hidden=expected["webhook-signature"].removeprefix("v1,"))
    assert carrying(upstream, delivery_id) == []

    real = await post_standard(client, delivery_id)
    assert real.status_code == 201, real.text
    assert "Idempotent-Replayed" not in real.headers
    assert len(carrying(upstream, delivery_id)) == 1


@pytest.mark.parametrize(("offset", "words"), [(-STALE, "ago"), (STALE, "ahead")])
async def test_a_signature_made_outside_the_tolerance_is_refused(
    client: httpx.AsyncClient, upstream: RecordingUpstream, offset: int, words: str
) -> None:
    delivery_id = new_id("msg")
    response = await post_standard(client, delivery_id, at=unix_now() + offset)
    assert words in assert_refused(response)
    assert carrying(upstream, delivery_id) == []


async def test_several_signatures_in_one_field_verify_when_one_matches(
    client: httpx.AsyncClient, upstream: RecordingUpstream
) -> None:
    delivery_id = new_id("msg")
    body = event(delivery_id)
    headers = standard_headers(STANDARD_SECRET, delivery_id, body)
    headers["webhook-signature"] = "v1,AAAA " + headers["webhook-signature"]
    response = await client.post(STANDARD, content=body, headers=headers)
    assert response.status_code == 201, response.text
    assert len(carrying(upstream, delivery_id)) == 1


@pytest.mark.parametrize(
    ("path", "field"),
    [
        (STANDARD, "webhook-signature"),
        (STANDARD, "webhook-timestamp"),
        (GITHUB, "x-hub-signature-256"),
        (STRIPE, "stripe-signature"),
    ],
)
async def test_a_missing_signature_field_is_refused(
    client: httpx.AsyncClient, upstream: RecordingUpstream, path: str, field: str
) -> None:
    delivery_id = new_id("evt")
    body = event(delivery_id)
    headers = {
        **standard_headers(STANDARD_SECRET, delivery_id, body),
        "x-github-delivery": delivery_id,
        "x-hub-signature-256": github_signature(GITHUB_SECRET, body),
        "stripe-signature": stripe_signature(STRIPE_SECRET, body),
    }
    del headers[field]
    response = await client.post(path, content=body, headers=headers)
    assert field in assert_refused(response)
    assert carrying(upstream, delivery_id) == []


async def test_github_signs_as_its_documented_test_vector(
    client: httpx.AsyncClient, upstream: RecordingUpstream
) -> None:
    assert github_signature(GITHUB_SECRET, GITHUB_PAYLOAD) == GITHUB_VECTOR
    delivery_id = str(uuid.uuid4())
    headers = {"X-GitHub-Delivery": delivery_id, "X-Hub-Signature-256": GITHUB_VECTOR}

    first = await client.post(GITHUB, content=GITHUB_PAYLOAD, headers=headers)
    again = await client.post(GITHUB, content=GITHUB_PAYLOAD, headers=headers)

    assert first.status_code == 201, first.text
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    ran = [e for e in upstream.executions if e.headers.get("x-github-delivery") == delivery_id]
    assert len(ran) == 1


@pytest.mark.parametrize(
    "signature",
    [
        GITHUB_VECTOR[:-1] + "f",  # one digit off
        GITHUB_VECTOR.replace("sha256=", "sha1="),
        "sha256=",
        GITHUB_VECTOR.upper(),  # SHA256= is no algorithm GitHub names
    ],
)
async def test_a_forged_github_signature_is_refused(
    client: httpx.AsyncClient, upstream: RecordingUpstream, signature: str
) -> None:
    delivery_id = str(uuid.uuid4())
    headers = {"X-GitHub-Delivery": delivery_id, "X-Hub-Signature-256": signature}
    response = await client.post(GITHUB, content=GITHUB_PAYLOAD, headers=headers)
    assert_refused(response, hidden=GITHUB_VECTOR.removeprefix("sha256="))
    assert [
        e for e in upstream.executions if e.headers.get("x-github-delivery") == delivery_id
    ] == []


async def test_a_stripe_event_is_keyed_by_its_id_and_delivered_once(
    client: httpx.AsyncClient, upstream: RecordingUpstream
) -> None:
    event_id = new_id("evt")
    body = event(event_id)
    signature = stripe_signature(STRIPE_SECRET, body)
    # What Stripe's own SDK accepts, the gateway accepts.
    assert stripe.Webhook.construct_event(body.decode(), signature, STRIPE_SECRET).id == event_id

    first = await client.post(STRIPE, content=body, headers={"Stripe-Signature": signature})
    resigned = stripe_signature(STRIPE_SECRET, body, at=unix_now() + 1)
    again = await client.post(STRIPE, content=body, headers={"Stripe-Signature": resigned})

    assert first.status_code == 201, first.text
    assert again.headers["Idempotent-Replayed"] == "true"
    assert again.content == first.content
    assert len(carrying(upstream, event_id)) == 1


async def test_a_body_naming_its_id_twice_is_never_answered_as_another_delivery(
    client: httpx.AsyncClient, upstream: RecordingUpstream
) -> None:
    """Parsers differ on which of two "id" members counts, so the body that names both and
    the body that names only the later one are different requests: the second gets a 422,
    never the first's stored answer."""
    shadowed, later = new_id("evt"), new_id("evt")
    twice = f'{{"id": "{shadowed}", "id": "{later}"}}'.encode()
    once = f'{{"id": "{later}"}}'.encode()
    answers = [
        await client.post(
            STRIPE,
            content=body,
            headers={
                "Stripe-Signature": stripe_signature(STRIPE_SECRET, body),
                "Content-Type": "application/json",
            },
        )
        for body in (twice, once)
    ]
    assert answers[0].status_code == 201, answers[0].text
    assert_problem(answers[1], 422, "idempotency-key-reused")
    assert "Idempotent-Replayed" not in answers[1].headers
    assert [execution.body for execution in carrying(upstream, later)] == [twice]


async def test_stripe_signatures_are_held_to_the_routes_tolerance(
    client: httpx.AsyncClient, upstream: RecordingUpstream
) -> None:
    event_id = new_id("evt")
    body = event(event_id)
    # Inside the SDK's 300 s default, outside the route's 120 s.
    signed_at = unix_now() - STRIPE_TOLERANCE - 60
    signature = stripe_signature(STRIPE_SECRET, body, at=signed_at)
    assert stripe.Webhook.construct_event(body.decode(), signature, STRIPE_SECRET).id == event_id

    response = await client.post(STRIPE, content=body, headers={"Stripe-Signature": signature})
    assert "ago" in assert_refused(response)
    assert carrying(upstream, event_id) == []


async def test_the_signature_covers_the_bytes_sent_not_the_json_they_mean(
    client: httpx.AsyncClient, upstream: RecordingUpstream
) -> None:
    """The fingerprint compares JSON canonically; the signature never does: the same event
    with its keys in another order and other spacing is other bytes, unsigned."""
    event_id = new_id("evt")
    body = event(event_id)
    signature = stripe_signature(STRIPE_SECRET, body)
    reordered = json.dumps(dict(reversed(json.loads(body).items())), indent=1).encode()
    assert json.loads(reordered) == json.loads(body)

    refused = await client.post(STRIPE, content=reordered, headers={"Stripe-Signature": signature})
    assert_refused(refused)
    accepted = await client.post(STRIPE, content=body, headers={"Stripe-Signature": signature})
    assert accepted.status_code == 201, accepted.text
    (executed,) = carrying(upstream, event_id)
    assert executed.body == body


async def test_a_stripe_field_with_one_matching_v1_among_several_verifies(
    client: httpx.AsyncClient, upstream: RecordingUpstream
) -> None:
    event_id = new_id("evt")
    body = event(event_id)
    signature = stripe_signature(STRIPE_SECRET, body)
    timestamp, v1 = signature.split(",")
    rolled = f"{timestamp},v1={'0' * 64},{v1},v0=ignored"
    response = await client.post(STRIPE, content=body, headers={"Stripe-Signature": rolled})
    assert response.status_code == 201, response.text
    assert len(carrying(upstream, event_id)) == 1


def shop_event(delivery_id: object) -> bytes:
    return json.dumps({"events": [{"meta/id": delivery_id, "marker": str(delivery_id)}]}).encode()


async def post_shop(client: httpx.AsyncClient, body: bytes, shop: str) -> httpx.Response:
    headers = {
        "X-Hub-Signature-256": github_signature(GITHUB_SECRET, body),
        "X-Shop-Domain": shop,
        "Content-Type": "application/json",
    }
    return await client.post(SHOPS, content=body, headers=headers)


async def test_a_json_pointer_with_escapes_and_an_index_finds_the_delivery_id(
    client: httpx.AsyncClient, upstream: RecordingUpstream
) -> None:
    delivery_id = uuid.uuid4().int % 10**15  # an integer id is a key too
    body = shop_event(delivery_id)
    first = await post_shop(client, body, "one.example")
    again = await post_shop(client, body, "one.example")
    assert first.status_code == 201, first.text
    assert again.headers["Idempotent-Replayed"] == "true"
    assert len(carrying(upstream, str(delivery_id))) == 1


@pytest.mark.parametrize(
    "document",
    [
        {"events": []},
        {"events": [{"meta": {"id": "nested, not escaped"}}]},
        {"events": {"0": {"meta/id": "an object, not an array"}}},
        {"events": [{"meta/id": {"an": "object"}}]},
        {"events": [{"meta/id": True}]},
        {"events": [{"meta/id": 1.5}]},
        {"events": [{"meta/id": "a space"}]},
    ],
)
async def test_a_delivery_id_the_pointer_cannot_find_is_a_400_that_records_nothing(
    client: httpx.AsyncClient, upstream: RecordingUpstream, document: dict[str, Any]
) -> None:
    marker = new_id("shop")
    body = json.dumps({**document, "marker": marker}).encode()
    response = await post_shop(client, body, "one.example")
    assert_problem(response, 400, "webhook-delivery-unidentified")
    assert carrying(upstream, marker) == []


async def test_the_same_delivery_id_from_two_tenants_is_two_deliveries(
    client: httpx.AsyncClient, upstream: RecordingUpstream
) -> None:
    delivery_id = new_id("shop")
    body = shop_event(delivery_id)
    one = await post_shop(client, body, "one.example")
    two = await post_shop(client, body, "two.example")
    one_again = await post_shop(client, body, "one.example")

    assert one.status_code == two.status_code == 201
    assert "Idempotent-Replayed" not in two.headers
    assert one_again.headers["Idempotent-Replayed"] == "true"
    assert one_again.content == one.content
    assert len(carrying(upstream, delivery_id)) == 2
    missing = await client.post(
        SHOPS, content=body, headers={"X-Hub-Signature-256": github_signature(GITHUB_SECRET, body)}
    )
    assert_problem(missing, 400, "webhook-delivery-unidentified")


async def test_two_senders_under_one_operation_keep_their_delivery_ids_apart(
    client: httpx.AsyncClient, upstream: RecordingUpstream
) -> None:
    delivery_id = str(uuid.uuid4())
    body = json.dumps({"marker": delivery_id}).encode()
    headers = {
        "X-GitHub-Delivery": delivery_id,
        "X-Hub-Signature-256": github_signature(GITHUB_SECRET, body),
    }
    answers = [
        await client.post(path, content=body, headers=headers) for path in (SENDER_A, SENDER_B)
    ]
    assert [answer.status_code for answer in answers] == [201, 201]
    assert all("Idempotent-Replayed" not in answer.headers for answer in answers)
    assert len(carrying(upstream, delivery_id)) == 2


async def test_a_route_spelled_unsigned_dedupes_without_a_signature(
    client: httpx.AsyncClient, upstream: RecordingUpstream
) -> None:
    delivery_id = new_id("internal")
    body = event(delivery_id)
    answers = [
        await client.post(UNSIGNED, content=body, headers={"X-Delivery": delivery_id})
        for _ in range(2)
    ]
    assert [answer.status_code for answer in answers] == [201, 201]
    assert answers[1].headers["Idempotent-Replayed"] == "true"
    assert len(carrying(upstream, delivery_id)) == 1
    missing = await client.post(UNSIGNED, content=event(new_id("internal")))
    assert_problem(missing, 400, "webhook-delivery-unidentified")


@pytest.mark.parametrize(
    "fields",
    [
        # Two signature fields, both genuine: which one counts would be each reader's guess.
        "twice",
        # A byte no ASCII signature holds, which an HTTP client would refuse to send.
        "latin-1",
        # The signed id, and another id in another spelling of the name: one field to the
        # gateway's reader, two to a reader that keeps the case.
        "id-respelled",
    ],
)
async def test_signature_fields_an_http_client_would_not_send_are_refused(
    gateway: GatewayProcess, upstream: RecordingUpstream, fields: str
) -> None:
    delivery_id = new_id("msg")
    body = event(delivery_id)
    signed = standard_headers(STANDARD_SECRET, delivery_id, body)
    headers = [(name.encode(), value.encode()) for name, value in signed.items()]
    if fields == "twice":
        headers.append((b"webhook-signature", signed["webhook-signature"].encode()))
    elif fields == "id-respelled":
        headers.append((b"WEBHOOK-ID", new_id("msg").encode()))
    else:
        headers = [
            (name, value + b"\xff" if name == b"webhook-signature" else value)
            for name, value in headers
        ]
    raw = request_bytes(b"POST", STANDARD.encode(), headers, body)
    reply = await asyncio.to_thread(exchange, gateway.port, raw)
    assert reply is not None
    assert reply.status == 401, reply
    assert reply.slug() == SIGNATURE_INVALID
    assert carrying(upstream, delivery_id) == []


@pytest.mark.multiprocess
async def test_a_storm_of_one_delivery_across_three_processes_reaches_the_upstream_once(
    tmp_path_factory: pytest.TempPathFactory,
    postgres_url: str,
    upstream: RecordingUpstream,
    gateway: GatewayProcess,
    client: httpx.AsyncClient,
) -> None:
    others = [
        webhook_gateway(tmp_path_factory, postgres_url, upstream, f"webhooks-{index}")
        for index in range(2)
    ]
    await asyncio.gather(*(other.start() for other in others))
    try:
        urls = [gateway.url, *(other.url for other in others)]
        delivery_id = new_id("msg")
        body = event(delivery_id)
        gate = f"gate={delivery_id}"

        async def deliver(index: int) -> httpx.Response:
            # Each copy signed anew, as a sender's retries are; the gate is no signed field.
            headers = {**standard_headers(STANDARD_SECRET, delivery_id, body)}
            headers[BEHAVIOR_HEADER] = gate
            return await client.post(urls[index % 3] + STANDARD, content=body, headers=headers)

        storm = [asyncio.create_task(deliver(index)) for index in range(30)]
        await upstream.wait_arrived(delivery_id, timeout=30.0)
        await eventually(
            lambda: sum(task.done() for task in storm) == len(storm) - 1,
            timeout=30.0,
            message="every duplicate answered while the first is held at the upstream",
        )
        assert len(carrying(upstream, delivery_id)) == 1
        upstream.release(delivery_id)
        answers = await asyncio.gather(*storm)

        assert sorted({answer.status_code for answer in answers}) == [201, 409]
        assert sum(answer.status_code == 201 for answer in answers) == 1
        for url in urls:
            replay = await client.post(
                url + STANDARD,
                content=body,
                headers=standard_headers(STANDARD_SECRET, delivery_id, body),
            )
            assert replay.headers["Idempotent-Replayed"] == "true", url
        assert len(carrying(upstream, delivery_id)) == 1
    finally:
        await asyncio.gather(*(other.stop() for other in others), return_exceptions=True)
