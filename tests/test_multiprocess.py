"""Several real gateway processes on one PostgreSQL database keep the promise together.

Each test launches ``python -m idempotency_gateway.cli serve`` subprocesses that share the test
database and proxy to a RecordingUpstream in the test's loop. They prove that a same-key storm
spread over processes (or over the workers of one process) executes once; that a stalled owner
(SIGSTOP) is fenced off when another process takes its record over, under both ``on_ambiguous``
policies (its own client gets the answer of record, whole, never an answer the record
does not hold, and every retry replays the record's); and that a killed owner (SIGKILL) leaves a
stored "outcome unknown" answer instead of a second execution or a key stuck at 409.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import httpx
import pytest

from tests.support import GatewayProcess, RecordingUpstream, eventually
from tests.support.problems import assert_problem
from tests.support.servers import StartGatewayProcess
from tests.support.upstream import BEHAVIOR_HEADER

pytestmark = pytest.mark.multiprocess

ORDER = {"amount": 1000, "currency": "usd"}
PATH = "/v1/orders"
STORM_SIZE = 40
# Long enough for a takeover to be a real wait, short enough to keep the tests fast.
SHORT_LEASE = "1s"

StartGateways = Callable[..., Awaitable[list[GatewayProcess]]]


def gateway_config(upstream_url: str, *, lease: str, on_ambiguous: str) -> dict[str, Any]:
    """One route covering everything; per-try timeout far beyond any pause in these tests."""
    return {
        "upstreams": {
            "recording": {
                "url": upstream_url,
                "timeouts": {"connect": "1s", "per_try": "60s", "total": "60s"},
            }
        },
        "routes": [
            {
                "name": "orders",
                "match": {"path_prefix": "/"},
                "upstream": "recording",
                "idempotency": {
                    "methods": ["POST"],
                    "key": "required",
                    "lease": lease,
                    "on_ambiguous": on_ambiguous,
                },
            }
        ],
    }


def keyed(key: str, behavior: str | None = None) -> dict[str, str]:
    headers = {"Authorization": "Bearer sk_multiprocess", "Idempotency-Key": key}
    if behavior is not None:
        headers[BEHAVIOR_HEADER] = behavior
    return headers


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30.0) as http:
        yield http


@pytest.fixture
def start_gateways(
    upstream: RecordingUpstream, start_gateway_process: StartGatewayProcess, postgres_url: str
) -> StartGateways:
    """``await start_gateways(count, lease=..., on_ambiguous=..., extra_args=...)``: that many
    gateway processes on the shared PostgreSQL database, started together
    (``start_gateway_process``, which stops them, before ``upstream``, and prints their log
    tails)."""

    async def start(
        count: int,
        *,
        lease: str = "10s",
        on_ambiguous: str = "fail",
        extra_args: Sequence[str] = (),
    ) -> list[GatewayProcess]:
        config = gateway_config(upstream.url, lease=lease, on_ambiguous=on_ambiguous)
        env = {"GATEWAY_DATABASE_URL": postgres_url}
        starts = [
            start_gateway_process(config, env=env, extra_args=extra_args) for _ in range(count)
        ]
        return list(await asyncio.gather(*starts))

    return start


async def post_order(
    client: httpx.AsyncClient, base_url: str, key: str, behavior: str | None = None
) -> httpx.Response:
    return await client.post(base_url + PATH, json=ORDER, headers=keyed(key, behavior))


async def first_answer_other_than_409(
    client: httpx.AsyncClient, base_url: str, key: str
) -> httpx.Response:
    """Retry the request at ``base_url`` until the in-flight 409s stop (the lease ran out)."""

    async def not_in_flight() -> httpx.Response | None:
        response = await post_order(client, base_url, key)
        return None if response.status_code == 409 else response

    return await eventually(
        not_in_flight, timeout=15.0, interval=0.1, message=f"a non-409 answer from {base_url}"
    )


async def assert_replays(
    client: httpx.AsyncClient, base_urls: Sequence[str], key: str, expected: httpx.Response
) -> None:
    """Every gateway replays ``expected`` at once: the record is final before the owner's
    client has the whole answer, so even an immediate retry never meets a 409."""
    for base_url in base_urls:
        replay = await post_order(client, base_url, key)
        assert replay.status_code == expected.status_code, base_url
        assert replay.headers.get("Idempotent-Replayed") == "true", base_url
        assert replay.content == expected.content, base_url


def assert_outcome_unknown(response: httpx.Response) -> None:
    assert_problem(response, 504, "outcome-unknown")


async def storm(
    client: httpx.AsyncClient, upstream: RecordingUpstream, base_urls: Sequence[str], key: str
) -> httpx.Response:
    """Fire ``STORM_SIZE`` identical requests at once, round-robin over ``base_urls``.

    Every request asks to be held at the upstream gate ``storm``; only the one execution ever
    reaches it. Once every other request has answered, the gate opens. Returns the answer of
    the one execution after checking that every other answer was a 409.
    """
    tasks = [
        asyncio.create_task(
            post_order(client, base_urls[index % len(base_urls)], key, "gate=storm")
        )
        for index in range(STORM_SIZE)
    ]
    try:
        await upstream.wait_arrived("storm", timeout=15.0)

        def duplicates_answered() -> bool:
            # A second execution is final: fail at once instead of waiting for the deadline.
            assert upstream.count(key) == 1, f"{upstream.count(key)} upstream executions"
            return sum(task.done() for task in tasks) == STORM_SIZE - 1

        await eventually(
            duplicates_answered,
            timeout=15.0,
            message="every duplicate answered while the first is held at the gate",
        )
        upstream.release("storm")
        answers = await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    executed = [answer for answer in answers if answer.status_code != 409]
    assert len(executed) == 1, [answer.status_code for answer in answers]
    (stored,) = executed
    assert stored.status_code == 201
    assert stored.json()["execution"] == 1
    for conflict in (answer for answer in answers if answer.status_code == 409):
        assert conflict.headers["Retry-After"]
    assert upstream.count(key) == 1
    return stored


async def test_same_key_storm_across_two_processes_executes_once(
    start_gateways: StartGateways,
    upstream: RecordingUpstream,
    client: httpx.AsyncClient,
    unique: Callable[[str], str],
) -> None:
    gateways = await start_gateways(2)
    urls = [gateway.url for gateway in gateways]
    key = unique("storm-two-processes")

    stored = await storm(client, upstream, urls, key)

    await assert_replays(client, urls, key, stored)
    assert upstream.count(key) == 1


async def test_same_key_storm_on_two_workers_of_one_process_executes_once(
    start_gateways: StartGateways,
    upstream: RecordingUpstream,
    client: httpx.AsyncClient,
    unique: Callable[[str], str],
) -> None:
    (gateway,) = await start_gateways(1, extra_args=["--workers", "2"])
    key = unique("storm-two-workers")

    stored = await storm(client, upstream, [gateway.url], key)

    await assert_replays(client, [gateway.url], key, stored)
    assert upstream.count(key) == 1
    # Two worker processes really ran (uvicorn logs one line per worker process). The parent
    # accepts on the shared socket before both workers have finished starting, so a busy
    # machine may still be starting the second one: wait for its line, bounded.
    await eventually(
        lambda: gateway.log_text().count("Started server process") >= 2,
        timeout=20.0,
        message="both workers of the gateway started",
    )


@contextlib.asynccontextmanager
async def stalled_owner(
    client: httpx.AsyncClient, upstream: RecordingUpstream, owner: GatewayProcess, key: str
) -> AsyncIterator[asyncio.Task[httpx.Response]]:
    """Send the request to ``owner``, hold it at the upstream and SIGSTOP ``owner``.

    Yields the owner's client request (a task). On exit the gate opens and the owner
    resumes, so it finishes its execution and tries to finalize.
    """
    request = asyncio.create_task(post_order(client, owner.url, key, "gate=stalled"))
    try:
        await upstream.wait_arrived("stalled", timeout=15.0)
        owner.pause()
        yield request
    finally:
        upstream.release("stalled")
        if owner.running:
            owner.resume()
        if not request.done():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(request), 20.0)
        request.cancel()
        await asyncio.gather(request, return_exceptions=True)


async def assert_owner_was_fenced(
    owner_request: asyncio.Task[httpx.Response],
    owner: GatewayProcess,
    of_record: httpx.Response,
) -> None:
    """The resumed owner lost its finalize to the takeover's fencing token: rather than
    deliver an answer that is not the record's (it held that answer whole, so nothing of it
    went out), it hands its client the answer of record as a replay, and it logs the fenced
    finalize."""
    answer = await owner_request
    assert answer.status_code == of_record.status_code, answer.text
    assert answer.headers.get("idempotent-replayed") == "true"
    assert answer.json() == of_record.json()
    await eventually(
        lambda: "fenced finalize" in owner.log_text(),
        message="the stalled owner logs its fenced finalize",
    )


async def test_stalled_owner_is_fenced_when_retry_policy_executes_again(
    start_gateways: StartGateways,
    upstream: RecordingUpstream,
    client: httpx.AsyncClient,
    unique: Callable[[str], str],
) -> None:
    gateway_a, gateway_b = await start_gateways(2, lease=SHORT_LEASE, on_ambiguous="retry")
    key = unique("stalled-retry")

    async with stalled_owner(client, upstream, gateway_a, key) as owner_request:
        taken_over = await first_answer_other_than_409(client, gateway_b.url, key)

        assert taken_over.status_code == 201
        assert taken_over.json()["execution"] == 2
        first_token, taken_token = (run.fencing_token for run in upstream.executions_for(key))
        assert first_token is not None
        assert taken_token is not None
        assert first_token < taken_token
        assert taken_over.json()["fencing_token"] == taken_token

    # The stalled owner's write is fenced off: the record keeps the takeover's answer, so
    # the owner hands its own client that answer instead of execution 1's...
    await assert_owner_was_fenced(owner_request, gateway_a, taken_over)
    # ...and that client's retry, like every other, gets the answer of record.
    await assert_replays(client, [gateway_a.url, gateway_b.url], key, taken_over)
    assert upstream.count(key) == 2


async def test_stalled_owner_is_fenced_when_fail_policy_stores_outcome_unknown(
    start_gateways: StartGateways,
    upstream: RecordingUpstream,
    client: httpx.AsyncClient,
    unique: Callable[[str], str],
) -> None:
    gateway_a, gateway_b = await start_gateways(2, lease=SHORT_LEASE, on_ambiguous="fail")
    key = unique("stalled-fail")

    async with stalled_owner(client, upstream, gateway_a, key) as owner_request:
        taken_over = await first_answer_other_than_409(client, gateway_b.url, key)

        assert_outcome_unknown(taken_over)
        assert upstream.count(key) == 1
        # From now on every retry gets the stored 504, never a 409.
        await assert_replays(client, [gateway_b.url], key, taken_over)

    # Execution 1's answer is not the record's: its client gets the stored 504 instead.
    await assert_owner_was_fenced(owner_request, gateway_a, taken_over)
    await assert_replays(client, [gateway_a.url, gateway_b.url], key, taken_over)
    assert upstream.count(key) == 1


async def test_killed_owner_leaves_outcome_unknown_not_a_rerun(
    start_gateways: StartGateways,
    upstream: RecordingUpstream,
    client: httpx.AsyncClient,
    unique: Callable[[str], str],
) -> None:
    gateway_a, gateway_b = await start_gateways(2, lease=SHORT_LEASE, on_ambiguous="fail")
    key = unique("killed-owner")

    owner_request = asyncio.create_task(post_order(client, gateway_a.url, key, "gate=killed"))
    await upstream.wait_arrived("killed", timeout=15.0)
    await gateway_a.kill()
    with pytest.raises(httpx.TransportError):
        await owner_request

    after_lease = await first_answer_other_than_409(client, gateway_b.url, key)

    assert_outcome_unknown(after_lease)
    assert upstream.count(key) == 1
    await assert_replays(client, [gateway_b.url], key, after_lease)
    assert upstream.count(key) == 1
