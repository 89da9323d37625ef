"""A real PgBouncer in transaction mode in front of the tests' PostgreSQL database.

    with PgBouncer(postgres_url) as bouncer:
        store = open_store(bouncer.url, StoreConfig(prepared_statements=False))

It listens on a free loopback port with an ini generated in a temporary directory, and has
only ``SERVER_POOL_SIZE`` server connections for the database: many more clients than that
share them statement by statement, which is what breaks named prepared statements and
session-scoped locks. As root it runs as the ``postgres`` user (PgBouncer refuses root).
A missing ``pgbouncer`` binary is an error, never a skip: ``scripts/test`` installs it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from sqlalchemy.engine import make_url

from benchmarks.processes import free_port
from tests.support.servers import LOOPBACK

PGBOUNCER = Path("/usr/sbin/pgbouncer")
# Fewer server connections than the clients the tests open: PgBouncer must really share them.
SERVER_POOL_SIZE = 4
STARTUP_TIMEOUT = 10.0


def _ini(*, port: int, database: str, upstream_host: str, upstream_port: int, base: Path) -> str:
    return f"""\
[databases]
{database} = host={upstream_host} port={upstream_port} dbname={database}

[pgbouncer]
listen_addr = {LOOPBACK}
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {base / "users.txt"}
pool_mode = transaction
default_pool_size = {SERVER_POOL_SIZE}
max_client_conn = 1000
; LIFO reuse of idle server connections (the default, spelled out): the tests that move a
; client onto another server connection rely on it.
server_round_robin = 0
ignore_startup_parameters = extra_float_digits
logfile = {base / "pgbouncer.log"}
"""


class PgBouncer:
    """A PgBouncer process of this test run; ``url`` reaches the tests' database through it."""

    def __init__(self, postgres_url: str) -> None:
        if not PGBOUNCER.exists():
            raise RuntimeError(
                f"{PGBOUNCER} is missing: install the Debian package pgbouncer "
                "(scripts/test does this when run as root)"
            )
        self._target = make_url(postgres_url)
        self.port = free_port()
        self.database = self._target.database or "postgres"
        # Not under pytest's tmp_path: that is private to root, and PgBouncer runs as postgres.
        self.base = Path(tempfile.mkdtemp(prefix="gateway-pgbouncer-"))
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return self._target.set(host=LOOPBACK, port=self.port).render_as_string(hide_password=False)

    @property
    def dsn(self) -> str:
        """For asyncpg directly (no ``+asyncpg`` driver suffix)."""
        return self.url.replace("postgresql+asyncpg://", "postgresql://", 1)

    def log_text(self) -> str:
        with contextlib.suppress(FileNotFoundError):
            return (self.base / "pgbouncer.log").read_text(errors="replace")
        return ""

    def _argv(self) -> list[str]:
        argv = [str(PGBOUNCER), str(self.base / "pgbouncer.ini")]
        if os.geteuid() == 0:
            # setpriv execs in place (runuser would stay as a parent): the pid is PgBouncer's.
            return ["setpriv", "--reuid=postgres", "--regid=postgres", "--init-groups", *argv]
        return argv

    def start(self) -> None:
        user = self._target.username or "postgres"
        (self.base / "users.txt").write_text(f'"{user}" ""\n')
        (self.base / "pgbouncer.ini").write_text(
            _ini(
                port=self.port,
                database=self.database,
                upstream_host=self._target.host or LOOPBACK,
                upstream_port=self._target.port or 5432,
                base=self.base,
            )
        )
        if os.geteuid() == 0:
            for path in (self.base, *self.base.iterdir()):
                shutil.chown(path, user="postgres", group="postgres")
        self._process = subprocess.Popen(
            self._argv(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL
        )
        self._wait_until_listening()

    def _wait_until_listening(self) -> None:
        assert self._process is not None
        deadline = time.monotonic() + STARTUP_TIMEOUT
        while True:
            with contextlib.suppress(OSError), socket.create_connection((LOOPBACK, self.port), 1):
                return
            if time.monotonic() >= deadline:
                self.stop()
                raise RuntimeError(
                    f"pgbouncer did not listen on port {self.port} within {STARTUP_TIMEOUT}s; "
                    f"log:\n{self.log_text()}"
                )
            # Waiting on the process doubles as the poll interval and catches an early exit.
            with contextlib.suppress(subprocess.TimeoutExpired):
                code = self._process.wait(timeout=0.05)
                raise RuntimeError(f"pgbouncer exited with {code}; log:\n{self.log_text()}")

    def stop(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
