"""Hostile input gets a clear answer, never a 500 or a crash, and never leaks or crosses tenants.

Hypothesis throws raw bytes over real loopback sockets at an in-process gateway (its own
thread and event loop, PostgreSQL records, the recording upstream): ``Idempotency-Key`` fields
(empty, over 255, non-ASCII, control characters, CR/LF injection, several fields, sf-string
edge cases), bodies (not JSON under a JSON type, deep nesting, huge numbers, over the limit,
uploads cut short, slow trickles), paths and query strings (percent-encoding, dot segments,
very long) and odd headers. Every request gets an RFC 9457 problem from the gateway, or the
upstream's answer to exactly the request sent (canonical path, query and body byte for byte),
or, for bytes that are not HTTP at all, the server's 400; never a 500, never an undocumented
5xx; and the gateway still answers afterwards. An independent key parser written from the
spec is the oracle for which keys are accepted.

Schemathesis checks the admin API against its own OpenAPI document (no 5xx, statuses,
content types and bodies as documented). A run with distinctive credentials leaves them in
no record (raw SQL dump), no Redis entry, no log line and no metric. Two tenants hammering the
same keys at once each get only their own executions' answers.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import redis.asyncio
import schemathesis
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from pydantic import SecretStr
from schemathesis import checks
from sqlalchemy import text
from sqlalchemy.ext.asyncio import create_async_engine

from idempotency_gateway.client import IdempotentClient
from idempotency_gateway.config import GatewayConfig
from idempotency_gateway.errors import InvalidRequestTarget
from idempotency_gateway.main import create_gateway
from idempotency_gateway.server.protocol import EdgeProtocol
from idempotency_gateway.storage.records import OPERATION_MAX_LENGTH
from idempotency_gateway.target import canonical_path
from tests.support import GatewayProcess, RecordingUpstream, write_config
from tests.support.background import InBackgroundThread
from tests.support.charges import CHARGE_BODY, CHARGES
from tests.support.gateway import CLI_SERVER_OPTIONS, gateway_config, route
from tests.support.raw_http import (
    Reply,
    assert_clear_answer,
    chunked_request_bytes,
    exchange,
    request_bytes,
)
from tests.support.servers import TEST_SCOPE_SECRET, serve_asgi
from tests.support.upstream import BEHAVIOR_HEADER, EXECUTION_HEADER, Execution

# Gateway processes fed hostile requests: seconds. test_request_target and
# test_edge_client keep the parser and the edge in the fast loop.
pytestmark = pytest.mark.slow

BODY_LIMIT = 64 * 1024
ADMIN_TOKEN = "hostile-suite-admin-token"
EXAMPLES = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
# Bytes that cannot appear in an HTTP field value (RFC 9110 5.5): CTLs other than HTAB.
NOT_IN_A_FIELD = frozenset([*range(0x09), *range(0x0A, 0x20), 0x7F])
HOP_BY_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "upgrade"}


def hostile_config(upstream_url: str) -> GatewayConfig:
    return gateway_config(
        upstream_url,
        routes=[
            route(CHARGES, key="required", methods=["POST", "PATCH"]),
            route("/", name="default"),
        ],
        limits={"max_request_body": BODY_LIMIT},
        retry={"max_attempts": 1},
        timeouts={"connect": "1s", "per_try": "5s", "total": "5s"},
    )


# ------------------------------------------------------------------ the gateway in a thread


class BackgroundGateway(InBackgroundThread):
    """``create_gateway`` and the recording upstream, served over loopback from a thread with
    its own event loop, so synchronous hypothesis tests can talk to it with raw sockets. The
    HTTP server is the gateway's own edge protocol, as under ``serve``."""

    def __init__(self, *, database_url: str, redis_url: str | None = None) -> None:
        super().__init__(name="hostile-gateway", startup_timeout=30.0)
        self.database_url = database_url
        self.redis_url = redis_url
        self.port = 0
        self.admin_url = ""
        self.upstream: RecordingUpstream | None = None

    async def _serve(self) -> None:
        async with RecordingUpstream() as upstream:
            gateway = create_gateway(
                hostile_config(upstream.url),
                database_url=self.database_url,
                redis_url=self.redis_url,
                admin_token=SecretStr(ADMIN_TOKEN),
                scope_secret=SecretStr(TEST_SCOPE_SECRET),
            )
            async with (
                serve_asgi(gateway, http=EdgeProtocol, **CLI_SERVER_OPTIONS) as url,
                serve_asgi(gateway.admin, lifespan="off") as admin_url,
            ):
                self.upstream = upstream
                self.port = int(url.rsplit(":", 1)[1])
                self.admin_url = admin_url
                self._started()
                await self._stopping()

    def executions_of(self, tenant: bytes) -> list[Execution]:
        assert self.upstream is not None
        wanted = tenant.decode("latin-1")
        return [
            e for e in list(self.upstream.executions) if e.headers.get("authorization") == wanted
        ]

    def send(self, raw: bytes, **options: Any) -> Reply | None:
        return exchange(self.port, raw, **options)


