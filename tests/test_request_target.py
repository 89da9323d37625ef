"""The request target cannot reach another host, dodge a route's policy, or merge two requests.

A real gateway process (``idempotency-gateway serve``, PostgreSQL records) sits in front of a
recording upstream; a second recording server stands in for any other local port (the admin
port, a database) and must never hear a thing. Requests are written with raw sockets, since
ordinary clients normalize these attacks away before they leave. The config has a
``key: required`` route ``/v1/charges``, a ``key: off`` route ``/v1/public`` and a default
route ``/``: a path trick that reached ``/v1/charges`` through either of the others without
a key would execute a charge the policy meant to protect.

Hypothesis composes request lines (dot segments, percent-encodings, ``//``, ``@``, ``*``,
absolute-form naming other hosts, backslashes, NUL, non-ASCII bytes) and header sets; after
every example: nothing reached the sentinel, no keyed-route execution came without its key,
every path the upstream saw is canonical, and every answer is the upstream's or a documented
problem (or the HTTP parser's own 400 for bytes that are no request line at all).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import FastAPI, Request
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from idempotency_gateway.config import IdempotencyConfig
from idempotency_gateway.errors import InvalidRequestTarget
from idempotency_gateway.idempotency import IdempotencyMiddleware
from idempotency_gateway.routing import PrefixRouter
from idempotency_gateway.storage.base import RecordStore
from idempotency_gateway.target import canonical_path, rewritten_path
from tests.support import GatewayProcess, RecordingUpstream, serve_asgi, write_config
from tests.support.background import InBackgroundThread
from tests.support.charges import CHARGE_BODY, CHARGES
from tests.support.gateway import GatewayLauncher, gateway_config, route
from tests.support.problems import PROBLEM_JSON
from tests.support.raw_http import Reply, assert_clear_answer, exchange, request_bytes
from tests.support.servers import TEST_SCOPE_SECRET
from tests.support.upstream import Execution

PUBLIC = "/v1/public"
# What this suite's requests may be answered with, when the gateway answers itself.
EXPECTED_PROBLEMS = {
    "request-target-invalid": 400,
    "idempotency-key-missing": 400,
    "idempotency-key-invalid": 400,
    "operation-too-long": 414,
    # The HTTP server layer's own refusals, before any app code runs.
    "malformed-request": 400,
    "tunnel-refused": 400,
}


# ------------------------------------------------------------------ canonical form (pure)


@pytest.mark.parametrize(
    ("raw", "canonical"),
    [
        (b"/v1/charges", b"/v1/charges"),
        (b"/", b"/"),
        (b"/v1/public/../charges", b"/v1/charges"),
        (b"/v1/public/%2e%2e/charges", b"/v1/charges"),
        (b"/v1/public/%2E%2e/charges", b"/v1/charges"),
        (b"/v1/./charges/.", b"/v1/charges/"),
        (b"/v1/charges/a/..", b"/v1/charges/"),
        (b"/../../v1/charges", b"/v1/charges"),
        (b"//v1//charges", b"/v1/charges"),
        (b"/v1/charges/", b"/v1/charges/"),
        (b"/v1/%63harges", b"/v1/charges"),
        (b"/v1/charges/%7e%41", b"/v1/charges/~A"),
        (b"/v1/charges/%ff/%c3%a9", b"/v1/charges/%FF/%C3%A9"),
        (b"/v1/charges/%3a%40%25", b"/v1/charges/%3A%40%25"),
        (b"/v1/a@b:c;d=e/", b"/v1/a@b:c;d=e/"),
        (b"/v1/.well-known/..x", b"/v1/.well-known/..x"),
    ],
)
def test_paths_are_normalized_per_rfc_3986(raw: bytes, canonical: bytes) -> None:
    assert canonical_path(raw) == canonical
    assert canonical_path(canonical) == canonical  # canonical is a fixed point


@pytest.mark.parametrize(
    "raw",
    [
        b"*",
        b"*@127.0.0.1:8081/metrics",
        b"127.0.0.1:8081",
        b"@127.0.0.1:8081/metrics",
        b"v1/charges",
        b"",
        b"/v1/public/..%2fcharges",
        b"/v1/public%2F..%2Fcharges",
        b"/v1/public/..%5ccharges",
        b"/v1/public\\..\\charges",
        b"/v1/public/..;/charges",
        b"/v1/public/.;x/charges",
        b"/v1/charges/%00",
        b"/v1/charges/%zz",
        b"/v1/charges/%",
        b"/v1/charges/\xc3\xa9",
        b"/v1/charges/a b",
        b"/v1/charges/\x00",
    ],
)
def test_ambiguous_or_non_origin_form_targets_are_refused(raw: bytes) -> None:
    with pytest.raises(InvalidRequestTarget):
        canonical_path(raw)


_PATH_PIECES = st.sampled_from(
    [b"/", b"//", b".", b"..", b";", b"..;", b"%2e", b"%41", b"%2f", b"a", b"v1", b"~", b"@", b" "]
)


@given(st.lists(_PATH_PIECES, max_size=8).map(b"".join))
@example(b"/..;x/a")
@example(b"/a/.;")
@example(b"/a/")
def test_the_shortcut_for_canonical_paths_agrees_with_the_full_rewrite(raw: bytes) -> None:
    """Paths already canonical skip the rewrite: for every input both give the same answer,
    the same path or the same refusal."""
    try:
        expected = rewritten_path(raw)
    except InvalidRequestTarget:
        with pytest.raises(InvalidRequestTarget):
            canonical_path(raw)
        return
    assert canonical_path(raw) == expected


# ------------------------------------------------------------------- the live gateway


class TargetStack(InBackgroundThread):
    """Recording upstream, sentinel and a gateway process, run by a thread's own event loop."""

    def __init__(self, *, database_url: str, workdir: Path) -> None:
        super().__init__(name="target-stack")
        self.database_url = database_url
        self.workdir = workdir
        self.upstream = RecordingUpstream()
        self.sentinel = RecordingUpstream()
        self.port = 0
        self.admin_port = 0

    async def _serve(self) -> None:
        async with self.upstream, self.sentinel:
            config = gateway_config(
                self.upstream.url,
                routes=[
                    route(CHARGES, key="required"),
                    route(PUBLIC, key="off"),
                    route("/", name="default"),
                ],
                retry={"max_attempts": 1},
            )
            gateway = GatewayProcess(
                write_config(self.workdir, config.model_dump(mode="json")),
                env={"GATEWAY_DATABASE_URL": self.database_url},
                log_dir=self.workdir,
            )
            async with gateway:
                self.port, self.admin_port = gateway.port, gateway.admin_port
                self._started()
                await self._stopping()

    def send(self, raw: bytes) -> Reply | None:
        return exchange(self.port, raw)

    def executions_since(self, count: int) -> list[Execution]:
        return list(self.upstream.executions)[count:]


