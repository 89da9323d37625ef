"""Operating a fleet of real ``serve`` processes: config reload on SIGHUP, worker health
and draining.

Proves that SIGHUP brings an edited config file to every worker of ``serve --workers 2`` (and
to a single worker) by replacing each one, while an invalid file is refused with the bad field
named in the log and the running workers keep the old config; that SIGTERM first fails
``/readyz`` while new and in-flight requests are still served for ``lifecycle.drain_grace``,
then finalizes the in-flight record and exits 0; and that ``POST /admin/drain`` fails
``/readyz`` in every worker without stopping any of them (``DELETE`` undoes it).
"""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from idempotency_gateway.config import StoreConfig
from idempotency_gateway.storage import open_store
from idempotency_gateway.storage.records import Status
from tests.support import GatewayProcess, RecordingUpstream, eventually, write_config
from tests.support.charges import CHARGES
from tests.support.gateway import gateway_config, route
from tests.support.keyed import keyed_gateway_config, record_key, send_keyed

pytestmark = pytest.mark.multiprocess

TOKEN = "fleet-admin-token"
# Fresh connections for every probe: each may be accepted by any worker.
PROBES = 20


def config_file(tmp_path: Path, upstream_url: str, **settings: Any) -> Path:
    config = gateway_config(upstream_url, routes=[route("/", key="optional")], **settings)
    return write_config(tmp_path, config.model_dump(mode="json"))


def worker_pids(supervisor: int) -> set[int]:
    """The supervisor's live worker processes (multiprocessing spawns them via spawn_main)."""
    children = Path(f"/proc/{supervisor}/task/{supervisor}/children").read_text().split()
    workers = set()
    for pid in map(int, children):
        try:
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                workers.add(pid)
        except FileNotFoundError:
            continue  # exited between the two reads
    return workers


async def fresh_get(url: str) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        return await client.get(url, headers={"Connection": "close"})


async def all_served_by(gateway: GatewayProcess, upstream: RecordingUpstream) -> bool:
    for _ in range(PROBES):
        before = upstream.total
        response = await fresh_get(gateway.url + "/v1/ping")
        if not response.is_success or upstream.total != before + 1:
            return False
    return True


async def all_ready_status(gateway: GatewayProcess, status: int) -> bool:
    for _ in range(PROBES):
        if (await fresh_get(gateway.admin_url + "/readyz")).status_code != status:
            return False
    return True


@pytest.fixture
async def upstreams() -> AsyncIterator[tuple[RecordingUpstream, RecordingUpstream]]:
    async with RecordingUpstream() as old, RecordingUpstream() as new:
        yield old, new


# ------------------------------------------------------------------------------ reload


@pytest.mark.parametrize("workers", [2, 1])
async def test_sighup_reloads_the_config_file_in_every_worker_and_refuses_an_invalid_one(
    tmp_path: Path,
    sqlite_url: str,
    upstreams: tuple[RecordingUpstream, RecordingUpstream],
    workers: int,
) -> None:
    old, new = upstreams
    path = config_file(tmp_path, old.url)
    gateway = GatewayProcess(
        path,
        env={"GATEWAY_DATABASE_URL": sqlite_url},
        extra_args=["--workers", str(workers)],
        log_dir=tmp_path,
    )

    def running_workers() -> set[int]:
        pids = worker_pids(gateway.pid)
        return pids if len(pids) == workers else set()

    async def new_config_served() -> bool:
        return await all_served_by(gateway, new)

    async with gateway:
        first = await eventually(running_workers, message=f"{workers} workers running")
        assert await all_served_by(gateway, old)

        config_file(tmp_path, new.url)
        os.kill(gateway.pid, signal.SIGHUP)

        await eventually(
            lambda: not first & worker_pids(gateway.pid),
            timeout=30.0,
            message="every worker replaced",
        )
        served: bool = await eventually(
            new_config_served, timeout=30.0, message="new config served"
        )
        assert served
        second = worker_pids(gateway.pid)
        assert len(second) == workers

        text = path.read_text()
        assert "drain_grace: 0ms" in text
        path.write_text(text.replace("drain_grace: 0ms", "drain_grace: soon"))
        os.kill(gateway.pid, signal.SIGHUP)

        await eventually(
            lambda: "config reload refused" in gateway.log_text(),
            message="the invalid config is refused",
        )
        refusal = next(
            line for line in gateway.log_text().splitlines() if "config reload refused" in line
        )
        assert "lifecycle.drain_grace" in refusal
        assert await all_served_by(gateway, new)
        assert worker_pids(gateway.pid) == second
    assert gateway.returncode == 0


