"""A request's fingerprint costs bounded CPU and memory and never stalls its worker.

JSON bodies up to the route's ``max_canonical_body`` compare canonically (another key order
replays); larger ones byte for byte. A body over ``OFFLOAD_ABOVE`` bytes is fingerprinted in a
worker thread, and the event loop's lag, which the gateway reports as a metric, stays far below
what a canonical form of a body at the size limit used to cost (about ten seconds).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import threading
import uuid
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import REGISTRY
from pydantic import ValidationError

from benchmarks.bodies import MAX_BODY, numbers
from idempotency_gateway.config import MAX_CANONICAL_BODY, IdempotencyConfig
from idempotency_gateway.idempotency.fingerprint import (
    OFFLOAD_ABOVE,
    CanonicalMemo,
    canonical_json,
    fingerprint,
    request_hash,
)
from idempotency_gateway.telemetry.loop_lag import LoopLagMonitor
from tests.support import RecordingUpstream
from tests.support.gateway import GatewayLauncher, route
from tests.support.keyed import is_replay, keyed_gateway_config, send_keyed
from tests.support.waiting import eventually
from tests.test_fingerprint_exact import as_json, values

# Bodies of megabytes: seconds. test_fingerprint_exact keeps the fingerprint in the fast
# loop.
pytestmark = pytest.mark.slow

JSON = [(b"content-type", b"application/json")]
# A stall longer than this on a worker would be a defect: it is a thirtieth of the default
# lease, and a tenth of what fingerprinting a 10 MiB JSON body took on the event loop. The
# bound is generous on purpose: the tests share two loaded CPUs with other processes.
STALL_BOUND = "1.0"
LAG = "idempotency_gateway_event_loop_lag_seconds"


def hashed(body: bytes, *, max_canonical_body: int = 64 * 1024) -> str:
    return request_hash(
        method="POST",
        path=b"/v1/charges",
        query_string=b"",
        headers=JSON,
        body=body,
        max_canonical_body=max_canonical_body,
    )


def lag_samples(*, above: str) -> tuple[float, float]:
    """How many lag samples there are, and how many were over ``above`` seconds."""
    total = REGISTRY.get_sample_value(LAG + "_count") or 0.0
    within = REGISTRY.get_sample_value(LAG + "_bucket", {"le": above}) or 0.0
    return total, total - within


# -- the canonical form --------------------------------------------------------------------


def respelled(value: Any, shuffle: random.Random) -> bytes:
    """``value`` as JSON with members in another order, other whitespace and numbers written
    another way: the same document to any JSON reader."""
    if isinstance(value, dict):
        names = list(value)
        shuffle.shuffle(names)
        members = (
            json.dumps(name).encode() + b" : " + respelled(value[name], shuffle) for name in names
        )
        return b"{ " + b" ,\n".join(members) + b" }"
    if isinstance(value, list):
        return b"[ " + b" , ".join(respelled(item, shuffle) for item in value) + b" ]"
    if isinstance(value, int) and not isinstance(value, bool):
        return b"%d.000e0" % value
    return as_json(value)


@settings(max_examples=200, deadline=None)
@given(document=values, seed=st.integers(0, 2**32))
def test_the_same_document_spelled_differently_has_one_canonical_form(
    document: Any, seed: int
) -> None:
    body = as_json(document)
    other = respelled(document, random.Random(seed))

    assert canonical_json(b"application/json", body) is not None
    assert canonical_json(b"application/json", other) == canonical_json(b"application/json", body)


@pytest.mark.parametrize(
    ("body", "canonical"),
    [
        # The forms fingerprints recorded before this release: a retry across the upgrade
        # still matches its record.
        (b'{"b": [1, 2.50, -0, 1e3], "a": "x"}', b'{"a":"x","b":[1E0,25E-1,0,1E3]}'),
        (b"[100, -120, 0.0012, 12E-2, -0.0]", b"[1E2,-12E1,12E-4,12E-2,0]"),
        (b'{"\\u00e9": 1, "z": 2, "\\ud83d\\ude00": 3}', '{"z":2E0,"é":1E0,"😀":3E0}'.encode()),
    ],
)
def test_canonical_forms_are_the_ones_recorded_before(body: bytes, canonical: bytes) -> None:
    assert canonical_json(b"application/json", body) == canonical


def test_nesting_past_what_the_writer_takes_is_compared_as_bytes() -> None:
    deep = b"[" * 300 + b"]" * 300

    assert canonical_json(b"application/json", deep) is None
    assert hashed(deep) == hashed(deep)


# -- the size limit ------------------------------------------------------------------------


def test_json_over_the_limit_is_compared_byte_for_byte() -> None:
    body, reordered = b'{"amount": 1000, "currency": "usd"}', b'{"currency":"usd","amount":1e3}'

    assert hashed(reordered, max_canonical_body=len(reordered)) == hashed(
        body, max_canonical_body=len(body)
    )
    assert hashed(reordered, max_canonical_body=len(body) - 1) != hashed(
        body, max_canonical_body=len(body) - 1
    )
    assert hashed(body, max_canonical_body=0) == hashed(body, max_canonical_body=0)


def test_the_limit_is_validated_and_read_as_a_size() -> None:
    assert IdempotencyConfig().max_canonical_body == 64 * 1024
    assert (
        IdempotencyConfig.model_validate({"max_canonical_body": "1KiB"}).max_canonical_body == 1024
    )
    for refused in (-1, MAX_CANONICAL_BODY + 1):
        with pytest.raises(ValidationError, match="max_canonical_body"):
            IdempotencyConfig.model_validate({"max_canonical_body": refused})


# -- off the event loop --------------------------------------------------------------------


async def test_a_large_body_is_fingerprinted_off_the_event_loop() -> None:
    """The fingerprint waits for the loop to run something else first: on the loop it could
    never see that happen, and would give up instead."""
    loop_ran = threading.Event()
    body = numbers(OFFLOAD_ABOVE + 10)
    assert len(body) > OFFLOAD_ABOVE

    def waits_for_the_loop() -> str:
        return hashed(body) if loop_ran.wait(timeout=10) else "stalled the loop"

    async def other_request() -> None:
        loop_ran.set()

    result, _ = await asyncio.gather(
        fingerprint(waits_for_the_loop, body_size=len(body)), other_request()
    )

    assert result == hashed(body)


async def test_a_small_body_is_fingerprinted_on_the_loop() -> None:
    threads: list[threading.Thread] = []

    def records_its_thread() -> str:
        threads.append(threading.current_thread())
        return "done"

    assert await fingerprint(records_its_thread, body_size=OFFLOAD_ABOVE) == "done"
    assert threads == [threading.current_thread()]


async def test_the_lag_metric_sees_a_stalled_loop() -> None:
    monitor = LoopLagMonitor(every=0.01)
    monitor.start()
    try:
        _, stalls_before = lag_samples(above="0.25")
        threading.Event().wait(0.3)  # the stall being measured: the loop runs nothing
        await eventually(lambda: lag_samples(above="0.25")[1] > stalls_before)
    finally:
        monitor.stop()


# -- through the gateway -------------------------------------------------------------------


async def test_equal_json_in_another_key_order_replays(postgres_url: str) -> None:
    key = f"reorder-{uuid.uuid4()}"
    async with RecordingUpstream() as upstream, GatewayLauncher() as gateways:
        gateway = await gateways.start(
            keyed_gateway_config(upstream.url), database_url=postgres_url
        )

        first = await send_keyed(gateway.client, key, json={"amount": 1000, "currency": "usd"})
        again = await send_keyed(gateway.client, key, json={"currency": "usd", "amount": 1e3})

    assert first.status_code == again.status_code == 201
    assert is_replay(again)
    assert upstream.count(key) == 1


async def test_a_reordered_body_over_the_route_limit_is_another_request(
    postgres_url: str,
) -> None:
    key = f"reorder-big-{uuid.uuid4()}"
    async with RecordingUpstream() as upstream, GatewayLauncher() as gateways:
        config = keyed_gateway_config(
            upstream.url, routes=[route("/", key="required", max_canonical_body="16B")]
        )
        gateway = await gateways.start(config, database_url=postgres_url)

        first = await send_keyed(gateway.client, key, json={"amount": 1000, "currency": "usd"})
        same_bytes = await send_keyed(gateway.client, key, json={"amount": 1000, "currency": "usd"})
        reordered = await send_keyed(gateway.client, key, json={"currency": "usd", "amount": 1000})

    assert first.status_code == 201
    assert is_replay(same_bytes)
    assert reordered.status_code == 422
    assert upstream.count(key) == 1


async def test_json_bodies_at_the_size_limits_do_not_stall_the_worker(postgres_url: str) -> None:
    """Numbers at both limits at once: as much JSON as the route canonicalizes (1 MiB) and as
    large a body as the gateway takes (10 MiB, hashed as bytes). The worker's loop keeps its
    lag under the bound, and another client's request on it is answered meanwhile."""
    small_key = f"small-{uuid.uuid4()}"
    bodies = {f"big-{uuid.uuid4()}": numbers(size) for size in (MAX_CANONICAL_BODY, MAX_BODY)}
    assert canonical_json(b"application/json", next(iter(bodies.values()))) is not None
    async with RecordingUpstream() as upstream, GatewayLauncher() as gateways:
        config = keyed_gateway_config(
            upstream.url,
            routes=[route("/", key="required", max_canonical_body=MAX_CANONICAL_BODY)],
            limits={"max_request_body": MAX_BODY},
        )
        gateway = await gateways.start(config, database_url=postgres_url)
        samples_before, stalls_before = lag_samples(above=STALL_BOUND)

        *big, small = await asyncio.gather(
            *(
                gateway.client.post(
                    "/v1/charges",
                    content=body,
                    headers={"Idempotency-Key": key, "Content-Type": "application/json"},
                )
                for key, body in bodies.items()
            ),
            send_keyed(gateway.client, small_key),
        )
        samples, stalls = lag_samples(above=STALL_BOUND)

    assert [response.status_code for response in (*big, small)] == [201, 201, 201]
    assert [response.json()["body_sha256"] for response in big] == [
        hashlib.sha256(body).hexdigest() for body in bodies.values()
    ]
    assert samples > samples_before  # the monitor ran meanwhile
    assert stalls == stalls_before


@settings(max_examples=200, deadline=None)
@given(values)
def test_the_canonical_memo_answers_what_canonical_json_answers(value: Any) -> None:
    """A memo, not a second function: first sight and every repeat agree with the canonical
    form worked out afresh, a body compared as bytes (``None``) included."""
    memo = CanonicalMemo(max_entries=4, max_body=OFFLOAD_ABOVE, max_bytes=1 << 20)
    body = as_json(value)
    for content_type in (b"application/json", b"text/plain"):
        expected = canonical_json(content_type, body)
        assert [memo.canonical_json(content_type, body) for _ in range(2)] == [expected] * 2


def test_the_canonical_memo_keeps_its_bounds() -> None:
    memo = CanonicalMemo(max_entries=3, max_body=64, max_bytes=40)
    bodies = [b'{"n": %d, "pad": "%s"}' % (index, b"x" * index) for index in range(10)]
    duplicate_keys = b'{"a": 1, "a": 2}'

    for body in [*bodies, duplicate_keys, b'{"big": "%s"}' % (b"y" * 64)]:
        assert memo.canonical_json(b"application/json", body) == canonical_json(
            b"application/json", body
        )
        assert len(memo) <= 3
        assert memo.size_bytes <= 40