@pytest.fixture(scope="module")
def hostile(postgres_url: str) -> Iterator[BackgroundGateway]:
    with BackgroundGateway(database_url=postgres_url) as gateway:
        yield gateway


# ------------------------------------------------------------------------------ raw HTTP


def new_tenant() -> bytes:
    """A fresh credential: every example has its own scope, so keys never collide."""
    return b"Bearer hostile-" + uuid.uuid4().hex.encode()


def keyed(tenant: bytes, key: bytes, *extra: tuple[bytes, bytes]) -> list[tuple[bytes, bytes]]:
    return [
        (b"Authorization", tenant),
        (b"Idempotency-Key", key),
        (b"Content-Type", b"application/json"),
        *extra,
    ]


# ----------------------------------------------------------------------------- the checks


def assert_still_answers(gateway: BackgroundGateway) -> None:
    tenant = new_tenant()
    reply = gateway.send(
        request_bytes(b"POST", CHARGES.encode(), keyed(tenant, b"ok"), CHARGE_BODY)
    )
    assert reply is not None
    assert reply.status == 201, reply
    assert len(gateway.executions_of(tenant)) == 1


def assert_proxied_once(
    gateway: BackgroundGateway, tenant: bytes, reply: Reply, body: bytes
) -> Execution:
    """The upstream executed exactly this request once and its answer came back."""
    assert reply.status == 201, reply
    (execution,) = gateway.executions_of(tenant)
    assert reply.headers[EXECUTION_HEADER.lower()] == str(execution.number)
    assert execution.body == body
    return execution


# ------------------------------------------------------------------- Idempotency-Key fields

_SF_STRING = re.compile(rb'"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"')


def expected_key(values: Sequence[bytes]) -> bytes | None:
    """The oracle, from the spec: the key the gateway must accept, or None for a 400.
    One field; OWS around it ignored; a bare token or one RFC 8941 sf-string; the key 1 to
    255 characters of 0x21-0x7E."""
    if len(values) != 1:
        return None
    value = values[0].strip(b" \t")
    if value.startswith(b'"'):
        match = _SF_STRING.fullmatch(value)
        if match is None:
            return None
        value = re.sub(rb'\\(["\\])', rb"\1", match.group(1))
    if 1 <= len(value) <= 255 and all(0x21 <= byte <= 0x7E for byte in value):
        return value
    return None


visible = st.binary(min_size=1, max_size=300).map(lambda raw: bytes(0x21 + b % 94 for b in raw))
sf_inner = st.lists(
    st.sampled_from([b"a", b" ", b"~", b'\\"', b"\\\\", b"\\", b'"', b"\\x", b"\t", b"\xe9"]),
    max_size=12,
).map(b"".join)
key_value = st.one_of(
    st.just(b""),
    visible,
    st.integers(250, 300).map(lambda n: b"k" * n),
    st.binary(max_size=40).filter(lambda raw: b"\r" not in raw and b"\n" not in raw),
    st.builds(lambda inner: b'"' + inner + b'"', sf_inner),
    st.builds(
        lambda inner, tail: b'"' + inner + tail,
        sf_inner,
        st.sampled_from([b"", b"x", b";p=1", b' "b"', b", a"]),
    ),
    st.sampled_from(
        [
            b" a ",
            b"\ta\t",
            b"a b",
            b'"',
            b'""',
            b'"\\"',
            b"\xff\xfe",
            b"caf\xc3\xa9",
            b"(),/:;<=>?@[]{}",
        ]
    ),
)


