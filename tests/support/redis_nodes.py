"""Private ``redis-server`` processes: one node, or a Redis Cluster of several.

    async with RedisNode() as node:            # killed, paused, restarted at will
        node.pause(); node.resume(); await node.kill(); await node.start()

    async with RedisClusterNodes(3) as cluster:  # cluster.url is a redis+cluster:// URL

Nodes listen on free loopback ports, keep no data on disk (cluster nodes keep only their
``nodes.conf``, in a temporary directory, so a restarted node rejoins with its slots).
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar, cast

import pytest
import redis.asyncio
from redis.asyncio import RedisCluster
from redis.exceptions import RedisError

from benchmarks.processes import free_port
from idempotency_gateway.replay.redis_connection import cluster_client
from tests.support.lifecycle import StartedInContext
from tests.support.servers import LOOPBACK
from tests.support.waiting import eventually

Test = TypeVar("Test", bound=Callable[..., object])


def tolerates_dead_node_leaks(test: Test) -> Test:
    """For a test that kills a cluster node: redis-py's cluster client drops the dead node's
    connection objects when it re-reads the topology without closing their transports (a
    library leak on this fault path only), which would fail the test as a ResourceWarning."""
    for ignored in (
        "ignore:unclosed <StreamWriter:ResourceWarning",
        "ignore::pytest.PytestUnraisableExceptionWarning",
    ):
        test = cast(Test, pytest.mark.filterwarnings(ignored)(test))
    return test


def redis_server_path() -> str:
    """Fail loudly: these tests are part of the suite, a missing server is a broken setup."""
    path = shutil.which("redis-server")
    if path is None or shutil.which("redis-cli") is None:
        raise RuntimeError(
            "redis-server and redis-cli are required (Debian: apt-get install redis-server)"
        )
    return path


class RedisNode(StartedInContext):
    def __init__(self, *, cluster_dir: Path | None = None) -> None:
        self.port = free_port()
        self.cluster_dir = cluster_dir
        self.bus_port = free_port()
        self._process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"redis://{LOOPBACK}:{self.port}/0"

    @property
    def address(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    async def start(self) -> None:
        """Start (again, on the same port) and wait until it answers PING."""
        options = ["--bind", LOOPBACK, "--port", str(self.port), "--save", ""]
        options += ["--appendonly", "no"]
        if self.cluster_dir is not None:
            options += ["--cluster-enabled", "yes", "--dir", str(self.cluster_dir)]
            options += ["--cluster-config-file", f"nodes-{self.port}.conf"]
            options += ["--cluster-node-timeout", "1000"]
            # As the README advises for a cluster without replicas: the live primaries keep
            # serving their slots when one dies (the default stops the whole cluster).
            options += ["--cluster-require-full-coverage", "no"]
            # Its own bus port: the default (port + 10000) overflows for ephemeral ports.
            options += ["--cluster-port", str(self.bus_port)]
            options += ["--logfile", str(self.cluster_dir / f"redis-{self.port}.log")]
        self._process = await asyncio.create_subprocess_exec(
            redis_server_path(),
            *options,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
        )
        client = redis.asyncio.Redis.from_url(self.url, socket_timeout=0.5)

        async def answers() -> bool:
            if self._process is None or self._process.returncode is not None:
                raise RuntimeError(
                    f"redis-server on port {self.port} exited at start{self._log_tail()}"
                )
            try:
                return bool(await client.ping())
            except (RedisError, OSError):
                return False

        try:
            _: bool = await eventually(answers, message=f"redis-server on {self.port} answers PING")
        finally:
            await client.aclose()

    def _log_tail(self) -> str:
        if self.cluster_dir is None:
            return ""
        log = self.cluster_dir / f"redis-{self.port}.log"
        return ": " + " | ".join(log.read_text().splitlines()[-3:]) if log.exists() else ""

    async def command(self, *args: str) -> object:
        """One command asked of this node alone (a cluster client would re-read the topology
        around a dead node)."""
        client = redis.asyncio.Redis.from_url(self.url, socket_timeout=2.0)
        try:
            return await client.execute_command(*args)  # type: ignore[no-untyped-call]
        finally:
            await client.aclose()

    async def shard_subscribers(self, channel: str) -> int:
        """How many connections listen on the sharded ``channel`` here."""
        reply = await self.command("PUBSUB", "SHARDNUMSUB", channel)
        assert isinstance(reply, list), reply
        return int(reply[1])

    def pause(self) -> None:
        """SIGSTOP: connections stay open, nothing answers."""
        assert self._process is not None
        self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self._process is not None
        self._process.send_signal(signal.SIGCONT)

    async def kill(self) -> None:
        if self._process is not None and self._process.returncode is None:
            self._process.send_signal(signal.SIGCONT)
            self._process.kill()
            await self._process.wait()

    async def close(self) -> None:
        await self.kill()


class RedisClusterNodes(StartedInContext):
    """``size`` primaries, no replicas, every slot covered."""

    def __init__(self, size: int = 3) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="igw-redis-cluster-")
        self.nodes = [RedisNode(cluster_dir=Path(self._dir.name)) for _ in range(size)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(node.address for node in self.nodes)

    def client(self, *, timeout: float | None) -> RedisCluster:
        """A cluster client as the gateway makes one (``timeout=None``: a subscriber's)."""
        return cluster_client(self.url, timeout=timeout, connect_timeout=1.0)

    async def start(self) -> None:
        for node in self.nodes:
            await node.start()
        create = await asyncio.create_subprocess_exec(
            *("redis-cli", "--cluster", "create", *(node.address for node in self.nodes)),
            *("--cluster-replicas", "0", "--cluster-yes"),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
        output = (await create.communicate())[0]
        if create.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {output.decode()}")
        _: bool = await eventually(self._healthy, message="every node reports cluster_state:ok")

    async def _healthy(self) -> bool:
        for node in self.nodes:
            client = redis.asyncio.Redis.from_url(node.url, socket_timeout=0.5)
            try:
                info = await client.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
            except (RedisError, OSError):
                return False
            finally:
                await client.aclose()
            if b"cluster_state:ok" not in info:
                return False
        return True

    async def wait_healthy(self) -> None:
        _: bool = await eventually(self._healthy, timeout=20.0, message="cluster_state:ok again")

    async def close(self) -> None:
        for node in self.nodes:
            await node.kill()
        self._dir.cleanup()
