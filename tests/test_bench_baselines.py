"""The benchmark baselines on granian and pyreqwest run, and the pyreqwest proxy keeps the
proxy rules the comparison relies on (no decompression, no cookie jar, no redirect followed).

Real processes over loopback: the proxy runs under uvicorn as the harness starts it; its
upstream is a raw socket server, so what the proxy sends and receives is seen byte for byte
(an HTTP library upstream would parse away what these tests look at).
"""

from __future__ import annotations

import gzip
import http.client
import socketserver
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.processes import clean_environment, free_port, spawn, wait_until_answers
from benchmarks.scenarios import SERVER_BY_ID
from benchmarks.servers import ServerSpec, missing_modules

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
GZIP_BYTES = gzip.compress(b"ok", mtime=0)
REDIRECT = (
    b"HTTP/1.1 302 Found\r\nLocation: /elsewhere\r\nSet-Cookie: session=abc\r\n"
    b"Content-Encoding: gzip\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
    % len(GZIP_BYTES)
    + GZIP_BYTES
)
OK = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok"


class _Handler(socketserver.StreamRequestHandler):
    server: _RawUpstream

    def handle(self) -> None:
        head = b""
        while not head.endswith(b"\r\n\r\n"):
            line = self.rfile.readline()
            if not line:
                return
            head += line
        self.server.heads.append(head)
        self.wfile.write(REDIRECT if head.startswith(b"GET /redirect ") else OK)


class _RawUpstream(socketserver.ThreadingTCPServer):
    """Answers ``/redirect`` with a gzip-encoded 302 that sets a cookie, anything else 200;
    keeps every request head it received, raw."""

    daemon_threads = True

    def __init__(self) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.heads: list[bytes] = []


@pytest.fixture
def raw_upstream() -> Iterator[_RawUpstream]:
    server = _RawUpstream()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def _get(port: int, path: str) -> tuple[http.client.HTTPResponse, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request("GET", path, headers={"Accept-Encoding": "gzip"})
        response = connection.getresponse()
        return response, response.read()
    finally:
        connection.close()


def test_pyreqwest_proxy_passes_answers_through_as_the_upstream_sent_them(
    raw_upstream: _RawUpstream, tmp_path: Path
) -> None:
    port = free_port()
    upstream_url = f"http://127.0.0.1:{raw_upstream.server_address[1]}"
    argv = [
        sys.executable, "-m", "uvicorn", "benchmarks.minimal_proxy_pyreqwest:app",
        "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip
    env = clean_environment({"BENCH_UPSTREAM_URL": upstream_url})
    proxy = spawn("pyreqwest-proxy", argv, log_dir=tmp_path, env=env, cwd=ROOT, ports=(port,))
    try:
        wait_until_answers(proxy, port, "/ready")
        raw_upstream.heads.clear()

        response, body = _get(port, "/redirect")
        assert response.status == 302  # not followed
        assert response.getheader("Location") == "/elsewhere"
        assert response.getheader("Set-Cookie") == "session=abc"
        assert response.getheader("Content-Encoding") == "gzip"
        assert body == GZIP_BYTES  # the compressed bytes, not their decompression
        assert [head.split(b" ", 2)[1] for head in raw_upstream.heads] == [b"/redirect"]

        response, body = _get(port, "/after")
        assert (response.status, body) == (200, b"ok")
        after = raw_upstream.heads[-1].lower()
        assert b"cookie:" not in after  # the Set-Cookie above went into no jar
        assert b"accept-encoding: gzip\r\n" in after  # the client's own, passed on as sent
    finally:
        proxy.stop()


def test_a_baseline_names_the_bench_packages_it_lacks() -> None:
    spec = ServerSpec("x", "x", "asgi-app", requires=("granian", "no_such_module_for_the_bench"))
    assert missing_modules(spec) == ["no_such_module_for_the_bench"]
    assert missing_modules(SERVER_BY_ID["minimal-proxy"]) == []  # the aiohttp floor needs none


def _row(text: str, scenario_id: str) -> list[str]:
    line = next(line for line in text.splitlines() if f"(`{scenario_id}`)" in line)
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def test_the_granian_pyreqwest_and_edge_scenarios_carry_load(tmp_path: Path) -> None:
    output = tmp_path / "RESULTS.md"
    scenarios = ("minproxy-granian", "minproxy-pyreqwest-large", "hello-granian", "hello-edge")
    command = [
        sys.executable, "-m", "benchmarks",
        "--builtin-upstream", "--builtin-loadgen", "--no-redis",
        "--scenarios", ",".join(scenarios),
        "--duration", "1", "--warmup", "0.5", "--connections", "4",
        "--output", str(output),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    text = output.read_text()
    assert "| granian | not installed |" not in text
    for scenario_id in scenarios:
        cells = _row(text, scenario_id)
        assert float(cells[2].replace(",", "")) > 0, cells  # req/s
        assert cells[5] == "0", cells  # no errors: every 1 MiB answer streamed through whole
        assert "ms CPU/req" in cells[8], cells  # the number these baselines exist for