@EXAMPLES
@given(values=st.lists(key_value, min_size=1, max_size=3))
@example(values=[b"a", b"a"])
@example(values=[b'"a\\"b"'])
@example(values=[b"k" * 256])
def test_any_idempotency_key_field_gets_a_clear_answer(
    hostile: BackgroundGateway, values: list[bytes]
) -> None:
    tenant = new_tenant()
    headers = [(b"Authorization", tenant), (b"Content-Type", b"application/json")]
    headers += [(b"Idempotency-Key", value) for value in values]
    reply = hostile.send(request_bytes(b"POST", CHARGES.encode(), headers, CHARGE_BODY))

    if any(byte in NOT_IN_A_FIELD for value in values for byte in value):
        # Not HTTP: the server refuses the bytes before the gateway sees them (or the gateway
        # refuses the key); either way a 400 and nothing executed.
        assert reply is not None
        assert reply.status == 400, reply
        assert hostile.executions_of(tenant) == []
    elif expected_key(values) is None:
        assert_clear_answer(reply)
        assert reply is not None
        assert reply.status == 400, reply
        assert reply.slug() == "idempotency-key-invalid"
        assert hostile.executions_of(tenant) == []
    else:
        answer = assert_clear_answer(reply)
        execution = assert_proxied_once(hostile, tenant, answer, CHARGE_BODY)
        # Forwarded as the bare key, whichever form the client wrote it in.
        key = expected_key(values)
        assert key is not None
        assert execution.header_values("Idempotency-Key") == [key.decode("ascii")]
        again = hostile.send(request_bytes(b"POST", CHARGES.encode(), headers, CHARGE_BODY))
        assert again is not None
        assert again.headers.get("idempotent-replayed") == "true"
        assert (again.status, again.body) == (answer.status, answer.body)
    assert_still_answers(hostile)


@EXAMPLES
@given(
    key=visible.filter(lambda raw: expected_key([raw]) is not None),
    injected=st.from_regex(rb"\A[A-Za-z][A-Za-z0-9-]{0,20}\Z"),
)
def test_crlf_in_the_key_field_only_starts_a_new_header_line(
    hostile: BackgroundGateway, key: bytes, injected: bytes
) -> None:
    """``key\\r\\nX-Injected-…: yes`` is two header lines, never a key with a line break."""
    tenant = new_tenant()
    name = b"X-Injected-" + injected
    value = key + b"\r\n" + name + b": yes"
    reply = hostile.send(
        request_bytes(b"POST", CHARGES.encode(), keyed(tenant, value), CHARGE_BODY)
    )
    execution = assert_proxied_once(hostile, tenant, assert_clear_answer(reply), CHARGE_BODY)
    assert execution.header_values("Idempotency-Key") == [key.decode()]
    assert execution.header_values(name.decode()) == ["yes"]
    assert_still_answers(hostile)


# --------------------------------------------------------------------------------- bodies

json_value = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=10),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=5), children, max_size=4)
    ),
    max_leaves=15,
)
body_value = st.one_of(
    json_value.map(lambda value: json.dumps(value).encode()),
    st.binary(max_size=2000),
    st.integers(1, 5000).map(lambda depth: b"[" * depth + b"]" * depth),
    st.integers(1, 5000).map(lambda depth: b'{"a":' * depth + b"1" + b"}" * depth),
    st.integers(1, 5000).map(lambda digits: b"9" * digits),
    st.sampled_from(
        [
            b"1e400",
            b"-1e400",
            b"[1e-400, -0.0]",
            b"123456789012345678901234567890",
            b'{"a": NaN}',
            b"Infinity",
            b"\xef\xbb\xbf{}",
            b'{"a": "\\ud800"}',
            b'{"a": 1, "a": 2}',
            b'{"amount": 10',
            b"",
        ]
    ),
)


@EXAMPLES
@given(
    body=body_value,
    content_type=st.sampled_from(
        [b"application/json", b"application/problem+json; charset=utf-8", b"text/plain"]
    ),
)
@example(body=b"[" * 5000 + b"]" * 5000, content_type=b"application/json")
@example(body=b"9" * 5000, content_type=b"application/json")
def test_any_body_is_proxied_exactly_and_replayed(
    hostile: BackgroundGateway, body: bytes, content_type: bytes
) -> None:
    tenant = new_tenant()
    headers = [
        (b"Authorization", tenant),
        (b"Idempotency-Key", b"body"),
        (b"Content-Type", content_type),
    ]
    raw = request_bytes(b"POST", CHARGES.encode(), headers, body)
    reply = assert_clear_answer(hostile.send(raw))
    assert_proxied_once(hostile, tenant, reply, body)
    again = assert_clear_answer(hostile.send(raw))
    assert again.headers.get("idempotent-replayed") == "true"
    assert (again.status, again.body) == (reply.status, reply.body)
    assert len(hostile.executions_of(tenant)) == 1


