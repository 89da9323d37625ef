"""The listening sockets, bound and listening before anything else starts.

Bound without listening, a port could still be bound by a second process in the meantime
(SO_REUSEADDR lets two bind one port while neither listens): two gateways started at once
would both have said they started, and one would serve nothing. A socket that listens holds
its port: the second is refused at once, by name, before it creates anything. Connections
that arrive before a worker accepts wait in the backlog.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

# uvicorn's default, which every worker's listen() names again.
BACKLOG = 2048


class ListenError(Exception):
    """A listener could not bind: its port is taken, or the host is not this machine's."""


@dataclass(frozen=True)
class Listeners:
    """The proxy's and the admin API's sockets."""

    proxy: socket.socket
    admin: socket.socket

    @property
    def port(self) -> int:
        return int(self.proxy.getsockname()[1])

    @property
    def admin_port(self) -> int:
        """The port bound, which differs from the one asked for when that was 0: the workers
        tell admin connections from proxy ones by it."""
        return int(self.admin.getsockname()[1])


def bind_listeners(host: str, port: int, admin_port: int) -> Listeners:
    """Both sockets, or ``ListenError`` naming the one that could not listen."""
    proxy = listening_socket(host, port)
    try:
        return Listeners(proxy, listening_socket(host, admin_port))
    except ListenError:
        proxy.close()
        raise


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket listening on ``host:port`` that worker processes inherit."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        address = f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"
        raise ListenError(f"cannot listen on {address}: {exc.strerror or exc}") from None
    sock.set_inheritable(True)
    return sock
