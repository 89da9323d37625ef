"""A gateway cluster of our own: several gateway processes, one private PostgreSQL, one
private Redis, so stopping a dependency never disturbs the servers other tests share.

    async with PrivatePostgres() as postgres, PrivateRedis() as redis_server:
        cluster = Cluster(workdir, upstream_url=upstream.url, postgres=postgres,
                          redis_server=redis_server, size=3)
        await cluster.start()
        await postgres.stop(); await postgres.start()     # a real outage and recovery
        await redis_server.kill(); await redis_server.start()
        replacement = await cluster.replace(cluster.gateways[0])   # after a kill -9

PostgreSQL is a throwaway cluster made with ``initdb`` in a temporary directory, run with
``pg_ctl`` on a free loopback port and stopped with ``-m immediate`` (a crash, not a polite
shutdown). As root the PostgreSQL programs run as the ``postgres`` user (they refuse root).
``ReplicatedPostgres`` adds a hot standby made with ``pg_basebackup -R`` that streams from the
primary through a ``TcpProxy`` (so a test can stall the link), synchronously or not, and the
gateways reach the pair through one multi-host URL:

    async with ReplicatedPostgres(synchronous=True) as postgres:   # postgres.url lists both
        await postgres.kill()                  # SIGKILL the primary's whole process group
        await postgres.standby.promote()       # the standby accepts writes
Redis is a ``redis-server`` child process on a free port without persistence, killed with
SIGKILL and started again on the same port. Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import asyncpg
import redis.asyncio

from tests.support import GatewayProcess, eventually, free_port, write_config
from tests.support.lifecycle import StartedInContext
from tests.support.servers import LOOPBACK, PROJECT_ROOT
from tests.support.tcp_proxy import TcpProxy

POSTGRES_ROOT = Path("/usr/lib/postgresql")
DATABASE = "idempotency_gateway"
STANDBY_NAME = "standby"
"""The standby's ``cluster_name``, which its WAL receiver reports as ``application_name``:
the name ``synchronous_standby_names`` lists."""
ADMIN_TOKEN = "fault-suite-admin-token"
LEASE = 1.0
"""Seconds: short, so takeovers after a crash or a stall happen within the run."""

ROUTES = {"/v1/charges": "fail", "/v1/transfers": "retry"}
"""Path prefix -> ``on_ambiguous`` policy: both policies are under load in every run."""


def postgres_bin_dir() -> Path | None:
    """The newest PostgreSQL server binaries installed (Debian layout), if any."""
    if not POSTGRES_ROOT.is_dir():
        return None
    versions = sorted(
        (path for path in POSTGRES_ROOT.iterdir() if (path / "bin" / "initdb").exists()),
        key=lambda path: [int(part) for part in path.name.split(".") if part.isdigit()],
    )
    return versions[-1] / "bin" if versions else None


async def run_command(*argv: str, env: dict[str, str] | None = None, timeout: float = 60.0) -> str:  # noqa: ASYNC109
    """Run a command without blocking the loop (the upstream lives in it); fail loudly."""
    process = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        cwd=PROJECT_ROOT,
    )
    output, _ = await asyncio.wait_for(process.communicate(), timeout)
    text = output.decode(errors="replace")
    if process.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited with {process.returncode}:\n{text}")
    return text


class PrivatePostgres:
    """A PostgreSQL cluster that belongs to this test run alone."""

    def __init__(self, *, settings: Mapping[str, str] | None = None) -> None:
        bin_dir = postgres_bin_dir()
        if bin_dir is None:
            raise RuntimeError(f"no PostgreSQL server binaries under {POSTGRES_ROOT}")
        self.bin_dir = bin_dir
        self.settings = dict(settings or {})
        """Extra ``-c name=value`` server settings."""
        self.port = free_port()
        # Not under pytest's tmp_path: that is private to root, and the server runs as postgres.
        self.base = Path(tempfile.mkdtemp(prefix="gateway-faults-pg-"))
        self.data_dir = self.base / "data"
        self.running = False
        self.restarts = 0

    @property
    def url(self) -> str:
        return f"postgresql+asyncpg://postgres@{LOOPBACK}:{self.port}/{DATABASE}"

    @property
    def dsn(self) -> str:
        """For asyncpg directly (the checker reads the records with plain SQL)."""
        return f"postgresql://postgres@{LOOPBACK}:{self.port}/{DATABASE}"

    def _as_postgres(self, program: str, *args: str) -> list[str]:
        argv = [str(self.bin_dir / program), *args]
        if os.geteuid() == 0:
            return ["runuser", "-u", "postgres", "--", *argv]
        return argv

    async def create(self) -> None:
        """initdb, start, create the database and migrate it with the gateway's own CLI."""
        if os.geteuid() == 0:
            shutil.chown(self.base, user="postgres", group="postgres")
        await run_command(
            *self._as_postgres(
                "initdb", "-D", str(self.data_dir), "-A", "trust", "-U", "postgres", "--no-sync"
            )
        )
        await self.start()
        await run_command(
            *self._as_postgres(
                "createdb", "-h", LOOPBACK, "-p", str(self.port), "-U", "postgres", DATABASE
            )
        )
        await run_command(
            sys.executable,
            "-m",
            "idempotency_gateway.cli",
            "migrate",
            env={"GATEWAY_DATABASE_URL": self.url},
        )

    async def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.base} -c listen_addresses={LOOPBACK} "
            # A test database: durability against power loss buys nothing here.
            "-c fsync=off -c full_page_writes=off -c max_connections=200"
            + "".join(f" -c {name}={value}" for name, value in self.settings.items())
        )
        log = self.base / "postgres.log"
        await run_command(
            *self._as_postgres(
                "pg_ctl", "-D", str(self.data_dir), "-o", options, "-l", str(log), "-w", "start"
            )
        )
        self.running = True

    async def stop(self) -> None:
        """A crash: ``-m immediate`` kills the server without a shutdown checkpoint."""
        await run_command(
            *self._as_postgres("pg_ctl", "-D", str(self.data_dir), "-m", "immediate", "-w", "stop")
        )
        self.running = False
        self.restarts += 1

    async def kill(self) -> None:
        """SIGKILL the postmaster and every backend at once (``pg_ctl`` makes the postmaster
        a process group leader): no shutdown of any kind, as when its machine dies."""
        # postmaster.pid: the PID on line 1, "<key> <id>" of its shared memory on line 7.
        lines = (self.data_dir / "postmaster.pid").read_text().splitlines()
        pid, shared_memory = int(lines[0]), lines[6].split()[-1]
        os.killpg(pid, signal.SIGKILL)
        self.running = False
        self.restarts += 1

        def gone() -> bool:
            try:
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except FileNotFoundError:
                return True
            return state == "Z"  # a zombie holds no port; whoever reaps it is not our concern

        await eventually(gone, timeout=10.0, message=f"postmaster {pid} died")
        # Nobody left to remove the segment: a killed postmaster's outlives it.
        await run_command("ipcrm", "-m", shared_memory)

    async def clone_as_standby(self, source_port: int) -> None:
        """``pg_basebackup -R`` from the server on ``source_port`` into this data directory (a
        standby streaming from that port, set up by ``-R``), then start it."""
        if os.geteuid() == 0:
            shutil.chown(self.base, user="postgres", group="postgres")
        await run_command(
            *self._as_postgres(
                "pg_basebackup",
                *("-h", LOOPBACK, "-p", str(source_port), "-U", "postgres"),
                *("-D", str(self.data_dir), "-R", "-X", "stream", "--checkpoint=fast", "--no-sync"),
            )
        )
        await self.start()

    async def promote(self) -> None:
        """``pg_ctl promote``: the standby ends recovery and accepts writes."""
        await run_command(*self._as_postgres("pg_ctl", "-D", str(self.data_dir), "-w", "promote"))

    async def destroy(self) -> None:
        if self.running:
            with contextlib.suppress(RuntimeError):
                await self.stop()
        shutil.rmtree(self.base, ignore_errors=True)

    async def __aenter__(self) -> Self:
        try:
            await self.create()
        except BaseException:
            await self.destroy()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.destroy()