@EXAMPLES
@given(size=st.integers(BODY_LIMIT - 2, BODY_LIMIT + 2), declared_only=st.booleans())
def test_a_body_over_the_limit_is_413_and_never_executed(
    hostile: BackgroundGateway, size: int, declared_only: bool
) -> None:
    assume(size > BODY_LIMIT or not declared_only)  # else the server rightly waits for the body
    tenant = new_tenant()
    if declared_only:
        # Declared over the limit, nothing sent: refused on the declaration alone.
        raw = request_bytes(b"POST", CHARGES.encode(), keyed(tenant, b"big"), content_length=size)
    else:
        raw = request_bytes(b"POST", CHARGES.encode(), keyed(tenant, b"big"), b"7" * size)
    reply = assert_clear_answer(hostile.send(raw))
    if size > BODY_LIMIT:
        assert reply.status == 413, reply
        assert reply.slug() == "request-body-too-large"
        assert hostile.executions_of(tenant) == []
    elif not declared_only:
        assert_proxied_once(hostile, tenant, reply, b"7" * size)
    assert_still_answers(hostile)


@settings(max_examples=30, deadline=None)
@given(declared=st.integers(2, 4096), data=st.data())
def test_an_upload_cut_short_executes_nothing_and_the_key_stays_usable(
    hostile: BackgroundGateway, declared: int, data: st.DataObject
) -> None:
    tenant = new_tenant()
    body = b"x" * declared
    raw = request_bytes(b"POST", CHARGES.encode(), keyed(tenant, b"cut"), body)
    sent = data.draw(st.integers(len(raw) - declared, len(raw) - 1), label="bytes sent")
    reply = hostile.send(raw, cut_after=sent)
    if reply is not None:
        assert reply.status != 500, reply
    assert hostile.executions_of(tenant) == []
    # The client's retry with the whole body runs once: no half-read request reserved the key.
    whole = assert_clear_answer(hostile.send(raw))
    assert_proxied_once(hostile, tenant, whole, body)


def test_a_slow_trickled_upload_is_read_whole(hostile: BackgroundGateway) -> None:
    tenant = new_tenant()
    body = json.dumps({"amount": 1000, "note": "x" * 200}).encode()
    raw = request_bytes(b"POST", CHARGES.encode(), keyed(tenant, b"slow"), body)
    reply = assert_clear_answer(hostile.send(raw, pieces=20, pause=0.05))
    assert_proxied_once(hostile, tenant, reply, body)