@pytest.fixture(scope="module")
def stack(postgres_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[TargetStack]:
    with TargetStack(
        database_url=postgres_url, workdir=tmp_path_factory.mktemp("target")
    ) as running:
        yield running


def raw_request(
    method: bytes, target: bytes, headers: list[tuple[bytes, bytes]], body: bytes = CHARGE_BODY
) -> bytes:
    return request_bytes(method, target, [(b"Content-Type", b"application/json"), *headers], body)


def tenant_and_key() -> list[tuple[bytes, bytes]]:
    unique = uuid.uuid4().hex.encode()
    return [(b"Authorization", b"Bearer target-" + unique), (b"Idempotency-Key", unique)]


def parser_refused(reply: Reply) -> bool:
    """The HTTP server layer's own refusal: the target was no URL at all (400) or asked for a
    tunnel (also 400), and no app code ran."""
    if not reply.headers.get("content-type", "").startswith(PROBLEM_JSON):
        return False
    return (reply.status, reply.slug()) in {
        (400, "malformed-request"),
        (400, "tunnel-refused"),
    }


def answered(stack: TargetStack, raw: bytes) -> tuple[Reply, list[Execution]]:
    before = stack.upstream.total
    reply = stack.send(raw)
    assert reply is not None, "the gateway closed the connection without an answer"
    if not parser_refused(reply):
        assert_clear_answer(reply)
    return reply, stack.executions_since(before)


def is_charges(path: str) -> bool:
    return path == CHARGES or path.startswith(CHARGES + "/")


# ------------------------------------------------------------ what was found, one by one


def test_a_target_glued_to_userinfo_never_reaches_another_port(stack: TargetStack) -> None:
    for port in (stack.admin_port, stack.sentinel.port, 1):
        target = b"*@127.0.0.1:%d/metrics" % port
        reply, executions = answered(stack, raw_request(b"GET", target, []))

        assert (reply.status, reply.slug()) == (400, "request-target-invalid"), reply
        assert b"# HELP" not in reply.body
        assert executions == []
    assert stack.sentinel.total == 0


@pytest.mark.parametrize(
    ("method", "target"),
    [(b"OPTIONS", b"*"), (b"GET", b"*"), (b"POST", b"*/v1/charges"), (b"GET", b"*@x/metrics")],
)
def test_asterisk_form_targets_are_a_400_problem(
    stack: TargetStack, method: bytes, target: bytes
) -> None:
    reply, executions = answered(stack, raw_request(method, target, tenant_and_key()))

    assert (reply.status, reply.slug()) == (400, "request-target-invalid"), reply
    assert executions == []


@pytest.mark.parametrize(
    ("method", "target"),
    [
        (b"CONNECT", b"127.0.0.1:{port}"),
        (b"GET", b"127.0.0.1:{port}"),
        (b"POST", b"v1/charges"),
        (b"GET", b"@127.0.0.1:{port}/metrics"),
        (b"GET", b"\\v1/charges"),
    ],
)
def test_authority_form_and_relative_targets_are_refused_and_forward_nothing(
    stack: TargetStack, method: bytes, target: bytes
) -> None:
    port = str(stack.sentinel.port).encode()
    reply, executions = answered(stack, raw_request(method, target.replace(b"{port}", port), []))

    # httptools refuses these as URLs before any app code runs: the server's own 400.
    assert parser_refused(reply), reply
    assert executions == []
    assert stack.sentinel.total == 0


def test_absolute_form_is_served_by_its_path_on_the_configured_upstream(
    stack: TargetStack,
) -> None:
    target = b"http://127.0.0.1:%d/v1/public/../things?x=1" % stack.sentinel.port
    reply, executions = answered(stack, raw_request(b"GET", target, []))

    assert reply.status == 201, reply
    assert [(e.method, e.raw_path) for e in executions] == [("GET", "/v1/things?x=1")]
    assert stack.sentinel.total == 0


def test_an_at_sign_in_the_path_is_only_a_path(stack: TargetStack) -> None:
    target = b"/@127.0.0.1:%d/metrics" % stack.sentinel.port
    reply, executions = answered(stack, raw_request(b"GET", target, []))

    assert reply.status == 201, reply
    assert [e.raw_path for e in executions] == [target.decode()]
    assert stack.sentinel.total == 0


@pytest.mark.parametrize(
    "target",
    [
        b"/v1/public/../charges",
        b"/v1/public/%2e%2e/charges",
        b"/v1/public/%2E%2E/charges",
        b"/v1/public/./../charges",
        b"//v1/charges",
        b"/v1//charges",
        b"/./v1/charges",
        b"/v1/%63harges",
        b"http://127.0.0.1/v1/public/../charges",
    ],
)
def test_path_tricks_land_on_the_route_they_name_and_its_policy(
    stack: TargetStack, target: bytes
) -> None:
    unkeyed, executions = answered(stack, raw_request(b"POST", target, []))

    assert (unkeyed.status, unkeyed.slug()) == (400, "idempotency-key-missing"), unkeyed
    assert executions == []

    keyed, executions = answered(stack, raw_request(b"POST", target, tenant_and_key()))
    assert keyed.status == 201, keyed
    assert [e.raw_path for e in executions] == [CHARGES]  # the canonical path went upstream


@pytest.mark.parametrize(
    "target",
    [
        b"/v1/public/..%2fcharges",
        b"/v1/public%2F..%2Fcharges",
        b"/v1/public/..%5Ccharges",
        b"/v1/public\\..\\charges",
        b"/v1/public/..;/charges",
        b"/v1/public/%00",
    ],
)
def test_forms_upstreams_read_differently_are_refused(stack: TargetStack, target: bytes) -> None:
    reply, executions = answered(stack, raw_request(b"POST", target, []))

    assert (reply.status, reply.slug()) == (400, "request-target-invalid"), reply
    assert executions == []


def test_paths_differing_only_in_non_utf8_octets_are_two_requests(stack: TargetStack) -> None:
    headers = tenant_and_key()
    first, _ = answered(stack, raw_request(b"POST", CHARGES.encode() + b"/%ff", headers))
    second, executions = answered(stack, raw_request(b"POST", CHARGES.encode() + b"/%fe", headers))

    assert first.status == second.status == 201
    assert "idempotent-replayed" not in second.headers
    assert [e.raw_path for e in executions] == [CHARGES + "/%FE"]


@pytest.mark.parametrize(
    ("body", "other"),
    [
        (b'{"amount": 20}', b'{"amount": 19.999999999999999}'),
        (b'{"amount": 18446744073709551616}', b'{"amount": 18446744073709551617}'),
        (b'{"amount": 1e400}', b'{"amount": 1.0000000000000001e400}'),
        (b'{"amount": 2}', b'{"amount": 1, "amount": 2}'),
    ],
)
def test_bodies_with_different_exact_values_are_never_replayed_for_each_other(
    stack: TargetStack, body: bytes, other: bytes
) -> None:
    headers = tenant_and_key()
    first, _ = answered(stack, raw_request(b"POST", CHARGES.encode(), headers, body))
    second, executions = answered(stack, raw_request(b"POST", CHARGES.encode(), headers, other))

    assert first.status == 201, first
    assert (second.status, second.slug()) == (422, "idempotency-key-reused"), second
    assert executions == []


def test_the_same_value_written_differently_replays(stack: TargetStack) -> None:
    headers = tenant_and_key()
    body, same = b'{"amount": 20, "tags": ["a"]}', b'{"tags":["a"],"amount":2.0e1}'
    first, _ = answered(stack, raw_request(b"POST", CHARGES.encode(), headers, body))
    again, executions = answered(stack, raw_request(b"POST", CHARGES.encode(), headers, same))

    assert first.status == again.status == 201
    assert again.headers.get("idempotent-replayed") == "true"
    assert executions == []


# ------------------------------------------------------------------ the property-based run

SEGMENTS = [
    "v1",
    "charges",
    "public",
    "ch_1",
    "",
    ".",
    "..",
    "%2e",
    "%2e%2e",
    "%2E%2E",
    ".%2e",
    "%2f",
    "%2F..%2F",
    "%5c",
    "\\",
    "..\\",
    "..;",
    "..;x",
    ".;",
    "%ff",
    "%fe",
    "%00",
    "\x00",
    "a@b",
    "%40",
    "%7E",
    "%zz",
    "%",
    "\xe9",
    "%63harges",
    "charges%2f..",
    "*",
]


# Other hosts are written as placeholders: their ports are known once the stack runs.
OTHER_HOSTS = ["127.0.0.1:{sentinel}", "127.0.0.1:{admin}", "", "evil"]


def _target(prefix: str, host: str, segments: str, suffix: str) -> str:
    glue = "/" if prefix.endswith("//") or prefix in ("*@", "@") else ""
    return prefix + host + glue + segments + suffix


_path = st.lists(st.sampled_from(SEGMENTS), max_size=6).map("/".join)
_tail = st.sampled_from(["", "?a=1", "?x=%2F..%2F&a", "#frag", "?@127.0.0.1:1"])
hostile_target = st.one_of(
    st.builds(
        _target,
        st.sampled_from(["", "/", "//", "\\", "*", "@", "*@", "http://", "https://"]),
        st.sampled_from(OTHER_HOSTS),
        _path,
        _tail,
    ),
    st.builds(lambda path, tail: "/" + path + tail, _path, _tail),
)
extra_headers = st.lists(
    st.sampled_from(
        [
            ("Host", "127.0.0.1:{sentinel}"),
            ("X-Forwarded-Host", "127.0.0.1:{sentinel}"),
            ("X-Forwarded-Proto", "https"),
            ("Forwarded", "host=127.0.0.1:{admin}"),
            ("Idempotency-Key", "{unique}"),  # a second field when keyed
        ]
    ),
    max_size=3,
    unique=True,
)


def assert_invariants(stack: TargetStack, reply: Reply | None, executions: list[Execution]) -> None:
    assert stack.sentinel.total == 0, "a request reached a host other than the upstream"
    for execution in executions:
        path = execution.raw_path.split("?", 1)[0]
        assert canonical_path(path.encode("latin-1")).decode() == path, execution.raw_path
        if is_charges(path) and execution.method in ("POST", "PATCH"):
            assert execution.idempotency_key is not None, f"unkeyed {execution.raw_path}"
    assert reply is not None, "the gateway closed the connection without an answer"
    assert b"# HELP" not in reply.body
    if reply.from_upstream:
        event("proxied")
        assert reply.status == 201, reply
    elif parser_refused(reply):
        event("refused by the HTTP parser")
        assert executions == []
    else:
        event(f"problem {reply.status}")
        assert_clear_answer(reply)
        assert EXPECTED_PROBLEMS.get(reply.slug()) == reply.status, reply


@settings(
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    method=st.sampled_from([b"POST", b"POST", b"PATCH", b"GET", b"OPTIONS"]),
    target=hostile_target,
    headers=extra_headers,
    keyed=st.booleans(),
)
# Found on main: the admin port's metrics through the proxy port.
@example(method=b"GET", target="*@127.0.0.1:{admin}/metrics", headers=[], keyed=False)
def test_no_target_reaches_another_host_or_dodges_a_policy(
    stack: TargetStack, method: bytes, target: str, headers: list[tuple[str, str]], keyed: bool
) -> None:
    # Placeholders filled per example: a key from an earlier example would (rightly) be a 422.
    ports = {"sentinel": stack.sentinel.port, "admin": stack.admin_port, "unique": uuid.uuid4()}
    fields = [(name.encode(), value.format(**ports).encode()) for name, value in headers]
    before = stack.upstream.total
    raw = raw_request(
        method,
        target.format(**ports).encode("latin-1"),
        [*tenant_and_key(), *fields] if keyed else fields,
    )
    reply = stack.send(raw)
    assert_invariants(stack, reply, stack.executions_since(before))


# ------------------------------------------------ matched once; the same rules in library mode


async def test_the_route_is_matched_once_per_request(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    matched: list[str] = []
    real_match = PrefixRouter.match

    def counting_match(router: PrefixRouter[Any], path: str) -> Any:
        matched.append(path)
        return real_match(router, path)

    monkeypatch.setattr(PrefixRouter, "match", counting_match)
    async with RecordingUpstream() as upstream, GatewayLauncher() as gateways:
        config = gateway_config(upstream.url, routes=[route(CHARGES, key="required")])
        gateway = await gateways.start(config, database_url=postgres_url)
        headers = {"Idempotency-Key": uuid.uuid4().hex, "Authorization": uuid.uuid4().hex}
        response = await gateway.client.post(
            CHARGES + "/./x/..", content=CHARGE_BODY, headers=headers
        )

    assert response.status_code == 201
    assert matched == [CHARGES]
    assert [e.raw_path for e in upstream.executions] == [CHARGES]


async def test_library_mode_canonicalizes_before_choosing_the_policy(
    store: RecordStore, unique: Callable[[str], str]
) -> None:
    api = FastAPI()
    api.add_middleware(
        IdempotencyMiddleware,
        store=store,
        policy={CHARGES: IdempotencyConfig(key="required")},
        scope_secret=TEST_SCOPE_SECRET,
    )
    seen: list[str] = []

    @api.post("/{path:path}")
    async def anything(request: Request) -> dict[str, str]:
        seen.append(request.scope["raw_path"].decode())
        return {"path": request.url.path}

    async with serve_asgi(api) as url:
        port = int(url.rsplit(":", 1)[1])

        async def send(target: bytes, headers: list[tuple[bytes, bytes]]) -> Reply | None:
            return await asyncio.to_thread(exchange, port, raw_request(b"POST", target, headers))

        unkeyed = await send(b"/v1/public/%2e%2e/charges", [])
        refused = await send(b"/v1/public/..%2Fcharges", [])
        keyed = await send(b"//v1/public/../charges", [(b"Idempotency-Key", unique("k").encode())])

    assert unkeyed is not None
    assert (unkeyed.status, unkeyed.slug()) == (400, "idempotency-key-missing")
    assert refused is not None
    assert (refused.status, refused.slug()) == (400, "request-target-invalid")
    assert keyed is not None
    assert keyed.status == 200
    assert seen == [CHARGES]  # the app saw the canonical path the policy was chosen by