class ReplicatedPostgres(PrivatePostgres):
    """A private primary (this object: ``stop``, ``start`` and ``kill`` act on it) with one
    hot standby streaming from it through ``link``. ``url`` and ``dsn`` list both servers
    with ``target_session_attrs=read-write``: they reach whichever accepts writes, before and
    after a failover.

    ``synchronous``: the primary waits for the standby to confirm each commit
    (``synchronous_commit = on``, ``synchronous_standby_names``); otherwise it streams WAL
    asynchronously, PostgreSQL's default.
    """

    def __init__(self, *, synchronous: bool) -> None:
        super().__init__()
        if not (self.bin_dir / "pg_basebackup").exists():
            raise RuntimeError(f"no pg_basebackup beside initdb in {self.bin_dir}")
        self.synchronous = synchronous
        self.standby = PrivatePostgres(settings={"cluster_name": STANDBY_NAME})
        self.link = TcpProxy(LOOPBACK, self.port)

    def _hosts(self) -> str:
        return f"{LOOPBACK}:{self.port},{LOOPBACK}:{self.standby.port}"

    @property
    def url(self) -> str:
        return (
            f"postgresql+asyncpg://postgres@{self._hosts()}/{DATABASE}"
            "?target_session_attrs=read-write"
        )

    @property
    def dsn(self) -> str:
        return f"postgresql://postgres@{self._hosts()}/{DATABASE}?target_session_attrs=read-write"

    @property
    def primary_dsn(self) -> str:
        """This primary alone, whatever the standby is now."""
        return f"postgresql://postgres@{LOOPBACK}:{self.port}/{DATABASE}"

    async def create(self) -> None:
        await super().create()
        await self.link.start()
        await self.standby.clone_as_standby(self.link.port)
        primary = await asyncpg.connect(self.primary_dsn)
        try:
            if self.synchronous:
                await primary.execute(
                    f"ALTER SYSTEM SET synchronous_standby_names = '{STANDBY_NAME}'"
                )
                await primary.execute("ALTER SYSTEM SET synchronous_commit = 'on'")
                await primary.execute("SELECT pg_reload_conf()")
            wanted = "sync" if self.synchronous else "async"

            async def streaming() -> bool:
                state: str | None = await primary.fetchval(
                    "SELECT sync_state FROM pg_stat_replication "
                    "WHERE application_name = $1 AND state = 'streaming'",
                    STANDBY_NAME,
                )
                return state == wanted

            await eventually(streaming, timeout=20.0, message=f"the standby streams ({wanted})")
        finally:
            await primary.close()

    async def destroy(self) -> None:
        await self.link.close()
        await self.standby.destroy()
        await super().destroy()