def test_a_stalled_upload_executes_nothing_and_the_key_stays_usable(
    hostile: BackgroundGateway,
) -> None:
    tenant = new_tenant()
    raw = request_bytes(b"POST", CHARGES.encode(), keyed(tenant, b"stall"), CHARGE_BODY)
    # Half the body, a pause longer than the trickle above, then the client gives up.
    assert (
        hostile.send(raw, pieces=2, pause=0.5, cut_after=len(raw) - len(CHARGE_BODY) // 2) is None
    )
    assert hostile.executions_of(tenant) == []
    assert_proxied_once(hostile, tenant, assert_clear_answer(hostile.send(raw)), CHARGE_BODY)


# -------------------------------------------------------------------- paths and query strings

segment = st.one_of(
    # No control characters: the recording upstream's router cannot match a decoded newline.
    st.text(st.characters(exclude_categories=("Cc", "Cs")), max_size=12).map(
        lambda text_: quote(text_, safe="")
    ),
    st.sampled_from(
        [
            "..",
            ".",
            "",
            "%2e%2e",
            "%2E",
            "%2f",
            "%2F..%2F",
            "%00",
            "%zz",
            "%",
            "%e2%82",
            ";x=1",
            "~user",
            "a+b",
            "%25",
        ]
    ),
)
query = st.one_of(
    st.just(""),
    st.lists(st.tuples(st.text(max_size=8), st.text(max_size=8)), max_size=4).map(
        lambda pairs: "&".join(f"{quote(k, safe='')}={quote(v, safe='')}" for k, v in pairs)
    ),
    st.sampled_from(["%zz", "a=%E2%82%AC", "a=%ff&a=%fe", "&&=&", "a", "a=1;b=2", "%"]),
)
long_path = st.integers(200, 6000).map(lambda n: CHARGES + "/" + "p" * n)


@EXAMPLES
@given(
    path=st.one_of(
        st.lists(segment, max_size=6).map(lambda parts: CHARGES + "".join("/" + p for p in parts)),
        long_path,
    ),
    query_string=query,
)
# What this test found once (each was a 500 or a 503 before the fix): a UTF-8
# percent-encoded query, a path too long for the record, a NUL in the path (now refused
# for every request, keyed or not).
@example(path=CHARGES, query_string="note=%E2%82%AC&x=%ff")
@example(path=CHARGES + "/" + "p" * 600, query_string="")
@example(path=CHARGES + "/a%00b", query_string="")
def test_any_path_and_query_is_refused_or_forwarded_canonical(
    hostile: BackgroundGateway, path: str, query_string: str
) -> None:
    tenant = new_tenant()
    target = (path + ("?" + query_string if query_string else "")).encode()
    raw = request_bytes(b"POST", target, keyed(tenant, b"path"), CHARGE_BODY)
    reply = assert_clear_answer(hostile.send(raw))
    try:
        canonical = canonical_path(path.encode()).decode()
    except InvalidRequestTarget:
        # Ambiguous forms (docs/paths.md): refused before anything is stored or sent.
        assert (reply.status, reply.slug()) == (400, "request-target-invalid"), reply
        assert hostile.executions_of(tenant) == []
        return
    if len(f"POST {canonical}") > OPERATION_MAX_LENGTH:
        # The record could not hold it: refused before anything is stored or sent.
        assert (reply.status, reply.slug()) == (414, "operation-too-long"), reply
        assert hostile.executions_of(tenant) == []
    else:
        execution = assert_proxied_once(hostile, tenant, reply, CHARGE_BODY)
        assert execution.raw_path == canonical + target.decode()[len(path) :]
        again = assert_clear_answer(hostile.send(raw))
        assert again.headers.get("idempotent-replayed") == "true"
    assert_still_answers(hostile)


# ------------------------------------------------------------------------------- headers

header_name = st.from_regex(rb"\A[A-Za-z][A-Za-z0-9!#$%&'*+.^_`|~-]{0,30}\Z")
header_value = st.binary(max_size=200).map(
    lambda raw: bytes(b if 0x20 <= b < 0x7F or b >= 0x80 else 0x61 for b in raw).strip()
)
special_header = st.one_of(
    st.tuples(
        st.just(b"Connection"),
        st.sampled_from([b"X-Secret-Hop, keep-alive", b"close, TE", b"upgrade"]),
    ),
    st.tuples(
        st.sampled_from([b"TE", b"Trailer", b"Upgrade", b"Keep-Alive", b"Proxy-Connection"]),
        header_value,
    ),
    st.tuples(
        st.just(b"Prefer"),
        st.sampled_from(
            [
                b"wait=99999999999999999999",
                b"wait=-1",
                b"wait=abc",
                b'wait="3"; x',
                b"respond-async, wait=0",
            ]
        ),
    ),
    st.tuples(
        st.just(b"X-Request-Timeout"),
        st.sampled_from([b"nan", b"inf", b"-1", b"1e309", b"abc", b"0.5", b"30", b"1e-9"]),
    ),
    st.tuples(st.just(b"X-Request-Id"), header_value),
    st.tuples(st.just(b"X-Forwarded-For"), header_value),
    st.tuples(st.just(b"Expect"), st.sampled_from([b"100-continue", b"200-ok"])),
    st.tuples(st.just(b"Via"), header_value),
)


def _deadline_too_short(headers: list[tuple[bytes, bytes]]) -> bool:
    """The client's own X-Request-Timeout leaves no time to try (the first one counts)."""
    for name, value in headers:
        if name.lower() == b"x-request-timeout":
            with contextlib.suppress(ValueError):
                return 0 < float(value) < 0.01
            return False
    return False


@EXAMPLES
@given(
    extra=st.lists(st.one_of(st.tuples(header_name, header_value), special_header), max_size=30),
    credential_padding=st.integers(0, 8000),
)
def test_odd_headers_get_a_clear_answer_and_hop_by_hop_ones_stop_here(
    hostile: BackgroundGateway, extra: list[tuple[bytes, bytes]], credential_padding: int
) -> None:
    tenant = new_tenant() + b"x" * credential_padding
    raw = request_bytes(b"POST", CHARGES.encode(), keyed(tenant, b"hdr", *extra), CHARGE_BODY)
    reply = assert_clear_answer(hostile.send(raw))
    expectations = [
        value for name, value in extra if name.lower() == b"expect" and value != b"100-continue"
    ]
    if reply.status == 201:
        (execution,) = hostile.executions_of(tenant)
        named = {
            token.strip().lower().decode("latin-1")
            for name, value in extra
            if name.lower() == b"connection"
            for token in value.split(b",")
        }
        assert not (HOP_BY_HOP | named) & {name.lower() for name, _ in execution.raw_headers}
    elif reply.from_upstream:
        # The upstream's own refusal, relayed: an expectation it does not know.
        assert (reply.status, bool(expectations)) == (417, True), reply
    else:
        # The only refusal the gateway makes here: a deadline the client made too short.
        assert reply.slug() == "deadline-exhausted", reply
        assert _deadline_too_short(extra)
        assert hostile.executions_of(tenant) == []
    assert_still_answers(hostile)


# ------------------------------------------------------------ trailers and transfer codings

transfer_coding = st.one_of(
    st.just(b"chunked"),
    st.sampled_from(
        [
            b"Chunked",
            b"CHUNKED ",
            b"gzip, chunked",
            b"chunked, gzip",
            b"gzip",
            b"identity",
            b"deflate,chunked",
            b"chunked, chunked",
            b"chunked,",
            b",chunked",
            b"chunked;q=1",
            b"x-custom",
        ]
    ),
)
# Trailer names the gateway must never read as fields: its own, framing, the scope, the key.
SENSITIVE_TRAILERS = [
    b"Idempotency-Key",
    b"Authorization",
    b"Content-Length",
    b"Transfer-Encoding",
    b"Host",
    b"X-Forwarded-Host",
    b"Connection",
    b"X-HTTP-Method-Override",
]
trailer_field = st.tuples(
    st.one_of(
        header_name.map(lambda name: b"X-Trailer-" + name), st.sampled_from(SENSITIVE_TRAILERS)
    ),
    header_value,
)


def _lone_chunked(codings: list[bytes]) -> bool:
    return len(codings) == 1 and codings[0].strip(b" \t").lower() == b"chunked"


def _unknown_coding(codings: list[bytes]) -> bool:
    tokens = {token.strip(b" \t").lower() for value in codings for token in value.split(b",")}
    return bool(tokens - {b"chunked", b""})


@EXAMPLES
@given(
    codings=st.lists(transfer_coding, min_size=1, max_size=2),
    chunks=st.lists(st.binary(min_size=1, max_size=60), max_size=4),
    trailers=st.lists(trailer_field, max_size=6),
    pieces=st.integers(1, 3),
)
@example(codings=[b"chunked"], chunks=[b"{}"], trailers=[(b"Idempotency-Key", b"t")], pieces=1)
@example(codings=[b"gzip, chunked"], chunks=[b"\x1f\x8b"], trailers=[], pieces=1)
@example(codings=[b"chunked"], chunks=[b"{}"], trailers=[(b"Transfer-Encoding", b"")], pieces=1)
def test_trailers_and_transfer_codings_never_reach_the_upstream_as_fields(
    hostile: BackgroundGateway,
    codings: list[bytes],
    chunks: list[bytes],
    trailers: list[tuple[bytes, bytes]],
    pieces: int,
) -> None:
    """A lone ``chunked`` body is proxied whole and its trailer fields are dropped (never a
    key, a scope, a length or a field upstream), however the request is split; any other
    coding is refused by its head (501, or 400 for chunked written twice or around an
    empty element) and nothing runs."""
    tenant = new_tenant()
    headers = keyed(tenant, b"trailers")
    raw = chunked_request_bytes(
        b"POST", CHARGES.encode(), headers, chunks, trailers, codings=codings
    )
    reply = assert_clear_answer(hostile.send(raw, pieces=pieces))
    body = b"".join(chunks)
    # llhttp refuses a Content-Length, or an empty Transfer-Encoding, among the trailers of
    # a chunked body: a 400, as safe.
    refused_trailer = any(
        name.lower() == b"content-length"
        or (name.lower() == b"transfer-encoding" and not value.strip(b" \t"))
        for name, value in trailers
    )
    if _lone_chunked(codings) and not refused_trailer:
        execution = assert_proxied_once(hostile, tenant, reply, body)
        assert execution.header_values("Idempotency-Key") == ["trailers"]
        trailer_only = {
            name.decode().lower() for name, _ in trailers if name.startswith(b"X-Trailer-")
        }
        assert not trailer_only & {name.lower() for name, _ in execution.raw_headers}
    else:
        unknown = _unknown_coding(codings)
        expected = (
            (501, "transfer-coding-not-implemented") if unknown else (400, "malformed-request")
        )
        assert (reply.status, reply.slug()) == expected, reply
        assert hostile.executions_of(tenant) == []
    assert_still_answers(hostile)


@pytest.mark.parametrize(
    "framing",
    [
        pytest.param([b"Content-Length: 5", b"Content-Length: 6"], id="two-content-lengths"),
        pytest.param([b"Content-Length: -1"], id="negative-content-length"),
        pytest.param([b"Content-Length: abc"], id="non-numeric-content-length"),
        pytest.param(
            [b"Transfer-Encoding: chunked", b"Content-Length: 4"], id="chunked-and-length"
        ),
        pytest.param([b"Transfer-Encoding: gzip, chunked"], id="unknown-coding"),
        pytest.param([b"Content-Length: 99999999999999999999999"], id="huge-content-length"),
    ],
)
def test_contradictory_framing_never_desyncs_gateway_and_upstream(
    hostile: BackgroundGateway, framing: list[bytes]
) -> None:
    """A second request hidden behind odd framing is either refused with the first, or read
    as the pipelined request it is and handled as one (recorded, keyed, answered): the
    upstream never receives request bytes inside another request's body."""
    tenant = new_tenant()
    hidden = b"POST /v1/charges HTTP/1.1\r\nHost: x\r\nAuthorization: " + tenant + b"\r\n"
    hidden += b"Idempotency-Key: hidden\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    head = [
        b"POST /v1/charges HTTP/1.1",
        b"Host: 127.0.0.1",
        b"Authorization: " + tenant,
        b"Idempotency-Key: front",
    ]
    raw = b"\r\n".join([*head, *framing]) + b"\r\n\r\n0\r\n\r\n" + hidden
    reply = hostile.send(raw)
    assert reply is None or reply.status != 500, reply
    executions = hostile.executions_of(tenant)
    assert sorted(e.idempotency_key or "" for e in executions) in (
        [],
        ["front"],
        ["front", "hidden"],
    )
    assert all(b"HTTP/1.1" not in e.body for e in executions)
    assert_still_answers(hostile)


