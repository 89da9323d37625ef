"""A hostile upstream: raw answers with trailers, odd transfer codings, bad lengths, early closes.

The gateway stores the first answer to a key and replays it for the key's whole ttl, so the
one thing that must never happen is an answer stored that the upstream did not send whole:
a body cut short, a trailer merged into the fields, a coding the client cannot undo. The
upstream here writes exactly the bytes each test (or hypothesis) scripts, then closes or
resets the connection; every answer says ``Connection: close``, so no example's connection
carries over to the next one.
"""

from __future__ import annotations

import asyncio
import socket
import struct
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Literal

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from pydantic import SecretStr

from idempotency_gateway.main import create_gateway
from tests.support.background import InBackgroundThread
from tests.support.gateway import CLI_SERVER_OPTIONS, gateway_config, route
from tests.support.problems import problem_slug
from tests.support.raw_upstream import RawUpstream, Received, until_closed
from tests.support.servers import TEST_SCOPE_SECRET, serve_asgi

Ending = Literal["close", "reset", "hold"]
# Upstreams that misbehave at length: seconds. test_proxy and test_upstream_client keep
# the upstream side in the fast loop.
pytestmark = pytest.mark.slow

STATUSES = (200, 201, 418)  # answers the gateway stores; it never makes one of these itself
TRAILERS = (
    b"Set-Cookie: session=from-a-trailer",
    b"Idempotent-Replayed: true",
    b"Content-Length: 99999",
    b"X-Late: 1",
)


@dataclass(frozen=True)
class RawAnswer:
    wire: bytes
    """Everything the upstream would write for the whole answer."""
    head_size: int
    status: int
    body: bytes | None
    """The content of the answer once whole; ``None``: no reading of it is whole (a coding the
    gateway must not relay, a length that is no length)."""
    whole_at: int
    """Bytes of ``wire`` after which the answer is whole (for close-delimited answers: all
    that was written, if the connection then closes cleanly)."""
    body_at: int = -1
    """Bytes after which its body is whole though the answer is not (a trailer section still
    to come, which the gateway may drop unread); ``whole_at`` unless said."""
    close_delimited: bool = False
    sent: int | None = None
    """Bytes of ``wire`` written before the ending; ``None`` writes all of it."""
    ending: Ending = "close"

    @property
    def written(self) -> bytes:
        return self.wire if self.sent is None else self.wire[: self.sent]

    @property
    def whole(self) -> bool:
        return len(self.written) >= self.whole_at

    def expected(self) -> bytes | None:
        """The body a client may be given as the upstream's answer; ``None``: none at all."""
        written = len(self.written)
        if self.body is None or written < (self.whole_at if self.body_at < 0 else self.body_at):
            return None
        if self.close_delimited:
            return self.wire[self.head_size : written] if self.ending == "close" else None
        return self.body