class PrivateRedis(StartedInContext):
    """A ``redis-server`` child process on a free loopback port, without persistence."""

    def __init__(self) -> None:
        self.port = free_port()
        self._process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.returncode is None

    async def start(self) -> None:
        """Start (again, on the same port) and wait until it answers PING."""
        self._process = await asyncio.create_subprocess_exec(
            "redis-server",
            "--bind",
            LOOPBACK,
            "--port",
            str(self.port),
            "--save",
            "",
            "--appendonly",
            "no",
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        client = redis.asyncio.Redis.from_url(self.url, socket_timeout=0.5)

        async def answers() -> bool:
            if not self.running:
                raise RuntimeError(f"redis-server on port {self.port} exited at start")
            try:
                return bool(await client.ping())
            except (redis.RedisError, OSError):
                return False

        try:
            await eventually(answers, timeout=10.0, message="private redis-server answers PING")
        finally:
            await client.aclose()

    async def kill(self) -> None:
        """SIGKILL: every connection dies, every entry is gone."""
        if self._process is not None and self._process.returncode is None:
            self._process.kill()
            await self._process.wait()

    async def close(self) -> None:
        """Leaving ``async with`` just kills it: it holds nothing worth a clean shutdown."""
        await self.kill()


def cluster_config(upstream_url: str, *, statement_timeout: str = "1s") -> dict[str, Any]:
    """Two keyed routes (``on_ambiguous: fail`` and ``retry``) with a short lease, short
    upstream timeouts and a breaker that recovers within a second, so every fault resolves
    within a run."""
    routes = [
        {
            "name": path.strip("/").replace("/", "-"),
            "match": {"path_prefix": path},
            "upstream": "ledger",
            "idempotency": {
                "methods": ["POST"],
                "key": "required",
                "lease": f"{LEASE:g}s",
                "on_ambiguous": policy,
                "wait_max": "2s",
            },
        }
        for path, policy in ROUTES.items()
    ]
    return {
        "upstreams": {
            "ledger": {
                "url": upstream_url,
                "timeouts": {"connect": "500ms", "per_try": "3s", "total": "5s"},
                "retry": {"max_attempts": 3, "base": "20ms", "cap": "200ms"},
                "breaker": {
                    "window": "5s",
                    "min_calls": 20,
                    "failure_rate": 0.5,
                    "slow_call": "2s",
                    "open_for": "1s",
                    "half_open_calls": 2,
                },
            }
        },
        "routes": routes,
        "store": {
            "pool_size": 8,
            "connect_timeout": "1s",
            "statement_timeout": statement_timeout,
            "finalize_attempts": 3,
        },
        "sweeper": {"interval": "0s"},
    }


class Cluster:
    """``size`` gateway processes behind one config, on the private PostgreSQL and Redis.

    ``gateways`` are the ones a load balancer would send to; a killed gateway leaves that
    list (its log stays readable through ``all_gateways``) and ``replace`` starts another.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        upstream_url: str,
        database_url: str,
        redis_url: str,
        size: int = 3,
        log_format: str = "json",
        env: dict[str, str] | None = None,
        statement_timeout: str = "1s",
    ) -> None:
        self.workdir = workdir
        self.size = size
        self.config_path = write_config(
            workdir,
            cluster_config(upstream_url, statement_timeout=statement_timeout),
            "cluster.yaml",
        )
        self.env = {
            "GATEWAY_DATABASE_URL": database_url,
            "GATEWAY_REDIS_URL": redis_url,
            "GATEWAY_ADMIN_TOKEN": ADMIN_TOKEN,
            **(env or {}),
        }
        self.log_format = log_format
        self.gateways: list[GatewayProcess] = []
        self.all_gateways: list[GatewayProcess] = []
        self._started = 0

    def _new_gateway(self) -> GatewayProcess:
        self._started += 1
        gateway = GatewayProcess(
            self.config_path,
            env=self.env,
            extra_args=["--log-format", self.log_format, "--log-level", "warning"],
            log_dir=self.workdir,
            name=f"gateway-{self._started}",
            # A deadline, not a wait: a loaded machine takes seconds to import the gateway
            # twice (supervisor, then worker), and several start at once.
            startup_timeout=60.0,
        )
        self.all_gateways.append(gateway)
        return gateway

    async def start(self) -> None:
        fresh = [self._new_gateway() for _ in range(self.size)]
        await asyncio.gather(*(gateway.start() for gateway in fresh))
        self.gateways.extend(fresh)

    async def kill(self, gateway: GatewayProcess) -> None:
        """kill -9: no drain, no finalize; the load balancer stops sending to it."""
        await gateway.kill()
        if gateway in self.gateways:
            self.gateways.remove(gateway)

    async def replace(self) -> GatewayProcess:
        """Start one more gateway and put it behind the load balancer."""
        gateway = self._new_gateway()
        await gateway.start()
        self.gateways.append(gateway)
        return gateway

    def logs(self) -> str:
        return "\n".join(gateway.log_text() for gateway in self.all_gateways)

    async def close(self) -> None:
        for gateway in self.all_gateways:
            if gateway.paused:
                gateway.resume()
        await asyncio.gather(
            *(gateway.stop(timeout=10.0) for gateway in self.all_gateways), return_exceptions=True
        )