# ------------------------------------------------------------------------- the admin API


@pytest.fixture(scope="module")
def admin_target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BackgroundGateway]:
    """A gateway of its own on SQLite: schemathesis forces breakers and deletes records, which
    must never reach the shared PostgreSQL database other tests' gateways read."""
    database = tmp_path_factory.mktemp("admin") / "records.db"
    with BackgroundGateway(database_url=f"sqlite:///{database}") as gateway:
        yield gateway


@pytest.fixture(scope="module")
def admin_schema(admin_target: BackgroundGateway) -> Any:
    # Starting a drain (the token is right, so the call succeeds) makes /readyz answer 503
    # for the rest of the module, as it must: that 503 is the drain working, not a failure.
    schema = schemathesis.openapi.from_url(admin_target.admin_url + "/openapi.json")
    return schema.exclude(path="/admin/drain", method="POST")


# The answers' checks. Left out: whether every schema-valid request is accepted, which this
# API cannot promise (exactly one of ``scope`` and ``X-Scope-Credential``: OpenAPI has no way
# to say "one of these two parameters").
RESPONSE_CONFORMANCE = [
    checks.not_a_server_error,
    checks.status_code_conformance,
    checks.content_type_conformance,
    checks.response_headers_conformance,
    checks.response_schema_conformance,
]


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_admin_api_answers_as_its_openapi_document_says(
    admin_schema: Any, data: st.DataObject
) -> None:
    """Schemathesis cases over every admin operation (its pytest plugin's lazy fixtures do
    not work with this pytest, so the cases come from its strategy): no 5xx, and statuses,
    content types, headers and bodies as the OpenAPI document says."""
    case = data.draw(admin_schema.as_strategy(), label="case")
    case.call_and_validate(
        headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, checks=RESPONSE_CONFORMANCE
    )


