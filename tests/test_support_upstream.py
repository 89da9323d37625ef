"""Tests of the test support itself: the recording upstream, serve_asgi, GatewayProcess."""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest

from tests.support import (
    GatewayProcess,
    RecordingUpstream,
    eventually,
    free_port,
    serve_asgi,
    write_config,
)

Scope = dict[str, Any]
Message = dict[str, Any]


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0) as http:
        yield http


# ------------------------------------------------------------------ RecordingUpstream


async def test_default_answer_records_and_counts_per_key(
    upstream: RecordingUpstream, client: httpx.AsyncClient
) -> None:
    assert upstream.url.startswith("http://127.0.0.1:")
    first = await client.post(
        f"{upstream.url}/payments?a=1&b=2",
        content=b'{"amount": 10}',
        headers=[
            ("Idempotency-Key", "key-a"),
            ("Idempotency-Fencing-Token", "3"),
            ("X-Multi", "one"),
            ("X-Multi", "two"),
        ],
    )
    second = await client.post(
        f"{upstream.url}/payments", content=b"x", headers={"Idempotency-Key": "key-a"}
    )
    third = await client.put(f"{upstream.url}/other", headers={"Idempotency-Key": "key-b"})
    fourth = await client.get(f"{upstream.url}/nokey")

    assert [r.status_code for r in (first, second, third, fourth)] == [201, 201, 201, 201]
    assert first.json() == {
        "execution": 1,
        "key": "key-a",
        "fencing_token": 3,
        "path": "/payments",
        "body_sha256": hashlib.sha256(b'{"amount": 10}').hexdigest(),
    }
    assert first.headers["x-upstream-execution"] == "1"
    assert second.json()["execution"] == 2
    assert second.json()["fencing_token"] is None
    assert third.headers["x-upstream-execution"] == "3"
    assert fourth.json()["key"] is None

    assert upstream.count("key-a") == 2
    assert upstream.count("key-b") == 1
    assert upstream.count("missing") == 0
    assert upstream.total == 4

    recorded = upstream.executions[0]
    assert recorded.method == "POST"
    assert recorded.path == "/payments"
    assert recorded.query_string == "a=1&b=2"
    assert recorded.body == b'{"amount": 10}'
    assert recorded.idempotency_key == "key-a"
    assert recorded.fencing_token == 3
    assert recorded.number == 1
    assert recorded.headers["x-multi"] == "two"
    assert recorded.header_values("x-multi") == ["one", "two"]
    assert ("Idempotency-Key", "key-a") in recorded.raw_headers
    assert [e.method for e in upstream.executions] == ["POST", "POST", "PUT", "GET"]
    assert [e.idempotency_key for e in upstream.executions_for("key-a")] == ["key-a"] * 2


async def test_status_and_retry_after(
    upstream: RecordingUpstream, client: httpx.AsyncClient
) -> None:
    response = await client.post(
        f"{upstream.url}/x",
        headers={"Idempotency-Key": "k", "X-Test-Behavior": "status=503, retry-after=2"},
    )
    assert response.status_code == 503
    assert response.headers["retry-after"] == "2"
    assert response.json()["execution"] == 1
    assert response.json()["key"] == "k"
    assert upstream.count("k") == 1
    assert upstream.executions[0].behavior == {"status": "503", "retry-after": "2"}


async def test_status_first_fails_the_first_times_executions_of_the_same_request(
    upstream: RecordingUpstream, client: httpx.AsyncClient
) -> None:
    async def send(headers: dict[str, str]) -> int:
        response = await client.post(f"{upstream.url}/x", headers=headers)
        return response.status_code

    twice_by_key = {"Idempotency-Key": "k1", "X-Test-Behavior": "status-first=503,times=2"}
    assert [await send(twice_by_key) for _ in range(3)] == [503, 503, 201]
    # Another key has its own counter; times defaults to 1; later items still apply.
    once = {"Idempotency-Key": "k2", "X-Test-Behavior": "status-first=429,status=200"}
    assert [await send(once) for _ in range(2)] == [429, 200]
    # X-Test-Id names the request when there is no key, and wins over the key.
    by_id = {"X-Test-Id": "t1", "X-Test-Behavior": "status-first=503"}
    assert [await send(by_id) for _ in range(2)] == [503, 201]
    assert await send({**by_id, "Idempotency-Key": "k1"}) == 201
    assert await send({**by_id, "X-Test-Id": "t2", "Idempotency-Key": "k1"}) == 503
    assert [e.number for e in upstream.executions_of_test_id("t1")] == [6, 7, 8]


