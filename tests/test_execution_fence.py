"""A stalled owner sends nothing after losing its lease: real gateway processes on PostgreSQL.

The upstream answers the first attempt of a key 503 with ``Retry-After: 2``; while its owner
(gateway A) waits to retry, A stalls past its 1 s lease: SIGSTOP, or its database link paused
(bytes stop, nothing closes). A duplicate through gateway B takes the record over. When A
resumes, its confirmation after the pause fails (fenced, or the store does not answer) and it
sends nothing more: on an ``on_ambiguous: retry`` route the key executes once (B's run); on a
``fail`` route the takeover settles it as "outcome unknown" and it never executes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest

from idempotency_gateway.config import StoreConfig
from idempotency_gateway.idempotency.record import Status
from idempotency_gateway.idempotency.store import RecordStore
from tests.support import GatewayProcess, RecordingUpstream, eventually, write_config
from tests.support.gateway import route
from tests.support.keyed import keyed_gateway_config, record_key, send_keyed
from tests.support.problems import assert_problem
from tests.support.tcp_proxy import TcpProxy

LEASE = "1s"
# 503 to the key's first attempt, and a Retry-After the owner waits out before its next one.
FIRST_BUSY = "status-first=503,retry-after=2"
# Store timeouts short enough that a paused database link fails a renewal within the lease.
STORE = {"connect_timeout": "500ms", "statement_timeout": "500ms"}


@pytest.fixture
async def real_time_store(postgres_url: str) -> AsyncIterator[RecordStore]:
    store = RecordStore.from_url(postgres_url, StoreConfig())
    yield store
    await store.close()


def gateway(
    tmp_path: Path, upstream: RecordingUpstream, database_url: str, name: str, on_ambiguous: str
) -> GatewayProcess:
    config = keyed_gateway_config(
        upstream.url,
        routes=[route("/", key="required", lease=LEASE, on_ambiguous=on_ambiguous)],
        retry={"max_attempts": 3, "cap": "5s"},
        store=STORE,
    )
    return GatewayProcess(
        write_config(tmp_path, config.model_dump(mode="json"), name=f"{name}.yaml"),
        env={"GATEWAY_DATABASE_URL": database_url},
        log_dir=tmp_path / name,
        name=name,
    )


async def lease_over(store: RecordStore, key: str) -> bool:
    record = await store.get(record_key(key))
    assert record is not None
    return record.status is Status.IN_PROGRESS and record.lease_expires_at < datetime.now(UTC)


@contextlib.asynccontextmanager
async def clients(*gateways: GatewayProcess) -> AsyncIterator[list[httpx.AsyncClient]]:
    async with contextlib.AsyncExitStack() as stack:
        yield [
            await stack.enter_async_context(
                httpx.AsyncClient(base_url=each.url, timeout=30.0, trust_env=False)
            )
            for each in gateways
        ]


async def assert_settled_by_the_takeover(
    on_ambiguous: str, duplicate: httpx.Response, upstream: RecordingUpstream, key: str
) -> None:
    if on_ambiguous == "retry":
        assert duplicate.status_code == 201, duplicate.text
        # The owner's 503 and the takeover's one execution: nothing from the stalled owner.
        assert [each.number for each in upstream.executions_for(key)][1:] == [
            int(duplicate.headers["x-upstream-execution"])
        ]
    else:
        assert_problem(duplicate, 504, "outcome-unknown")
        assert upstream.count(key) == 1  # only the 503


async def stall_owner_past_takeover(
    owner: GatewayProcess,
    other: GatewayProcess,
    *,
    stall: Callable[[], None],
    resume: Callable[[], None],
    store: RecordStore,
    upstream: RecordingUpstream,
    key: str,
    on_ambiguous: str,
) -> httpx.Response:
    """Run the scenario; return what the stalled owner's client got in the end."""
    async with clients(owner, other) as (to_owner, to_other):
        owner_request = asyncio.create_task(send_keyed(to_owner, key, behavior=FIRST_BUSY))
        try:
            await eventually(lambda: upstream.count(key) == 1, message="the first attempt")
            stall()
            await eventually(lambda: lease_over(store, key), message="the owner's lease over")
            duplicate = await send_keyed(to_other, key, behavior=FIRST_BUSY)
            await assert_settled_by_the_takeover(on_ambiguous, duplicate, upstream, key)
            executed = upstream.count(key)
            resume()
            answer = await owner_request
        finally:
            resume()
            owner_request.cancel()
            print(f"--- owner log ---\n{owner.log_tail()}")
    # The owner woke up, found out, and sent nothing more.
    assert upstream.count(key) == executed
    record = await store.get(record_key(key))
    assert record is not None
    assert record.status is (Status.SUCCEEDED if on_ambiguous == "retry" else Status.FAILED_FINAL)
    return answer


@pytest.mark.parametrize("on_ambiguous", ["retry", "fail"])
async def test_an_owner_stopped_past_its_lease_sends_nothing_after_the_takeover(
    tmp_path: Path,
    postgres_url: str,
    real_time_store: RecordStore,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
    on_ambiguous: str,
) -> None:
    owner = gateway(tmp_path, upstream, postgres_url, "owner", on_ambiguous)
    other = gateway(tmp_path, upstream, postgres_url, "other", on_ambiguous)
    async with owner, other:
        answer = await stall_owner_past_takeover(
            owner,
            other,
            stall=owner.pause,
            resume=owner.resume,
            store=real_time_store,
            upstream=upstream,
            key=unique("stopped-owner"),
            on_ambiguous=on_ambiguous,
        )
    # The stalled owner's client gets the answer of record or is told to ask for it.
    assert answer.status_code in (201 if on_ambiguous == "retry" else 504, 409), answer.text


@pytest.mark.parametrize("on_ambiguous", ["retry", "fail"])
async def test_an_owner_cut_off_from_its_database_sends_nothing_after_the_takeover(
    tmp_path: Path,
    postgres_url: str,
    real_time_store: RecordStore,
    upstream: RecordingUpstream,
    unique: Callable[[str], str],
    on_ambiguous: str,
) -> None:
    async with TcpProxy("127.0.0.1", 5432) as link:
        owner = gateway(tmp_path, upstream, link.rewrite_url(postgres_url), "owner", on_ambiguous)
        other = gateway(tmp_path, upstream, postgres_url, "other", on_ambiguous)
        async with owner, other:
            answer = await stall_owner_past_takeover(
                owner,
                other,
                stall=link.pause,
                resume=link.resume,
                store=real_time_store,
                upstream=upstream,
                key=unique("partitioned-owner"),
                on_ambiguous=on_ambiguous,
            )
    # Its confirmation failed, so it could not record anything either: a 503 that says so,
    # or the answer of record when the link came back in time.
    assert answer.status_code in (201 if on_ambiguous == "retry" else 504, 409, 503), answer.text
