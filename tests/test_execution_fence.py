"""A stalled owner sends nothing after losing its lease: two gateway processes on PostgreSQL.

The upstream answers the first attempt of a key 503 with ``Retry-After: 2``; while its owner
(gateway ``owner``) waits to retry, it stalls past its 1 s lease: SIGSTOP, or its database link
paused (bytes stop, nothing closes). A duplicate through gateway ``other`` takes the record
over. When the owner resumes, its confirmation after the pause fails (fenced, or the store
does not answer) and it sends nothing more: on an ``on_ambiguous: retry`` route the key
executes once (the takeover's run); on a ``fail`` route the takeover settles it as "outcome
unknown" and it never executes.

The gateways serve both routes and are shared by the module's tests (each test its own keys,
and the upstream counts per key); the owner reaches PostgreSQL through a pausable forwarder.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime

import httpx
import pytest
import pytest_asyncio

from idempotency_gateway.config import StoreConfig
from idempotency_gateway.storage import open_store
from idempotency_gateway.storage.base import RecordStore
from idempotency_gateway.storage.records import Record, Status
from tests.support import GatewayProcess, RecordingUpstream, eventually, write_config
from tests.support.gateway import route
from tests.support.keyed import keyed_gateway_config, record_key, send_keyed
from tests.support.problems import assert_problem
from tests.support.tcp_proxy import TcpProxy

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

LEASE = "1s"
# 503 to the key's first attempt, and a Retry-After the owner waits out before its next one.
FIRST_BUSY = "status-first=503,retry-after=2"
# Store timeouts short enough that a paused database link fails a renewal within the lease.
STORE = {"connect_timeout": "500ms", "statement_timeout": "500ms"}
ROUTES = ("retry", "fail")


@dataclass
class Fleet:
    owner: GatewayProcess
    other: GatewayProcess
    to_owner: httpx.AsyncClient
    to_other: httpx.AsyncClient
    link: TcpProxy
    """The owner's connection to PostgreSQL."""
    upstream: RecordingUpstream
    store: RecordStore


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def fleet(
    postgres_url: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Fleet]:
    directory = tmp_path_factory.mktemp("fence")
    async with contextlib.AsyncExitStack() as stack:
        upstream = await stack.enter_async_context(RecordingUpstream())
        link = await stack.enter_async_context(TcpProxy("127.0.0.1", 5432))
        config = keyed_gateway_config(
            upstream.url,
            routes=[
                route(f"/v1/{name}", key="required", lease=LEASE, on_ambiguous=name)
                for name in ROUTES
            ],
            retry={"max_attempts": 3, "cap": "5s"},
            store=STORE,
        )
        path = write_config(directory, config.model_dump(mode="json"))

        def gateway(name: str, database_url: str) -> GatewayProcess:
            process = GatewayProcess(
                path,
                env={"GATEWAY_DATABASE_URL": database_url},
                log_dir=directory / name,
                name=name,
                # Two gateways start at once on a busy test machine.
                startup_timeout=60.0,
            )
            stack.push_async_callback(process.close)
            return process

        owner = gateway("owner", link.rewrite_url(postgres_url))
        other = gateway("other", postgres_url)
        await asyncio.gather(owner.start(), other.start())
        # A connection for each request: kept alive between the module's tests, an idle
        # connection could be reused at the moment the gateway closed it for idling (uvicorn's
        # keep-alive timeout, 5 s), a race that fails the request in any HTTP/1.1 client.
        fresh = httpx.Limits(max_keepalive_connections=0)
        to_owner, to_other = [
            await stack.enter_async_context(
                httpx.AsyncClient(base_url=each.url, timeout=30.0, trust_env=False, limits=fresh)
            )
            for each in (owner, other)
        ]
        store = open_store(postgres_url, StoreConfig())
        stack.push_async_callback(store.close)
        yield Fleet(owner, other, to_owner, to_other, link, upstream, store)


async def lease_over(store: RecordStore, key: str, path: str) -> bool:
    record = await store.get(record_key(key, path=path))
    assert record is not None
    return record.status is Status.IN_PROGRESS and record.lease_expires_at < datetime.now(UTC)


def assert_settled_by_the_takeover(
    on_ambiguous: str, duplicate: httpx.Response, upstream: RecordingUpstream, key: str
) -> None:
    if on_ambiguous == "retry":
        assert duplicate.status_code == 201, duplicate.text
        # The owner's 503, then the takeover's one execution.
        assert [each.number for each in upstream.executions_for(key)][1:] == [
            int(duplicate.headers["x-upstream-execution"])
        ]
    else:
        assert_problem(duplicate, 504, "outcome-unknown")
        assert upstream.count(key) == 1  # only the 503


async def stall_owner_past_takeover(
    fleet: Fleet,
    *,
    stall: Callable[[], None],
    resume: Callable[[], None],
    key: str,
    on_ambiguous: str,
) -> tuple[httpx.Response | None, Record]:
    """Run the scenario; return the key's record and what the stalled owner's client got in
    the end (``None``:
    its answer was cut short, as every answer that is not the record's is)."""
    path = f"/v1/{on_ambiguous}"
    upstream = fleet.upstream
    owner_request = asyncio.create_task(
        send_keyed(fleet.to_owner, key, path=path, behavior=FIRST_BUSY)
    )
    try:
        await eventually(lambda: upstream.count(key) == 1, message="the first attempt")
        stall()
        await eventually(
            lambda: lease_over(fleet.store, key, path), message="the owner's lease over"
        )
        duplicate = await send_keyed(fleet.to_other, key, path=path, behavior=FIRST_BUSY)
        assert_settled_by_the_takeover(on_ambiguous, duplicate, upstream, key)
        executed = upstream.count(key)
        resume()
        try:
            answer: httpx.Response | None = await owner_request
        except httpx.RemoteProtocolError:
            answer = None
    finally:
        resume()
        owner_request.cancel()
        print(f"--- owner log ---\n{fleet.owner.log_tail()}")
        print(f"--- other log ---\n{fleet.other.log_tail()}")
    # The owner woke up, found out, and sent nothing more.
    assert upstream.count(key) == executed
    record = await fleet.store.get(record_key(key, path=path))
    assert record is not None
    assert record.status is (Status.SUCCEEDED if on_ambiguous == "retry" else Status.FAILED_FINAL)
    return answer, record


@pytest.mark.parametrize("on_ambiguous", ROUTES)
@pytest.mark.parametrize("stall", ["sigstop", "database-link-paused"])
async def test_an_owner_stalled_past_its_lease_sends_nothing_after_the_takeover(
    fleet: Fleet, unique: Callable[[str], str], on_ambiguous: str, stall: str
) -> None:
    stopped = stall == "sigstop"
    answer, record = await stall_owner_past_takeover(
        fleet,
        stall=fleet.owner.pause if stopped else fleet.link.pause,
        resume=fleet.owner.resume if stopped else fleet.link.resume,
        key=unique(stall),
        on_ambiguous=on_ambiguous,
    )
    # Never an answer of its own as if it were final: the answer of record, replayed whole;
    # told to ask again; a 503 when it could not record anything either; or cut short.
    assert answer is None or answer.status_code in (409, 503) or is_answer_of(record, answer)


def is_answer_of(record: Record, answer: httpx.Response) -> bool:
    assert record.response is not None
    replayed: bool = answer.headers.get("idempotent-replayed") == "true"
    return (
        replayed
        and answer.status_code == record.response.status
        and answer.content == record.response.body
    )