async def test_gate_blocks_until_released(
    upstream: RecordingUpstream, client: httpx.AsyncClient
) -> None:
    request = asyncio.create_task(
        client.post(
            f"{upstream.url}/slow", headers={"Idempotency-Key": "g", "X-Test-Behavior": "gate=g1"}
        )
    )
    await upstream.wait_arrived("g1")
    # Recorded before answering; the answer is held back.
    assert upstream.count("g") == 1
    assert upstream.arrivals("g1") == 1
    assert upstream.inflight == 1
    assert not request.done()

    upstream.release("g1")
    response = await asyncio.wait_for(request, 10)
    assert response.status_code == 201
    assert response.json()["execution"] == 1
    await eventually(lambda: upstream.inflight == 0)


async def test_gate_released_before_arrival_passes_straight_through(
    upstream: RecordingUpstream, client: httpx.AsyncClient
) -> None:
    upstream.release("early")
    assert not upstream.arrived("early").is_set()
    response = await client.get(f"{upstream.url}/", headers={"X-Test-Behavior": "gate=early"})
    assert response.status_code == 201
    assert upstream.arrived("early").is_set()


async def test_reset_aborts_the_connection(
    upstream: RecordingUpstream, client: httpx.AsyncClient
) -> None:
    with pytest.raises(httpx.TransportError):
        await client.post(
            f"{upstream.url}/boom",
            content=b"payload",
            headers={"Idempotency-Key": "r", "X-Test-Behavior": "reset"},
        )
    assert upstream.count("r") == 1
    assert upstream.executions[0].body == b"payload"
    await eventually(lambda: upstream.inflight == 0)

    # The upstream keeps serving other requests.
    ok = await client.get(f"{upstream.url}/after")
    assert ok.status_code == 201
    assert ok.json()["execution"] == 2


async def test_reset_seen_by_aiohttp_client(upstream: RecordingUpstream) -> None:
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientError):
            async with session.post(upstream.url, headers={"X-Test-Behavior": "reset"}) as resp:
                await resp.read()
    assert upstream.total == 1


async def test_aiohttp_silently_resends_idempotent_methods_after_a_reset(
    upstream: RecordingUpstream,
) -> None:
    """Canary: aiohttp's ClientSession retries GET/HEAD/OPTIONS/TRACE/PUT/DELETE once on
    ServerDisconnected/ClientOSError (private ``_retry_connection``, no public switch), so an
    upstream sees a *second execution* of a PUT whose connection was reset."""
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientError):
            async with session.put(
                upstream.url, data=b"{}", headers={"X-Test-Behavior": "reset"}
            ) as resp:
                await resp.read()
    assert upstream.total == 2


async def test_hang_is_cancelled_when_the_client_disconnects(
    upstream: RecordingUpstream, client: httpx.AsyncClient
) -> None:
    request = asyncio.create_task(
        client.get(f"{upstream.url}/hang", headers={"X-Test-Behavior": "hang"})
    )
    await eventually(lambda: upstream.total == 1 and upstream.inflight == 1)
    assert not request.done()
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    await eventually(lambda: upstream.inflight == 0)


async def test_close_cancels_hanging_and_gated_requests(client: httpx.AsyncClient) -> None:
    async with RecordingUpstream() as upstream:
        hanging = asyncio.create_task(
            client.get(f"{upstream.url}/h", headers={"X-Test-Behavior": "hang"})
        )
        gated = asyncio.create_task(
            client.get(f"{upstream.url}/g", headers={"X-Test-Behavior": "gate=never"})
        )
        await upstream.wait_arrived("never")
        await eventually(lambda: upstream.inflight == 2)
    for task in (hanging, gated):
        with pytest.raises(httpx.TransportError):
            await asyncio.wait_for(task, 10)
    assert upstream.inflight == 0
    assert upstream.total == 2