def _head(status: int, fields: list[bytes]) -> bytes:
    lines = [b"HTTP/1.1 %d Answer" % status, b"Connection: close", *fields]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def chunked(
    status: int, body: bytes, cuts: list[int], trailers: list[bytes], extension: bytes = b""
) -> RawAnswer:
    head = _head(status, [b"Transfer-Encoding: chunked"])
    pieces = [body[start:end] for start, end in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    encoded = b"".join(b"%x%s\r\n%s\r\n" % (len(p), extension, p) for p in pieces if p)
    last_chunk = head + encoded + b"0\r\n"
    wire = last_chunk + b"".join(t + b"\r\n" for t in trailers) + b"\r\n"
    return RawAnswer(wire, len(head), status, body, len(wire), body_at=len(last_chunk))


def with_length(status: int, body: bytes, extra: bytes = b"") -> RawAnswer:
    head = _head(status, [b"Content-Length: %d" % len(body)])
    return RawAnswer(head + body + extra, len(head), status, body, len(head) + len(body))


def close_delimited(status: int, body: bytes) -> RawAnswer:
    head = _head(status, [])
    return RawAnswer(head + body, len(head), status, body, len(head), close_delimited=True)


def unrelayable(status: int, body: bytes, fields: list[bytes]) -> RawAnswer:
    head = _head(status, fields)
    return RawAnswer(head + body, len(head), status, None, 0)


CODINGS = [b"gzip, chunked", b"chunked, gzip", b"gzip", b"identity", b"chunked, chunked"]
BAD_LENGTHS = [
    [b"Content-Length: abc"],
    [b"Content-Length: -1"],
    [b"Content-Length: 3, 4"],
    [b"Content-Length: 3", b"Content-Length: 4"],
    [b"Content-Length: 3", b"Transfer-Encoding: chunked"],
]


@st.composite
def raw_answers(draw: st.DrawFn) -> RawAnswer:
    status = draw(st.sampled_from(STATUSES))
    body = draw(st.binary(max_size=300))
    kind = draw(st.sampled_from(["chunked", "length", "extra", "close", "coding", "bad-length"]))
    if kind == "chunked":
        cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=4)))
        trailers = draw(st.lists(st.sampled_from(TRAILERS), max_size=3))
        extension = draw(st.sampled_from([b"", b";name=value", b';name="quoted"']))
        answer = chunked(status, body, cuts, trailers, extension)
    elif kind == "length":
        answer = with_length(status, body)
    elif kind == "extra":
        answer = with_length(status, body, b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n")
    elif kind == "close":
        answer = close_delimited(status, body)
    elif kind == "coding":
        coding = draw(st.sampled_from(CODINGS))
        answer = unrelayable(status, b"5\r\nhello\r\n0\r\n\r\n", [b"Transfer-Encoding: " + coding])
    else:
        answer = unrelayable(status, b"abcd", draw(st.sampled_from(BAD_LENGTHS)))
    sent = draw(st.one_of(st.none(), st.integers(0, len(answer.wire))))
    ending: Ending = draw(st.sampled_from(["close", "reset"]))
    return replace(answer, sent=sent, ending=ending)


def _reset(writer: asyncio.StreamWriter) -> None:
    """End with a TCP reset rather than a clean close: the answer was cut, not ended."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class HostileUpstreamGateway(InBackgroundThread):
    """The gateway (one key-required route, one attempt per request) in front of a raw
    upstream that answers every request with ``answer``, served from a background thread so
    the synchronous hypothesis test can drive it."""

    def __init__(self, *, database_url: str) -> None:
        super().__init__(name="hostile-upstream-gateway", startup_timeout=30.0)
        self.database_url = database_url
        self.answer = with_length(200, b"")
        self.url = ""
        self.requests: list[Received] = []

    async def _answer(
        self, request: Received, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        answer = self.answer
        writer.write(answer.written)
        await writer.drain()
        if answer.ending == "reset":
            _reset(writer)
        elif answer.ending == "hold":
            await until_closed(reader)
        else:
            writer.close()

    async def _serve(self) -> None:
        async with RawUpstream(self._answer) as upstream:
            config = gateway_config(
                upstream.url,
                routes=[route("/", key="required")],
                retry={"max_attempts": 1},
                timeouts={"connect": "1s", "per_try": "5s", "total": "5s"},
            )
            gateway = create_gateway(
                config,
                database_url=self.database_url,
                scope_secret=SecretStr(TEST_SCOPE_SECRET),
            )
            async with serve_asgi(gateway, **CLI_SERVER_OPTIONS) as url:
                self.url = url
                self.requests = upstream.requests
                self._started()
                await self._stopping()


@pytest.fixture(scope="module")
def hostile(postgres_url: str) -> Iterator[HostileUpstreamGateway]:
    with HostileUpstreamGateway(database_url=postgres_url) as running:
        yield running


@pytest.fixture(scope="module")
def client(hostile: HostileUpstreamGateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=hostile.url, timeout=15.0, trust_env=False) as client:
        yield client


def _send(client: httpx.Client, key: str) -> httpx.Response | None:
    """The gateway's answer, or ``None`` when it was cut (the client can tell)."""
    try:
        return client.post("/v1/charges", content=b'{"amount":1}', headers={"Idempotency-Key": key})
    except httpx.TransportError:
        return None


def _is_the_upstreams(response: httpx.Response | None, answer: RawAnswer) -> bool:
    # The gateway's own answers are problems with 5xx statuses; these statuses are the
    # upstream's alone.
    return response is not None and response.status_code == answer.status


def _check(hostile: HostileUpstreamGateway, client: httpx.Client, answer: RawAnswer) -> None:
    hostile.answer = answer
    key = str(uuid.uuid4())
    expected = answer.expected()
    first = _send(client, key)
    if _is_the_upstreams(first, answer):
        assert first is not None
        assert expected is not None, f"a cut or unrelayable answer was relayed: {answer}"
        assert first.content == expected
    replay = _send(client, key)
    if _is_the_upstreams(replay, answer):
        assert replay is not None
        assert expected is not None, f"a cut or unrelayable answer was stored: {answer}"
        assert replay.content == expected
    if expected is not None and answer.ending == "close" and answer.whole:
        # Whole, and ended cleanly: stored as it was, and replayed so (never a second run).
        assert replay is not None
        assert (replay.status_code, replay.content) == (answer.status, expected), answer
        assert replay.headers["idempotent-replayed"] == "true"
        # The upstream's head has neither field: only a trailer could have added one.
        for response in (first, replay):
            assert response is None or not {"set-cookie", "x-late"} & response.headers.keys()


@settings(
    max_examples=120,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(answer=raw_answers())
@example(answer=chunked(200, b"whole", [2], list(TRAILERS)))
@example(answer=replace(with_length(201, b"0123456789"), sent=60))
def test_no_answer_is_stored_that_the_upstream_did_not_send_whole(
    hostile: HostileUpstreamGateway, client: httpx.Client, answer: RawAnswer
) -> None:
    _check(hostile, client, answer)


def test_trailers_reach_neither_the_client_nor_the_record(
    hostile: HostileUpstreamGateway, client: httpx.Client
) -> None:
    hostile.answer = chunked(200, b"charged", [3], list(TRAILERS))
    key = str(uuid.uuid4())
    first = _send(client, key)
    replay = _send(client, key)

    for response in (first, replay):
        assert response is not None
        assert (response.status_code, response.content) == (200, b"charged")
        assert "set-cookie" not in response.headers
        assert "x-late" not in response.headers
    assert first is not None
    assert replay is not None
    assert "idempotent-replayed" not in first.headers
    assert replay.headers["idempotent-replayed"] == "true"


@pytest.mark.parametrize(
    "fields",
    [[b"Transfer-Encoding: " + coding] for coding in CODINGS]
    + [[b"Content-Length: 16", b"Transfer-Encoding: chunked"]],
    ids=[*(coding.decode() for coding in CODINGS), "length-and-chunked"],
)
def test_a_coding_other_than_chunked_or_two_framings_is_a_502_never_relayed(
    hostile: HostileUpstreamGateway, client: httpx.Client, fields: list[bytes]
) -> None:
    hostile.answer = unrelayable(200, b"5\r\nhello\r\n0\r\n\r\n", fields)
    key = str(uuid.uuid4())
    first = _send(client, key)
    assert first is not None
    assert (first.status_code, problem_slug(first.content)) == (502, "upstream-invalid-response")
    replay = _send(client, key)
    assert replay is not None
    assert replay.status_code != 200


def test_a_trailer_field_that_never_ends_is_cut_at_once(
    hostile: HostileUpstreamGateway, client: httpx.Client, caplog: pytest.LogCaptureFixture
) -> None:
    endless = chunked(200, b"charged", [], [b"X-Long: " + b"a" * (200 * 1024)])
    # The field's line never ends and the connection stays open: only the bound on what may
    # come between pieces of body stops it, long before the silence of timeouts.per_try.
    hostile.answer = replace(endless, sent=len(endless.wire) - 4, ending="hold")
    key = str(uuid.uuid4())
    first = _send(client, key)
    replay = _send(client, key)
    assert first is None  # cut after the head and body it was already relaying
    assert replay is not None
    assert (replay.status_code, problem_slug(replay.content)) == (504, "outcome-unknown")
    # Cut by the bound as the field arrived, not by the silence of timeouts.per_try.
    assert "chunk framing or trailer fields" in caplog.text


def test_the_gateways_own_answer_fields_from_the_upstream_are_dropped(
    hostile: HostileUpstreamGateway, client: httpx.Client
) -> None:
    # An upstream keeping idempotency records of its own says so in the gateway's fields.
    owned = [b"Idempotent-Replayed: true", b"Idempotency-Body-Omitted: true"]
    head = _head(201, [b"Content-Length: 7", *owned])
    hostile.answer = RawAnswer(head + b"charged", len(head), 201, b"charged", len(head) + 7)
    key = str(uuid.uuid4())
    first = _send(client, key)
    replay = _send(client, key)

    assert first is not None
    assert replay is not None
    assert (first.status_code, first.content) == (replay.status_code, replay.content)
    assert first.content == b"charged"
    # The first run is no replay, and its stored body was not left out.
    assert first.headers.get_list("idempotent-replayed") == []
    assert replay.headers.get_list("idempotent-replayed") == ["true"]
    for response in (first, replay):
        assert response.headers.get_list("idempotency-body-omitted") == []