# ------------------------------------------------------------------ credentials and tenants

SECRET = uuid.uuid4().hex
CREDENTIALS = {
    "Authorization": f"Bearer sk_live_{SECRET}",
    "Proxy-Authorization": f"Basic cHJveHk6{SECRET}",
    "Cookie": f"session={SECRET}",
    "X-Api-Key": f"key_{SECRET}",
}


async def _exercise_with_credentials(gateway: GatewayProcess, upstream: RecordingUpstream) -> None:
    """Every path a request can take: executed, replayed, mismatch, in flight, invalid and
    missing keys, an upstream 500, unkeyed, and an admin lookup by the raw credential."""
    async with httpx.AsyncClient(
        base_url=gateway.url, headers=CREDENTIALS, timeout=10.0, trust_env=False
    ) as client:
        charge = {"amount": 1, "currency": "usd"}
        assert (
            await client.post(CHARGES, json=charge, headers={"Idempotency-Key": "c-1"})
        ).status_code == 201
        replay = await client.post(CHARGES, json=charge, headers={"Idempotency-Key": "c-1"})
        assert replay.headers["idempotent-replayed"] == "true"
        assert (
            await client.post(CHARGES, json={"amount": 2}, headers={"Idempotency-Key": "c-1"})
        ).status_code == 422
        first = asyncio.create_task(
            client.post(
                CHARGES,
                json=charge,
                headers={"Idempotency-Key": "c-2", BEHAVIOR_HEADER: "gate=creds"},
            )
        )
        await upstream.wait_arrived("creds")
        assert (
            await client.post(CHARGES, json=charge, headers={"Idempotency-Key": "c-2"})
        ).status_code == 409
        upstream.release("creds")
        assert (await first).status_code == 201
        assert (
            await client.post(CHARGES, json=charge, headers={"Idempotency-Key": "bad key"})
        ).status_code == 400
        assert (await client.post(CHARGES, json=charge)).status_code == 400
        failed = await client.post(
            CHARGES, json=charge, headers={"Idempotency-Key": "c-3", BEHAVIOR_HEADER: "status=500"}
        )
        assert failed.status_code == 500
        assert (await client.get("/v1/other")).status_code == 201
    async with httpx.AsyncClient(
        base_url=gateway.admin_url, timeout=10.0, trust_env=False
    ) as admin:
        found = await admin.get(
            "/admin/records",
            params={"operation": f"POST {CHARGES}", "key": "c-1"},
            headers={
                "Authorization": f"Bearer {ADMIN_TOKEN}",
                "X-Scope-Credential": CREDENTIALS["Authorization"],
            },
        )
        assert found.status_code == 200, found.text
        metrics = await admin.get("/metrics")
        assert metrics.status_code == 200
        assert "idempotency_gateway_requests_total" in metrics.text
    assert SECRET not in metrics.text