# ------------------------------------------------------------------------------ health


@pytest.mark.parametrize("hung", ["first", "second"])
async def test_a_dead_worker_is_replaced_at_once_while_another_hangs(
    tmp_path: Path,
    sqlite_url: str,
    upstreams: tuple[RecordingUpstream, RecordingUpstream],
    hung: str,
) -> None:
    """The supervisor asks every worker at once: a hung worker (SIGSTOP) does not hold up the
    replacement of a dead one for its whole health timeout (30 s), in which nothing served.
    The supervisor asks its workers in the order they started, so a hung ``first`` is the case
    that held the other up."""
    upstream, _ = upstreams
    gateway = GatewayProcess(
        config_file(tmp_path, upstream.url),
        env={"GATEWAY_DATABASE_URL": sqlite_url},
        extra_args=["--workers", "2"],
        log_dir=tmp_path,
    )

    def two_workers() -> list[int] | None:
        pids = sorted(worker_pids(gateway.pid))
        return pids if len(pids) == 2 else None

    async with gateway:
        first, second = await eventually(two_workers, message="2 workers running")
        stopped, killed = (first, second) if hung == "first" else (second, first)
        os.kill(stopped, signal.SIGSTOP)
        try:
            # The first dies with the hung one; then its replacement dies too, while the
            # supervisor has long been waiting for the hung one's answer.
            dead = [killed]
            for _ in range(2):
                os.kill(dead[-1], signal.SIGKILL)

                async def served_by_a_replacement() -> set[int] | None:
                    replaced = worker_pids(gateway.pid) - {stopped, *dead}
                    served = replaced and await all_served_by(gateway, upstream)
                    return replaced if served else None

                (replacement,) = await eventually(
                    served_by_a_replacement, timeout=25.0, message="the dead worker replaced"
                )
                dead.append(replacement)
            # Still there: each dead worker was replaced before the hung one's timeout ran out.
            assert stopped in worker_pids(gateway.pid)
            for pid in dead[:2]:
                assert f"worker {pid} died; starting another" in gateway.log_text()
        finally:
            os.kill(stopped, signal.SIGCONT)
    assert gateway.returncode == 0


async def test_a_stopped_worker_holds_up_neither_a_reload_nor_a_shutdown(
    tmp_path: Path,
    sqlite_url: str,
    upstreams: tuple[RecordingUpstream, RecordingUpstream],
) -> None:
    """A reload and a shutdown each tell a worker to stop and wait for it to exit: a worker
    stopped with SIGSTOP held SIGTERM until continued, and the supervisor waited forever."""
    old, new = upstreams
    path = config_file(tmp_path, old.url)
    gateway = GatewayProcess(
        path,
        env={"GATEWAY_DATABASE_URL": sqlite_url},
        extra_args=["--workers", "2"],
        log_dir=tmp_path,
    )

    def two_workers() -> set[int] | None:
        pids = worker_pids(gateway.pid)
        return pids if len(pids) == 2 else None

    async def new_config_served() -> bool:
        return await all_served_by(gateway, new)

    await gateway.start()
    try:
        first = await eventually(two_workers, message="2 workers running")
        os.kill(min(first), signal.SIGSTOP)
        config_file(tmp_path, new.url)
        os.kill(gateway.pid, signal.SIGHUP)
        await eventually(
            lambda: not first & worker_pids(gateway.pid),
            timeout=25.0,  # within the stopped worker's health timeout (30 s)
            message="both workers replaced, the stopped one too",
        )
        assert await eventually(new_config_served, timeout=25.0, message="new config served")

        second = await eventually(two_workers, message="2 new workers running")
        os.kill(min(second), signal.SIGSTOP)
        gateway.terminate()
        assert await gateway.wait(timeout=25.0) == 0
    finally:
        await gateway.stop()


