"""Every private part of uvicorn the gateway builds on, named in one place.

``server/`` subclasses uvicorn's httptools protocol and reads its request cycle; ``serve.py``
subclasses its multiprocess supervisor. None of that is uvicorn's public API, so the
``[server]`` extra in ``pyproject.toml`` pins the versions it was checked on (0.51 is the first
whose ``Multiprocess`` takes ``(config, sockets)`` and whose workers report being ready; 0.50
fails with a ``TypeError``). An upgrade that drops or reshapes any of these fails here, in CI,
instead of in ``serve``.
"""

from __future__ import annotations

import asyncio
import inspect
import signal
import tomllib
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from packaging.requirements import Requirement
from packaging.version import Version

from tests.support.waiting import eventually

PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


def _parameters(function: Any) -> list[str]:
    return list(inspect.signature(function).parameters)


def _pinned_uvicorn() -> Requirement:
    # The standalone gateway's extra: the middleware alone runs under any server.
    server = tomllib.loads(PYPROJECT.read_text())["project"]["optional-dependencies"]["server"]
    return next(r for r in map(Requirement, server) if r.name == "uvicorn")


def test_the_installed_uvicorn_is_in_the_pinned_range() -> None:
    pinned = _pinned_uvicorn()
    assert pinned.specifier, "uvicorn must be pinned to the versions checked here"
    # An upper bound: the next minor release may reshape any private class named below.
    assert any(spec.operator == "<" for spec in pinned.specifier), pinned
    assert Version(uvicorn.__version__) in pinned.specifier, (uvicorn.__version__, pinned)


def test_the_private_modules_and_names() -> None:
    from uvicorn._types import ASGI3Application
    from uvicorn.config import STARTUP_FAILURE
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
    from uvicorn.server import ServerState
    from uvicorn.supervisors import Multiprocess

    assert ASGI3Application is not None
    assert isinstance(STARTUP_FAILURE, int)
    assert inspect.isclass(HttpToolsProtocol)
    assert inspect.isclass(RequestResponseCycle)
    assert inspect.isclass(ServerState)
    assert inspect.isclass(Multiprocess)


def test_the_protocol_methods_the_edge_protocol_overrides_or_calls() -> None:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    assert _parameters(HttpToolsProtocol.__init__) == [
        "self",
        "config",
        "server_state",
        "app_state",
        "_loop",
    ]
    for name, parameters in {
        "connection_made": ["self", "transport"],
        "connection_lost": ["self", "exc"],
        "data_received": ["self", "data"],
        "on_message_begin": ["self"],
        "on_url": ["self", "url"],
        "on_header": ["self", "name", "value"],
        "on_headers_complete": ["self"],
        "on_message_complete": ["self"],
        "_start_asgi_task": ["self", "cycle", "app"],
        "_unset_keepalive_if_required": ["self"],
    }.items():
        assert _parameters(getattr(HttpToolsProtocol, name)) == parameters, name


def test_the_supervisor_methods_serve_overrides_or_calls(monkeypatch: pytest.MonkeyPatch) -> None:
    from uvicorn.supervisors import Multiprocess
    from uvicorn.supervisors.multiprocess import Process

    assert _parameters(Multiprocess.__init__) == ["self", "config", "sockets"]
    for name in (
        "handle_hup",
        "handle_term",
        "handle_signals",
        "terminate_all",
        "run",
        # Called on each turn of the supervisor's loop: the gateway's own health check of
        # every worker at once, and the dead workers' gauges reaped
        # (``GatewaySupervisor.keep_subprocess_alive``).
        "keep_subprocess_alive",
    ):
        assert _parameters(getattr(Multiprocess, name)) == ["self"], name
    # A worker, as the health check replaces it: built, started, killed, joined.
    assert _parameters(Process.__init__) == ["self", "config", "sockets"]
    for name in ("start", "kill", "join"):
        assert _parameters(getattr(Process, name)) == ["self"], name
    assert isinstance(Process.pid, property)
    assert "self.process = get_subprocess(" in inspect.getsource(Process.__init__)
    # Each worker answers a ping on its pipe from a thread of its own (``worker_health``).
    assert "self.child_conn.send(self.server.started)" in inspect.getsource(Process.pong)
    assert 'self.parent_conn.send(b"ping")' in inspect.getsource(Process._healthcheck)
    # The supervisor installs its signal handlers when built: not in the test process.
    monkeypatch.setattr(signal, "signal", lambda *_: None)
    supervisor = Multiprocess(uvicorn.Config("tests:app", workers=1), sockets=[])
    # serve.py reads these from the running supervisor, and each worker's exit code.
    assert supervisor.processes == []
    assert not supervisor.should_exit.is_set()
    assert supervisor.sockets == []
    assert isinstance(Process.exitcode, property)


class _Transport(asyncio.Transport):
    def __init__(self) -> None:
        super().__init__()
        self.written = bytearray()
        self.closing = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return {"sockname": ("127.0.0.1", 8080), "peername": ("127.0.0.1", 50000)}.get(
            name, default
        )

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return self.closing

    def close(self) -> None:
        self.closing = True


async def test_the_request_cycle_attributes_the_server_layer_reads() -> None:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle
    from uvicorn.server import ServerState

    received = asyncio.Event()

    async def app(scope: Any, receive: Any, send: Any) -> None:
        received.set()
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    config = uvicorn.Config(app, lifespan="off", log_config=None)
    config.load()
    protocol = HttpToolsProtocol(config, ServerState(), {}, asyncio.get_running_loop())
    for name in ("parser", "connections", "loop", "logger"):
        assert hasattr(protocol, name), name
    transport = _Transport()
    protocol.connection_made(transport)
    assert protocol.transport is transport
    assert protocol in protocol.connections
    protocol.data_received(b"GET /x HTTP/1.1\r\nHost: gateway\r\nA: b\r\n\r\n")
    assert (protocol.url, protocol.headers) == (b"/x", [(b"host", b"gateway"), (b"a", b"b")])
    cycle = protocol.cycle
    assert isinstance(cycle, RequestResponseCycle)
    assert cycle.scope is protocol.scope
    assert cycle.scope["method"] == "GET"
    # disconnect.py tells the server's receive by the class of the object it is bound to.
    assert getattr(cycle.receive, "__self__", None) is cycle
    await received.wait()
    for name in ("transport", "message_event", "disconnected"):
        assert hasattr(cycle, name), name
    await eventually(lambda: cycle.response_complete)
    assert cycle.response_started
    assert transport.written.startswith(b"HTTP/1.1 204 ")
    # The edge lingers after an answer that ends the connection while the body is coming.
    assert cycle.more_body is False
    # http10.py sets these before the head goes out.
    assert isinstance(cycle.chunked_encoding, bool | None)
    assert isinstance(cycle.expected_content_length, int)


def test_the_config_the_edge_protocol_extends() -> None:
    from idempotency_gateway.config import LimitsConfig
    from idempotency_gateway.server.protocol import EdgeProtocol, EdgeServerConfig

    # EdgeServerConfig hands its protocol class to uvicorn through the ``http`` option.
    config = EdgeServerConfig("tests:app", limits=LimitsConfig())
    assert config.http is EdgeProtocol