async def test_stream_delivers_chunks_before_the_stream_gate_opens(
    upstream: RecordingUpstream, client: httpx.AsyncClient
) -> None:
    chunks, size = 4, 1000
    received = bytearray()
    async with client.stream(
        "GET",
        f"{upstream.url}/events",
        headers={"X-Test-Behavior": f"stream={chunks},chunk={size},stream-gate=last"},
    ) as response:
        assert response.status_code == 200
        assert response.headers["transfer-encoding"] == "chunked"
        assert response.headers["x-upstream-execution"] == "1"
        iterator = response.aiter_raw()
        while len(received) < (chunks - 1) * size:
            received += await anext(iterator)
        # Everything before the last chunk arrived while the gate is still closed.
        assert len(received) == (chunks - 1) * size
        assert upstream.arrived("last").is_set()
        upstream.release("last")
        async for piece in iterator:
            received += piece
    assert bytes(received) == b"x" * (chunks * size)


async def test_stream_without_gate(upstream: RecordingUpstream) -> None:
    async with (
        aiohttp.ClientSession() as session,
        session.get(upstream.url, headers={"X-Test-Behavior": "stream=3,chunk=5"}) as resp,
    ):
        body = await resp.read()
        assert resp.status == 200
        assert resp.headers["Transfer-Encoding"] == "chunked"
    assert body == b"x" * 15


async def test_body_of_requested_size(
    upstream: RecordingUpstream, client: httpx.AsyncClient
) -> None:
    response = await client.get(f"{upstream.url}/big", headers={"X-Test-Behavior": "body=70000"})
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/octet-stream"
    assert response.content == b"y" * 70000
    assert response.headers["x-upstream-execution"] == "1"


async def test_echo_headers(upstream: RecordingUpstream, client: httpx.AsyncClient) -> None:
    response = await client.get(
        f"{upstream.url}/echo",
        headers=[
            ("X-Test-Behavior", "echo-headers"),
            ("X-Request-Id", "rid-1"),
            ("X-Repeat", "a"),
            ("X-Repeat", "b"),
        ],
    )
    assert response.status_code == 200
    echoed = response.json()
    assert echoed["x-request-id"] == "rid-1"
    assert echoed["x-repeat"] == "a, b"
    assert echoed["x-test-behavior"] == "echo-headers"
    assert all(name == name.lower() for name in echoed)


async def test_separate_upstreams_have_separate_ports_and_counters() -> None:
    async with RecordingUpstream() as one, RecordingUpstream() as two:
        assert one.url != two.url
        async with httpx.AsyncClient() as http:
            await http.get(one.url)
        assert (one.total, two.total) == (1, 0)


# ------------------------------------------------------------------------ eventually


async def test_eventually_returns_the_truthy_value() -> None:
    calls: list[int] = []

    def predicate() -> list[int] | None:
        calls.append(1)
        return calls if len(calls) >= 3 else None

    assert await eventually(predicate, interval=0.001) == [1, 1, 1]

    async def async_predicate() -> str:
        return "done"

    assert await eventually(async_predicate) == "done"


async def test_eventually_times_out_with_assertion_error() -> None:
    with pytest.raises(AssertionError, match="condition not met"):
        await eventually(lambda: False, timeout=0.05, interval=0.01)


# ------------------------------------------------------------------------ serve_asgi


class TinyApp:
    """A minimal ASGI app with lifespan, to exercise serve_asgi."""

    def __init__(self, *, fail_startup: bool = False) -> None:
        self.events: list[str] = []
        self.fail_startup = fail_startup

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message: Message = await receive()
                if message["type"] == "lifespan.startup":
                    if self.fail_startup:
                        await send({"type": "lifespan.startup.failed", "message": "no"})
                        return
                    self.events.append("startup")
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    self.events.append("shutdown")
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        assert scope["type"] == "http"
        body = json.dumps({"path": scope["path"], "method": scope["method"]}).encode()
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/json")],
            }
        )
        await send({"type": "http.response.body", "body": body})


async def test_serve_asgi_serves_and_runs_lifespan(client: httpx.AsyncClient) -> None:
    app = TinyApp()
    async with serve_asgi(app) as url:
        assert url.startswith("http://127.0.0.1:")
        assert app.events == ["startup"]
        response = await client.post(f"{url}/hello")
        assert response.status_code == 200
        assert response.json() == {"path": "/hello", "method": "POST"}
    assert app.events == ["startup", "shutdown"]
    with pytest.raises(httpx.ConnectError):
        await client.get(url)