async def _redis_dump(url: str) -> bytes:
    client = redis.asyncio.Redis.from_url(url)
    try:
        dump = b""
        async for name in client.scan_iter(count=1000):
            value = await client.get(name) if await client.type(name) == b"string" else b""
            dump += name + b"\n" + (value or b"") + b"\n"
        return dump
    finally:
        await client.aclose()


async def _records_dump(database_url: str) -> str:
    engine = create_async_engine(database_url)
    try:
        async with engine.connect() as connection:
            rows = (await connection.execute(text("SELECT * FROM idempotency_records"))).all()
    finally:
        await engine.dispose()
    return "\n".join(repr(tuple(row)) for row in rows)


async def test_credentials_reach_no_record_cache_entry_log_line_or_metric(
    tmp_path: Path, postgres_url: str, redis_url: str
) -> None:
    async with RecordingUpstream() as upstream:
        config = hostile_config(upstream.url).model_dump(mode="json")
        gateway = GatewayProcess(
            write_config(tmp_path, config),
            env={
                "GATEWAY_DATABASE_URL": postgres_url,
                "GATEWAY_REDIS_URL": redis_url,
                "GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN,
            },
            extra_args=["--log-format", "json", "--log-level", "info"],
            log_dir=tmp_path,
        )
        async with gateway:
            await _exercise_with_credentials(gateway, upstream)
        log = gateway.log_text()

    assert '"message":"request"' in log, "the access log lines are missing"
    sinks = {
        "records": (await _records_dump(postgres_url)).encode(),
        "redis": await _redis_dump(redis_url),
        "log": log.encode(),
    }
    # The run did leave traces in every sink (so finding nothing means something).
    assert b"c-1" in sinks["records"]
    assert sinks["redis"]
    for sink, content in sinks.items():
        assert SECRET.encode() not in content, f"a credential leaked into the {sink}"


async def test_two_tenants_on_the_same_keys_never_see_each_others_answers(
    postgres_url: str, redis_url: str
) -> None:
    tenants = [f"Bearer tenant-a-{uuid.uuid4().hex}", f"Bearer tenant-b-{uuid.uuid4().hex}"]
    keys = [f"shared-{uuid.uuid4().hex[:8]}-{n}" for n in range(8)]
    async with RecordingUpstream() as upstream:
        gateway = create_gateway(
            hostile_config(upstream.url),
            database_url=postgres_url,
            redis_url=redis_url,
            scope_secret=SecretStr(TEST_SCOPE_SECRET),
        )
        async with serve_asgi(gateway, **CLI_SERVER_OPTIONS) as url:

            async def hammer(tenant: str, key: str) -> httpx.Response:
                async with IdempotentClient(
                    url, max_attempts=50, base=0.01, cap=0.2, deadline=20
                ) as client:
                    return await client.post(
                        CHARGES,
                        key=key,
                        json={"amount": 5},
                        headers={"Authorization": tenant, BEHAVIOR_HEADER: "echo-headers"},
                    )

            answers = await asyncio.gather(
                *(hammer(tenant, key) for _ in range(3) for key in keys for tenant in tenants)
            )
    for response in answers:
        assert response.status_code == 200, response.text
    by_request = [(tenant, key) for _ in range(3) for key in keys for tenant in tenants]
    for (tenant, key), response in zip(by_request, answers, strict=True):
        echoed = response.json()
        assert echoed["authorization"] == tenant
        assert echoed["idempotency-key"] == key
    executed = [(e.headers["authorization"], e.idempotency_key) for e in upstream.executions]
    assert sorted(executed) == sorted((tenant, key) for key in keys for tenant in tenants)
