"""The README's library example served as users serve a FastAPI app (contract section 1).

Every way below imports the app module inside a server that already runs an event loop, and
several of them import it in two processes at once on a database nobody migrated yet:
``uvicorn --workers 2``, ``uvicorn --reload`` (what ``fastapi dev`` runs) and gunicorn with
uvicorn workers, each on a fresh SQLite file and a fresh PostgreSQL database. The example must
migrate once, serve, and replay a retried charge.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import httpx
import pytest

from benchmarks.processes import free_port
from tests.support.readme import python_example
from tests.support.servers import LOOPBACK
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow

CHARGE = {"amount": 1250, "currency": "eur"}
_START_TIMEOUT = 60.0

SERVERS: dict[str, list[str]] = {
    "uvicorn --workers 2": ["-m", "uvicorn", "example:api", "--workers", "2"],
    "uvicorn --reload": ["-m", "uvicorn", "example:api", "--reload"],
    "gunicorn with uvicorn workers": [
        "-m",
        "gunicorn",
        "example:api",
        "--workers",
        "2",
        "--worker-class",
        "uvicorn_worker.UvicornWorker",
    ],
}


def _listen_args(server: str, port: int) -> list[str]:
    if server.startswith("gunicorn"):
        return ["--bind", f"{LOOPBACK}:{port}"]
    return ["--host", LOOPBACK, "--port", str(port)]


@pytest.fixture(params=["sqlite", "postgresql"])
def fresh_database(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A database nobody migrated: a new SQLite file, or a new PostgreSQL database."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'idempotency.db'}"
    url: str = request.getfixturevalue("empty_postgres_database")
    return url


@contextlib.asynccontextmanager
async def served(
    app_dir: Path, argv: Sequence[str], env: dict[str, str]
) -> AsyncIterator[asyncio.subprocess.Process]:
    log = (app_dir / "server.log").open("wb")
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        *argv,
        cwd=app_dir,
        env={**os.environ, **env},
        stdout=log,
        stderr=asyncio.subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 20)
        except TimeoutError:
            os.killpg(process.pid, signal.SIGKILL)
            await process.wait()
        log.close()


async def _charge(client: httpx.AsyncClient, key: str) -> httpx.Response | None:
    try:
        return await client.post("/v1/charges", json=CHARGE, headers={"Idempotency-Key": key})
    except httpx.TransportError:
        return None  # not listening yet


@pytest.mark.multiprocess
@pytest.mark.parametrize("server", list(SERVERS))
async def test_the_readme_example_migrates_once_and_serves(
    server: str, fresh_database: str, tmp_path: Path
) -> None:
    (tmp_path / "example.py").write_text(python_example("## Using it as a library"))
    port = free_port()
    key = f"served-{uuid.uuid4().hex}"
    argv = [*SERVERS[server], *_listen_args(server, port)]
    async with (
        served(tmp_path, argv, {"DATABASE_URL": fresh_database}) as process,
        # A request may reach a listening socket before a worker is up to answer it (gunicorn
        # listens in its master): it waits rather than being abandoned and retried as a 409.
        httpx.AsyncClient(
            base_url=f"http://{LOOPBACK}:{port}", timeout=_START_TIMEOUT, trust_env=False
        ) as client,
    ):
        first = await eventually(lambda: _charge(client, key), timeout=_START_TIMEOUT)
        retry = await _charge(client, key)
        still_running = process.returncode is None
    log = (tmp_path / "server.log").read_text(errors="replace")
    assert still_running, log
    assert first.status_code == 200, log
    assert retry is not None
    assert retry.status_code == 200
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.content == first.content
    assert "Traceback" not in log, log