# ------------------------------------------------------------------------------- drain


async def test_sigterm_drains_then_finalizes_the_slow_request_and_exits_zero(
    tmp_path: Path, postgres_url: str, unique: Callable[[str], str]
) -> None:
    key = unique("drain")
    async with RecordingUpstream() as upstream:
        config = keyed_gateway_config(upstream.url, lifecycle={"drain_grace": "3s"})
        gateway = GatewayProcess(
            write_config(tmp_path, config.model_dump(mode="json")),
            env={"GATEWAY_DATABASE_URL": postgres_url},
            log_dir=tmp_path,
        )
        store = open_store(postgres_url, StoreConfig())

        async def draining() -> bool:
            return await all_ready_status(gateway, 503)

        try:
            async with httpx.AsyncClient(timeout=30.0, trust_env=False) as client:
                await gateway.start()
                assert (await client.get(gateway.admin_url + "/readyz")).status_code == 200
                slow = asyncio.create_task(
                    send_keyed(client, key, path=gateway.url + CHARGES, behavior="gate=slow")
                )
                await upstream.wait_arrived("slow")

                gateway.terminate()

                drained: bool = await eventually(draining, message="/readyz fails once draining")
                assert drained
                readiness = await fresh_get(gateway.admin_url + "/readyz")
                assert readiness.json() == {"status": "draining"}
                during_grace = await send_keyed(
                    client, unique("during-grace"), path=gateway.url + CHARGES
                )
                assert during_grace.status_code == 201
                assert gateway.running
                upstream.release("slow")
                answer = await slow

            assert answer.status_code == 201
            assert await gateway.wait(timeout=30.0) == 0
            log = gateway.log_text()
            assert "draining" in log
            assert "Traceback" not in log
            record = await store.get(record_key(key))
            assert record is not None
            assert record.status is Status.SUCCEEDED
            assert upstream.count(key) == 1
        finally:
            await gateway.stop()
            await store.close()
            print(f"--- gateway log tail ---\n{gateway.log_tail()}")


async def test_admin_drain_fails_readyz_in_every_worker_while_requests_are_served(
    tmp_path: Path, sqlite_url: str, upstreams: tuple[RecordingUpstream, RecordingUpstream]
) -> None:
    upstream, _ = upstreams
    gateway = GatewayProcess(
        config_file(tmp_path, upstream.url),
        env={"GATEWAY_DATABASE_URL": sqlite_url, "GATEWAY_ADMIN_TOKEN": TOKEN},
        extra_args=["--workers", "2"],
        log_dir=tmp_path,
    )
    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with gateway, httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        await eventually(lambda: len(worker_pids(gateway.pid)) == 2, message="2 workers")
        assert (await client.post(gateway.admin_url + "/admin/drain")).status_code == 401
        assert await all_ready_status(gateway, 200)

        started = await client.post(gateway.admin_url + "/admin/drain", headers=auth)
        assert started.status_code == 202
        assert await all_ready_status(gateway, 503)
        assert await all_served_by(gateway, upstream)
        assert gateway.running

        cancelled = await client.delete(gateway.admin_url + "/admin/drain", headers=auth)
        assert cancelled.status_code == 200
        assert await all_ready_status(gateway, 200)
