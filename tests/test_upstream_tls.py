"""TLS toward upstreams: CA bundle, client certificate (mTLS), SNI and hostname verification.

A real TLS upstream on loopback (``RawUpstream`` with a server context), its certificates
made by ``trustme``: a good one, an expired one, one for another host, and one that asks for
the gateway's own certificate. A handshake or verification failure is a 502 that says
nothing was sent: the upstream never saw the request, nothing is stored, the key runs again.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import socket
import ssl
import threading
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import trustme
from cryptography.hazmat.primitives import serialization

from idempotency_gateway.cli import main
from tests.support.gateway import (
    RunningGateway,
    StartGateway,
    gateway_config,
)
from tests.support.problems import problem_slug
from tests.support.raw_upstream import RawUpstream, Received

# TLS handshakes with fresh certificates: seconds. test_upstream_client keeps the
# plain-text client in the fast loop.
pytestmark = pytest.mark.slow

ANSWER = b"HTTP/1.1 201 Created\r\nContent-Length: 7\r\n\r\ncharged"
IN_THE_PAST = datetime.datetime(2020, 1, 1, tzinfo=datetime.UTC)


async def answer(request: Received, reader: asyncio.StreamReader, writer: Any) -> None:
    writer.write(ANSWER)


@pytest.fixture(scope="module")
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def ca_bundle(ca: trustme.CA, tmp_path: Path) -> Path:
    path = tmp_path / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return path


def server_context(
    certificate: trustme.LeafCert, *, client_ca: trustme.CA | None = None
) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    certificate.configure_cert(context)
    if client_ca is not None:
        context.verify_mode = ssl.CERT_REQUIRED
        client_ca.configure_trust(context)
    return context


def recorded_sni(context: ssl.SSLContext) -> list[str | None]:
    """The server names clients send in SNI, as their handshakes begin."""
    names: list[str | None] = []
    context.sni_callback = lambda _socket, name, _context: names.append(name)
    return names


async def post(gateway: RunningGateway, key: str) -> httpx.Response:
    return await gateway.client.post(
        "/v1/charges", content=b'{"amount":1}', headers={"Idempotency-Key": key}
    )


def assert_nothing_sent(
    response: httpx.Response, upstream: RawUpstream | RefusingTlsUpstream, why: str
) -> None:
    assert response.status_code == 502
    assert problem_slug(response.content) == "upstream-unreachable", response.text
    detail = response.json()["detail"]
    assert "nothing was sent" in detail
    assert why in detail
    assert upstream.requests == []


async def test_a_certificate_signed_by_the_bundle_is_trusted(
    ca: trustme.CA, ca_bundle: Path, start_gateway: StartGateway, postgres_url: str
) -> None:
    context = server_context(ca.issue_cert("127.0.0.1"))
    names = recorded_sni(context)
    async with RawUpstream(answer, tls=context) as upstream:
        gateway = await start_gateway(
            postgres_url, upstream_url=upstream.url, keyed=True, tls={"ca_bundle": str(ca_bundle)}
        )
        key = str(uuid.uuid4())
        first, again = await post(gateway, key), await post(gateway, key)

    assert (first.status_code, first.content) == (201, b"charged")
    assert (again.status_code, again.headers["idempotent-replayed"]) == (201, "true")
    assert len(upstream.requests) == 1
    assert names == [None]  # no SNI for an IP address (RFC 6066 section 3)


async def test_without_the_bundle_a_private_ca_is_not_trusted(
    ca: trustme.CA, start_gateway: StartGateway, postgres_url: str
) -> None:
    async with RawUpstream(answer, tls=server_context(ca.issue_cert("127.0.0.1"))) as upstream:
        gateway = await start_gateway(postgres_url, upstream_url=upstream.url, keyed=True)
        response = await post(gateway, str(uuid.uuid4()))

    assert_nothing_sent(response, upstream, "unable to get local issuer certificate")


async def test_an_expired_certificate_is_refused_and_the_key_runs_again_once_fixed(
    ca: trustme.CA, ca_bundle: Path, start_gateway: StartGateway, postgres_url: str
) -> None:
    context = server_context(ca.issue_cert("127.0.0.1", not_after=IN_THE_PAST))
    async with RawUpstream(answer, tls=context) as upstream:
        gateway = await start_gateway(
            postgres_url, upstream_url=upstream.url, keyed=True, tls={"ca_bundle": str(ca_bundle)}
        )
        key = str(uuid.uuid4())
        refused = await post(gateway, key)
        assert_nothing_sent(refused, upstream, "certificate has expired")
        # The upstream renews its certificate: the same key executes, once.
        ca.issue_cert("127.0.0.1").configure_cert(context)
        executed = await post(gateway, key)

    assert (executed.status_code, executed.content) == (201, b"charged")
    assert "idempotent-replayed" not in executed.headers
    assert len(upstream.requests) == 1


async def test_a_certificate_for_another_host_is_refused(
    ca: trustme.CA, ca_bundle: Path, start_gateway: StartGateway, postgres_url: str
) -> None:
    context = server_context(ca.issue_cert("payments.internal"))
    async with RawUpstream(answer, tls=context) as upstream:
        gateway = await start_gateway(
            postgres_url, upstream_url=upstream.url, keyed=True, tls={"ca_bundle": str(ca_bundle)}
        )
        response = await post(gateway, str(uuid.uuid4()))

    assert_nothing_sent(response, upstream, "mismatch, certificate is not valid for '127.0.0.1'")


async def test_server_name_is_sent_in_sni_and_verified_instead_of_the_url_host(
    ca: trustme.CA, ca_bundle: Path, start_gateway: StartGateway, postgres_url: str
) -> None:
    context = server_context(ca.issue_cert("payments.internal"))
    names = recorded_sni(context)
    async with RawUpstream(answer, tls=context) as upstream:
        gateway = await start_gateway(
            postgres_url,
            upstream_url=upstream.url,
            keyed=True,
            tls={"ca_bundle": str(ca_bundle), "server_name": "payments.internal"},
        )
        response = await post(gateway, str(uuid.uuid4()))

    assert (response.status_code, response.content) == (201, b"charged")
    assert names == ["payments.internal"]


async def test_verify_hostname_off_still_verifies_the_chain(
    ca: trustme.CA, ca_bundle: Path, start_gateway: StartGateway, postgres_url: str
) -> None:
    async with RawUpstream(answer, tls=server_context(ca.issue_cert("elsewhere"))) as upstream:
        gateway = await start_gateway(
            postgres_url,
            upstream_url=upstream.url,
            keyed=True,
            tls={"ca_bundle": str(ca_bundle), "verify_hostname": False},
        )
        accepted = await post(gateway, str(uuid.uuid4()))
    assert accepted.status_code == 201

    stranger = trustme.CA().issue_cert("127.0.0.1")
    async with RawUpstream(answer, tls=server_context(stranger)) as upstream:
        gateway = await start_gateway(
            postgres_url,
            upstream_url=upstream.url,
            keyed=True,
            tls={"ca_bundle": str(ca_bundle), "verify_hostname": False},
        )
        refused = await post(gateway, str(uuid.uuid4()))
    assert_nothing_sent(refused, upstream, "unable to get local issuer certificate")


@pytest.fixture(scope="module")
def client_ca() -> trustme.CA:
    return trustme.CA()


async def test_mtls_with_the_client_certificate_is_served(
    ca: trustme.CA,
    ca_bundle: Path,
    client_ca: trustme.CA,
    start_gateway: StartGateway,
    postgres_url: str,
    tmp_path: Path,
) -> None:
    identity = client_ca.issue_cert("gateway@payments")
    cert, key_file = tmp_path / "client.pem", tmp_path / "client.key"
    identity.cert_chain_pems[0].write_to_path(str(cert))
    identity.private_key_pem.write_to_path(str(key_file))
    context = server_context(ca.issue_cert("127.0.0.1"), client_ca=client_ca)
    async with RawUpstream(answer, tls=context) as upstream:
        gateway = await start_gateway(
            postgres_url,
            upstream_url=upstream.url,
            keyed=True,
            tls={
                "ca_bundle": str(ca_bundle),
                "client_cert": str(cert),
                "client_key": str(key_file),
            },
        )
        response = await post(gateway, str(uuid.uuid4()))

    assert (response.status_code, response.content) == (201, b"charged")
    assert len(upstream.requests) == 1


class RefusingTlsUpstream:
    """A TLS server on a plain thread that requires a client certificate and, when the
    handshake fails, sends its alert and reads on until the client closes, as servers
    (nginx, Envoy, Go) do. asyncio's own TLS server drops the connection without the alert,
    which would leave a client nothing to tell a refusal from a lost answer by."""

    def __init__(self, context: ssl.SSLContext) -> None:
        self._context = context
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"https://127.0.0.1:{self._listener.getsockname()[1]}"
        self.refusals: list[str] = []
        self.requests: list[bytes] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def __enter__(self) -> RefusingTlsUpstream:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._listener.close()
        self._thread.join(10)

    def _serve(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                connection, _ = self._listener.accept()
                with connection:
                    self._handle(connection)

    def _handle(self, connection: socket.socket) -> None:
        # Memory BIOs over the plain socket: the alert is sent and the socket kept open after
        # a failed handshake (an SSLSocket closes itself, and the unread request makes that a
        # reset, which may overtake the alert).
        incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        tls = self._context.wrap_bio(incoming, outgoing, server_side=True)
        while True:
            try:
                tls.do_handshake()
            except ssl.SSLWantReadError:
                connection.sendall(outgoing.read())
                if not (data := connection.recv(65536)):
                    return
                incoming.write(data)
                continue
            except ssl.SSLError as refusal:
                connection.sendall(outgoing.read())  # the alert
                self.refusals.append(str(refusal.reason))
                while connection.recv(65536):  # whatever the client sent after its Finished
                    pass
                return
            self.requests.append(b"(the handshake was accepted)")
            return


@pytest.mark.parametrize("identity", ["none", "another CA's"])
async def test_mtls_without_an_accepted_certificate_sends_nothing(
    ca: trustme.CA,
    ca_bundle: Path,
    client_ca: trustme.CA,
    start_gateway: StartGateway,
    postgres_url: str,
    tmp_path: Path,
    identity: str,
) -> None:
    tls: dict[str, Any] = {"ca_bundle": str(ca_bundle)}
    if identity != "none":
        combined = tmp_path / "client.pem"  # key and certificate in one file
        trustme.CA().issue_cert("gateway").private_key_and_cert_chain_pem.write_to_path(
            str(combined)
        )
        tls["client_cert"] = str(combined)
    context = server_context(ca.issue_cert("127.0.0.1"), client_ca=client_ca)
    with RefusingTlsUpstream(context) as upstream:
        gateway = await start_gateway(postgres_url, upstream_url=upstream.url, keyed=True, tls=tls)
        key = str(uuid.uuid4())
        first = await post(gateway, key)
        again = await post(gateway, key)

    # TLS 1.3: the refusal came after the gateway's side of the handshake, with the request
    # already written; the alert still says the upstream's application never saw it.
    assert_nothing_sent(first, upstream, "refused the TLS handshake")
    # Not stored as executed: the retry tries the upstream again (and is refused again).
    assert_nothing_sent(again, upstream, "refused the TLS handshake")
    assert len(upstream.refusals) == 2


@pytest.mark.parametrize(
    ("tls", "error"),
    [
        ({"ca_bundle": "{missing}"}, "does not point to a file"),
        ({"ca_bundle": "{junk}"}, "cannot load the TLS files"),
        ({"client_key": "{junk}"}, "client_key needs client_cert"),
        ({"client_cert": "{junk}"}, "cannot load the TLS files"),
        ({"client_cert": "{encrypted}"}, "client_key is encrypted"),
    ],
)
def test_check_config_refuses_tls_files_it_cannot_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tls: dict[str, str], error: str
) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    encrypted = tmp_path / "encrypted.pem"
    identity = trustme.CA().issue_cert("gateway")
    key = serialization.load_pem_private_key(identity.private_key_pem.bytes(), password=None)
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"secret"),
        )
        + identity.cert_chain_pems[0].bytes()
    )
    paths = {
        "missing": str(tmp_path / "missing.pem"),
        "junk": str(junk),
        "encrypted": str(encrypted),
    }
    config = tmp_path / "gateway.yaml"
    config.write_text(
        "upstreams:\n"
        "  primary:\n"
        "    url: https://payments.internal\n"
        "    tls: {"
        + ", ".join(f"{name}: {value.format(**paths)!r}" for name, value in tls.items())
        + "}\n"
        "routes: [{name: all, match: {path_prefix: /}, upstream: primary}]\n"
    )

    assert main(["check-config", str(config)]) == 2
    assert error in capsys.readouterr().err


def test_tls_settings_need_an_https_url(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="tls settings need an https url"):
        gateway_config(
            "http://127.0.0.1:1",
            upstreams={"primary": {"url": "http://127.0.0.1:1", "tls": {"server_name": "x"}}},
        )
