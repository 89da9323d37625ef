"""The tests' ``free_port`` never hands out one port twice in a process."""

from __future__ import annotations

import socket

from tests.support import free_port


def test_ports_handed_out_are_all_different_and_bindable() -> None:
    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", ports[-1]))  # free when handed out, and still free now