async def test_serve_asgi_lifespan_off_skips_lifespan(client: httpx.AsyncClient) -> None:
    app = TinyApp()
    async with serve_asgi(app, lifespan="off") as url:
        assert (await client.get(f"{url}/x")).json()["path"] == "/x"
    assert app.events == []


async def test_serve_asgi_raises_when_startup_fails() -> None:
    with pytest.raises(RuntimeError, match="failed to start"):
        async with serve_asgi(TinyApp(fail_startup=True)):
            pytest.fail("should not start")


# ---------------------------------------------------------------------- GatewayProcess

FAKE_CLI = textwrap.dedent(
    """
    import argparse, asyncio, signal, sys

    parser = argparse.ArgumentParser()
    parser.add_argument("command")
    parser.add_argument("--config", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--admin-port", type=int, required=True)
    parser.add_argument("--fail", action="store_true")
    args = parser.parse_args()
    if args.fail:
        print("fatal: refusing to start", file=sys.stderr)
        sys.exit(3)

    async def handle(reader, writer):
        await reader.readuntil(b"\\r\\n\\r\\n")
        body = open(args.config).read().encode()
        writer.write(b"HTTP/1.1 200 OK\\r\\ncontent-length: %d\\r\\nconnection: close\\r\\n\\r\\n"
                     % len(body) + body)
        await writer.drain()
        writer.close()

    async def main():
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        server = await asyncio.start_server(handle, args.host, args.port)
        print(f"listening {args.command} {args.host}:{args.port}", flush=True)
        await stop.wait()
        server.close()
        print("terminated gracefully", flush=True)

    asyncio.run(main())
    """
)


def _fake_gateway(tmp_path: Path, *extra: str) -> GatewayProcess:
    script = tmp_path / "fake_cli.py"
    script.write_text(FAKE_CLI)
    config = write_config(tmp_path, {"routes": [{"path": "/x", "upstream": "http://u"}]})
    return GatewayProcess(
        config, extra_args=extra, log_dir=tmp_path, command=[sys.executable, str(script)]
    )


def _process_state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


def test_free_port_and_write_config(tmp_path: Path) -> None:
    port = free_port()
    assert 0 < port < 65536
    path = write_config(tmp_path, {"b": 1, "a": {"nested": [1, 2]}})
    assert path == tmp_path / "gateway.yaml"
    assert path.read_text() == "b: 1\na:\n  nested:\n  - 1\n  - 2\n"


def test_default_command_is_the_gateway_cli(tmp_path: Path) -> None:
    process = GatewayProcess(tmp_path / "gateway.yaml", extra_args=["--workers", "1"], port=1234)
    assert process.argv == [
        sys.executable,
        "-m",
        "idempotency_gateway.cli",
        "serve",
        "--config",
        str(tmp_path / "gateway.yaml"),
        "--host",
        "127.0.0.1",
        "--port",
        "1234",
        "--admin-port",
        str(process.admin_port),
        "--workers",
        "1",
    ]
    assert process.url == "http://127.0.0.1:1234"


async def test_gateway_process_lifecycle(tmp_path: Path, client: httpx.AsyncClient) -> None:
    gateway = _fake_gateway(tmp_path)
    async with gateway:
        assert gateway.running
        response = await client.get(f"{gateway.url}/")
        assert response.status_code == 200
        assert "routes:" in response.text

        gateway.pause()
        await eventually(lambda: _process_state(gateway.pid) == "T")
        gateway.resume()
        await eventually(lambda: _process_state(gateway.pid) != "T")
        assert (await client.get(f"{gateway.url}/")).status_code == 200

        gateway.pause()  # stop() must resume a paused process for a graceful exit
    assert gateway.returncode == 0
    assert f"listening serve 127.0.0.1:{gateway.port}" in gateway.log_text()
    assert "terminated gracefully" in gateway.log_text()


async def test_gateway_process_kill(tmp_path: Path) -> None:
    gateway = _fake_gateway(tmp_path)
    await gateway.start()
    gateway.pause()
    assert await gateway.kill() == -9
    assert not gateway.running
    assert await gateway.stop() == -9  # idempotent after exit


async def test_gateway_process_exit_before_listening_reports_log_tail(tmp_path: Path) -> None:
    gateway = _fake_gateway(tmp_path, "--fail")
    with pytest.raises(RuntimeError, match="refusing to start") as failure:
        await gateway.start()
    assert "exited with code 3" in str(failure.value)
    assert gateway.returncode == 3
