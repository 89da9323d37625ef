"""Running the gateway under uvicorn: the proxy and admin listeners in every worker.

uvicorn's ``run`` binds one socket. The gateway needs two, so it binds both itself and hands
them to uvicorn's server (one worker) or to uvicorn's process supervisor (``--workers N``):
every worker then accepts on both, and one lifespan starts everything a worker needs.
"""

from __future__ import annotations

import socket

import uvicorn
from uvicorn.supervisors import Multiprocess

from idempotency_gateway.config import LimitsConfig
from idempotency_gateway.server.protocol import EdgeServerConfig
from idempotency_gateway.telemetry.logs import LogFormat, uvicorn_log_config
from idempotency_gateway.telemetry.multiprocess import forget_dead_workers

GATEWAY_FACTORY = "idempotency_gateway.main:gateway_from_environment"
# Long enough for in-flight executions to finish and finalize after SIGTERM.
GRACEFUL_SHUTDOWN_SECONDS = 30


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def serve(
    *,
    host: str,
    port: int,
    admin_port: int,
    workers: int,
    log_level: str,
    log_format: LogFormat,
    limits: LimitsConfig,
) -> None:
    config = EdgeServerConfig(
        GATEWAY_FACTORY,
        limits=limits,
        factory=True,
        host=host,
        port=port,
        workers=workers,
        loop="uvloop",
        # The proxy answers WebSocket scopes with a close; an Upgrade offer is ignored by
        # the edge protocol instead (it keeps the request body).
        ws="none",
        lifespan="on",
        log_level=log_level,
        log_config=uvicorn_log_config(log_level, log_format),
        access_log=False,
        # The gateway writes its own Via and request id; X-Forwarded-* it judges itself
        # against trusted_proxies, so uvicorn must not rewrite the client address.
        server_header=False,
        proxy_headers=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
    )
    sockets = [_bind(host, port), _bind(host, admin_port)]
    if workers > 1:
        forget_dead_workers()
        Multiprocess(config, sockets=sockets).run()
    else:
        uvicorn.Server(config).run(sockets=sockets)
