"""Reusable test support: a scriptable recording upstream, in-loop and subprocess servers,
and deadline-based polling. Everything talks real HTTP over loopback; nothing is mocked."""

from benchmarks.processes import free_port
from tests.support.servers import GatewayProcess, serve_asgi, write_config
from tests.support.upstream import Execution, RecordingUpstream
from tests.support.waiting import eventually

__all__ = [
    "Execution",
    "GatewayProcess",
    "RecordingUpstream",
    "eventually",
    "free_port",
    "serve_asgi",
    "write_config",
]
