"""The ``idempotency-gateway`` command line does what contract section 10 promises.

``serve --upstream URL`` alone starts a protecting gateway on the embedded SQLite store in the
working directory; bad invocations and bad config files exit 2 naming the problem; ``migrate``
brings SQLite and PostgreSQL to the newest schema (and is safe to repeat); ``sweep`` deletes
expired records and says how many; ``demo`` serves the three behaviours its banner shows and
stops on a signal; the installed console script runs. Everything runs the real CLI, as a
subprocess wherever a server or an exit code is involved.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from alembic.script import ScriptDirectory

from idempotency_gateway.cli import main
from idempotency_gateway.config import StoreConfig
from idempotency_gateway.migrate import alembic_config
from idempotency_gateway.server.listeners import ListenError, bind_listeners, listening_socket
from idempotency_gateway.storage import open_store
from idempotency_gateway.storage.base import Claim
from idempotency_gateway.storage.records import RecordKey
from tests.support import GatewayProcess, RecordingUpstream, eventually, free_port, write_config
from tests.support.clock import ManualClock
from tests.support.problems import assert_problem
from tests.support.servers import PROJECT_ROOT

pytestmark = pytest.mark.slow

CLI = (sys.executable, "-m", "idempotency_gateway.cli")
EMBEDDED_DATABASE_FILE = "idempotency-gateway.db"
RECORDS_TABLE = "idempotency_records"


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No ``GATEWAY_*`` setting leaks in from the shell running the tests."""
    for name in list(os.environ):
        if name.startswith("GATEWAY_"):
            monkeypatch.delenv(name)


async def run_cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path = PROJECT_ROOT
) -> tuple[int, str]:
    """Run the real CLI to completion; return its exit code and its output (both streams)."""
    process = await asyncio.create_subprocess_exec(
        *CLI,
        *args,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, **(env or {})},
        cwd=cwd,
    )
    output, _ = await asyncio.wait_for(process.communicate(), 60.0)
    assert process.returncode is not None
    return process.returncode, output.decode()


def assert_refused_before_starting(
    code: int, output: str, cwd: Path, *, exit_code: int, says: Sequence[str]
) -> None:
    """Refused with ``exit_code``, a message holding each of ``says`` and no traceback, before
    anything started: no embedded database was created, nothing served."""
    assert code == exit_code, output
    for words in says:
        assert words in output
    assert "Traceback" not in output
    assert not (cwd / EMBEDDED_DATABASE_FILE).exists()


# ------------------------------------------------------------------------------- serve


class UpstreamOnlyGateway(GatewayProcess):
    """``serve --upstream URL`` with no config file, run in ``cwd``."""

    def __init__(self, upstream_url: str, *, cwd: Path) -> None:
        super().__init__(cwd / "no-config-file", cwd=cwd, log_dir=cwd, name="upstream-only")
        self.upstream_url = upstream_url

    @property
    def argv(self) -> list[str]:
        return [
            *self.command,
            "serve",
            "--upstream",
            self.upstream_url,
            *self.listen_args,
        ]


@pytest.mark.usefixtures("clean_environment")
async def test_serve_with_only_an_upstream_protects_requests_on_embedded_sqlite(
    tmp_path: Path,
) -> None:
    async with (
        RecordingUpstream() as upstream,
        UpstreamOnlyGateway(upstream.url, cwd=tmp_path) as gateway,
        httpx.AsyncClient(base_url=gateway.url, timeout=10.0) as client,
    ):
        unprotected = await client.get("/v1/things")
        assert unprotected.status_code == 201
        assert upstream.executions[-1].path == "/v1/things"

        headers = {"Idempotency-Key": "cli-serve-1"}
        first = await client.post("/v1/orders", json={"amount": 5}, headers=headers)
        replay = await client.post("/v1/orders", json={"amount": 5}, headers=headers)

    assert first.status_code == 201
    assert "Idempotent-Replayed" not in first.headers
    assert replay.status_code == 201
    assert replay.headers["Idempotent-Replayed"] == "true"
    assert replay.content == first.content
    assert upstream.count("cli-serve-1") == 1
    assert (tmp_path / EMBEDDED_DATABASE_FILE).is_file()


@pytest.mark.usefixtures("clean_environment")
@pytest.mark.parametrize(
    ("args", "expected"),
    [
        pytest.param(["serve"], ["--upstream", "--config"], id="neither"),
        pytest.param(
            ["serve", "--config", "gateway.yaml", "--upstream", "http://127.0.0.1:9"],
            ["--upstream", "--config", "not both"],
            id="both",
        ),
    ],
)
def test_serve_needs_exactly_one_of_config_and_upstream(
    args: list[str], expected: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(args) == 2
    error = capsys.readouterr().err
    for option in expected:
        assert option in error


@pytest.mark.usefixtures("clean_environment")
@pytest.mark.parametrize("command", [("serve", "--upstream", "http://127.0.0.1:9"), ("migrate",)])
@pytest.mark.parametrize(
    ("variable", "value"),
    [
        ("GATEWAY_DATABASE_URL", "mysql://gateway@db.internal/gateway"),
        ("GATEWAY_DATABASE_URL", "127.0.0.1:5432"),
        ("GATEWAY_REDIS_URL", "http://127.0.0.1:6379"),
        ("GATEWAY_ADMIN_PORT", "abc"),
        ("GATEWAY_ADMIN_PORT", "70000"),
    ],
)
async def test_a_bad_environment_value_exits_2_naming_the_variable(
    command: tuple[str, ...], variable: str, value: str, tmp_path: Path
) -> None:
    code, output = await run_cli(*command, env={variable: value}, cwd=tmp_path)

    assert_refused_before_starting(code, output, tmp_path, exit_code=2, says=[f"{variable}: "])


@pytest.mark.usefixtures("clean_environment")
@pytest.mark.parametrize("admin_port_from", ["option", "environment"])
async def test_one_port_for_the_proxy_and_the_admin_api_exits_2(
    admin_port_from: str, tmp_path: Path
) -> None:
    port = str(free_port())
    args = ["serve", "--upstream", "http://127.0.0.1:9", "--port", port]
    env = {}
    if admin_port_from == "option":
        args += ["--admin-port", port]
    else:
        env["GATEWAY_ADMIN_PORT"] = port
    code, output = await run_cli(*args, env=env, cwd=tmp_path)

    both = f"the admin port and the proxy port are both {port}"
    assert_refused_before_starting(code, output, tmp_path, exit_code=2, says=[both])


@pytest.mark.usefixtures("clean_environment")
@pytest.mark.parametrize(
    ("args", "option"),
    [
        pytest.param(["--port", "70000"], "--port", id="port-above-65535"),
        pytest.param(["--admin-port", "65536"], "--admin-port", id="admin-port-above-65535"),
        pytest.param(["--port", "-1"], "--port", id="negative-port"),
        pytest.param(["--admin-port", "http"], "--admin-port", id="port-not-a-number"),
        pytest.param(["--port", "8_080"], "--port", id="port-with-underscore"),
        pytest.param(["--port", "\u0668\u0660\u0668\u0660"], "--port", id="port-in-other-digits"),
        pytest.param(["--workers", "0"], "--workers", id="no-workers"),
        pytest.param(["--workers", "-2"], "--workers", id="negative-workers"),
    ],
)
async def test_a_flag_out_of_its_range_exits_2_naming_it_before_anything_starts(
    args: list[str], option: str, tmp_path: Path
) -> None:
    code, output = await run_cli("serve", "--upstream", "http://127.0.0.1:9", *args, cwd=tmp_path)

    refusal = f"argument {option}: {args[1]!r} is not"
    assert_refused_before_starting(code, output, tmp_path, exit_code=2, says=[refusal])


@pytest.mark.usefixtures("clean_environment")
@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["demo", "--port", "0"], id="demo-port-0"),
        pytest.param(["demo", "--upstream-port", "99999"], id="demo-upstream-port"),
        pytest.param(["sweep", "--batch-size", "0"], id="sweep-batch-0"),
    ],
)
def test_other_commands_refuse_numbers_they_cannot_use(
    args: list[str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.chdir(tmp_path)  # were it accepted, nothing lands in the project's directory
    # A demo on port 0 would print commands for a port nobody knows; a sweep in batches of
    # none would loop forever deleting nothing.
    with pytest.raises(SystemExit) as exited:
        main(args)
    assert exited.value.code == 2
    assert f"argument {args[1]}: " in capsys.readouterr().err


@pytest.mark.usefixtures("clean_environment")
@pytest.mark.parametrize("taken", ["proxy", "admin"])
async def test_a_port_in_use_exits_1_naming_it_and_creates_nothing(
    taken: str, tmp_path: Path
) -> None:
    port, admin_port = free_port(), free_port()
    busy = port if taken == "proxy" else admin_port
    holder = socket.socket()
    holder.bind(("127.0.0.1", busy))
    holder.listen()
    try:
        code, output = await run_cli(
            "serve",
            "--upstream",
            "http://127.0.0.1:9",
            *("--port", str(port), "--admin-port", str(admin_port)),
            cwd=tmp_path,
        )
    finally:
        holder.close()

    refusal = f"error: cannot listen on 127.0.0.1:{busy}: Address already in use"
    assert_refused_before_starting(code, output, tmp_path, exit_code=1, says=[refusal])


@pytest.mark.usefixtures("clean_environment")
async def test_the_demo_on_a_port_in_use_exits_1_naming_it_and_creates_nothing(
    tmp_path: Path,
) -> None:
    port = free_port()
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", port))
        holder.listen()
        code, output = await run_cli("demo", "--upstream-port", str(port), cwd=tmp_path)

    refusal = f"error: cannot listen on 127.0.0.1:{port}: Address already in use"
    assert_refused_before_starting(code, output, tmp_path, exit_code=1, says=[refusal])


@pytest.mark.usefixtures("clean_environment")
async def test_the_demo_on_one_port_for_both_servers_exits_2(tmp_path: Path) -> None:
    port = str(free_port())
    code, output = await run_cli("demo", "--port", port, "--upstream-port", port, cwd=tmp_path)

    both = f"the demo and its payments API are both on {port}"
    assert_refused_before_starting(code, output, tmp_path, exit_code=2, says=[both])


def test_a_listener_holds_its_port_from_the_moment_it_is_made() -> None:
    """Listening at once, not only bound: a second process binding the port the same way
    (SO_REUSEADDR) is refused, where two bound sockets that do not yet listen may share it
    and two gateways started together would both have said they started."""
    listeners = bind_listeners("127.0.0.1", 0, 0)
    try:
        for port in (listeners.port, listeners.admin_port):
            with pytest.raises(ListenError, match=f"127.0.0.1:{port}: Address already in use"):
                listening_socket("127.0.0.1", port)
            with socket.socket() as rival:
                rival.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                with pytest.raises(OSError, match="Address already in use"):
                    rival.bind(("127.0.0.1", port))
    finally:
        listeners.proxy.close()
        listeners.admin.close()


class PickedPortsGateway(UpstreamOnlyGateway):
    """``serve --port 0 --admin-port 0``: the system picks both ports and the JSON startup
    line names them."""

    @property
    def listen_args(self) -> list[str]:
        return ["--host", self.host, "--port", "0", "--admin-port", "0", "--log-format", "json"]

    async def _wait_until_listening(self) -> None:
        startup = await eventually(self._startup_line, timeout=self.startup_timeout)
        self.port, self.admin_port = startup["port"], startup["admin_port"]
        await super()._wait_until_listening()

    def _startup_line(self) -> dict[str, Any] | None:
        for line in self.log_text().splitlines():
            if '"idempotency_gateway.startup"' in line:
                parsed: dict[str, Any] = json.loads(line)
                return parsed
        return None


@pytest.mark.usefixtures("clean_environment")
async def test_ports_the_system_picks_are_named_and_keep_the_admin_api_apart(
    tmp_path: Path,
) -> None:
    async with (
        RecordingUpstream() as upstream,
        PickedPortsGateway(upstream.url, cwd=tmp_path) as gateway,
        httpx.AsyncClient(timeout=10.0) as client,
    ):
        assert 0 not in (gateway.port, gateway.admin_port)
        assert gateway.port != gateway.admin_port
        health = await client.get(gateway.admin_url + "/healthz")
        proxied = await client.get(gateway.url + "/healthz")
        metrics = await client.get(gateway.admin_url + "/metrics")

    # The admin port answers as the admin API; before, a worker compared connections with
    # the port asked for (0), so every admin request went to the upstream instead.
    assert health.status_code == 200
    assert health.json()["status"] == "ok"
    assert metrics.status_code == 200
    assert "idempotency_gateway" in metrics.text
    assert proxied.status_code == 201
    assert [execution.path for execution in upstream.executions] == ["/healthz"]


@pytest.mark.usefixtures("clean_environment")
async def test_serve_with_a_bad_config_file_exits_2_naming_the_field(tmp_path: Path) -> None:
    bad = write_config(
        tmp_path,
        {
            "upstreams": {"payments": {"url": "http://127.0.0.1:9000"}},
            "routes": [
                {
                    "name": "charges",
                    "match": {"path_prefix": "/v1/charges"},
                    "upstream": "payments",
                    "idempotency": {"on_ambiguous": "sometimes"},
                }
            ],
        },
        name="bad.yaml",
    )

    code, output = await run_cli("serve", "--config", str(bad), cwd=tmp_path)

    assert_refused_before_starting(
        code, output, tmp_path, exit_code=2, says=["bad.yaml", "routes.0.idempotency.on_ambiguous"]
    )


@pytest.mark.usefixtures("clean_environment")
@pytest.mark.parametrize("token", ["", "fifteen-chars-x"])
async def test_serve_with_an_empty_or_short_admin_token_exits_2_naming_it(
    tmp_path: Path, token: str
) -> None:
    code, output = await run_cli(
        "serve",
        "--upstream",
        "http://127.0.0.1:9",
        env={"GATEWAY_ADMIN_TOKEN": token},
        cwd=tmp_path,
    )

    assert_refused_before_starting(
        code, output, tmp_path, exit_code=2, says=["GATEWAY_ADMIN_TOKEN", "16 characters"]
    )


# ----------------------------------------------------------------------------- migrate


def schema_revision(database_url: str) -> str | None:
    """The Alembic revision the database is at (None before the first migration)."""

    async def read() -> str | None:
        store = open_store(database_url, StoreConfig())
        try:
            return await store.schema_revision()
        finally:
            await store.close()

    return asyncio.run(read())


def head_revision(database_url: str) -> str:
    head = ScriptDirectory.from_config(alembic_config(database_url)).get_current_head()
    assert head is not None
    return head


def migrate_with(
    database_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> str:
    monkeypatch.setenv("GATEWAY_DATABASE_URL", database_url)
    assert main(["migrate"]) == 0
    return capsys.readouterr().out


@pytest.mark.usefixtures("clean_environment")
def test_migrate_creates_the_table_in_a_new_sqlite_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "fresh.db"
    url = f"sqlite:///{path}"

    output = migrate_with(url, monkeypatch, capsys)

    assert "newest migration" in output
    with sqlite3.connect(path) as connection:
        tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master")}
    assert RECORDS_TABLE in tables
    assert schema_revision(url) == head_revision(url)


@pytest.mark.usefixtures("clean_environment")
def test_migrate_on_postgresql_can_run_again(
    postgres_url: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for _ in range(2):
        output = migrate_with(postgres_url, monkeypatch, capsys)
        assert "newest migration" in output
        # The report names the host and database, never the credentials before the @.
        assert "postgres@" not in output
    assert schema_revision(postgres_url) == head_revision(postgres_url)


# ------------------------------------------------------------------------------- sweep


async def test_sweep_deletes_expired_records_and_says_how_many(
    sqlite_url: str, clock: ManualClock
) -> None:
    store = open_store(sqlite_url, StoreConfig(), clock=clock.utc)
    expired = RecordKey("anonymous", "POST /v1/orders", "expired-order")
    live = RecordKey("anonymous", "POST /v1/orders", "live-order")
    try:
        clock.now = datetime.now(UTC) - timedelta(days=2)
        await store.reserve(expired, Claim("a" * 64, "a" * 32, lease=30.0, ttl=3600.0))
        clock.now = datetime.now(UTC)
        await store.reserve(live, Claim("b" * 64, "b" * 32, lease=30.0, ttl=86400.0))

        code, output = await run_cli("sweep", env={"GATEWAY_DATABASE_URL": sqlite_url})

        assert code == 0, output
        assert "deleted 1 expired records" in output
        assert await store.get(expired) is None
        assert await store.get(live) is not None
    finally:
        await store.close()


# -------------------------------------------------------------------------------- demo


class DemoProcess:
    """``idempotency-gateway demo`` in ``cwd``, its output in a file the test can read."""

    def __init__(self, cwd: Path) -> None:
        self.cwd = cwd
        self.port = free_port()
        self.upstream_port = free_port()
        self.output_path = cwd / "demo.out"
        self.process: asyncio.subprocess.Process | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.output_path.read_text(encoding="utf-8", errors="replace")

    async def start(self, argv: Sequence[str]) -> None:
        with self.output_path.open("wb") as output:
            self.process = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=output,
                stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                cwd=self.cwd,
            )
        await eventually(
            lambda: self._exited_early() or "Press Ctrl-C" in self.output(),
            timeout=20.0,
            message="the demo prints its curl lines",
        )

    def _exited_early(self) -> bool:
        assert self.process is not None
        if self.process.returncode is not None:
            raise AssertionError(f"demo exited early:\n{self.output()}")
        return False

    async def stop(self, sig: signal.Signals) -> int:
        assert self.process is not None
        if self.process.returncode is None:
            self.process.send_signal(sig)
        try:
            return await asyncio.wait_for(self.process.wait(), 15.0)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()
            raise AssertionError(f"demo did not exit on {sig.name}:\n{self.output()}") from None


@pytest.fixture
async def demo(tmp_path: Path) -> AsyncIterator[DemoProcess]:
    process = DemoProcess(tmp_path)
    await process.start(
        [*CLI, "demo", "--port", str(process.port), "--upstream-port", str(process.upstream_port)]
    )
    try:
        yield process
    finally:
        await process.stop(signal.SIGKILL)


DEMO_HEADERS = {"Authorization": "Bearer sk_demo"}
SLOW = {"X-Demo-Delay": "3"}


async def test_demo_shows_replay_mismatch_and_in_flight_conflict(demo: DemoProcess) -> None:
    output = demo.output()
    assert f"curl -si {demo.url}/v1/charges" in output
    assert "Idempotency-Key: order-1" in output

    async with httpx.AsyncClient(base_url=demo.url, headers=DEMO_HEADERS, timeout=20.0) as client:

        async def charge(key: str, amount: int, **headers: str) -> httpx.Response:
            return await client.post(
                "/v1/charges",
                json={"amount": amount, "currency": "usd"},
                headers={"Idempotency-Key": key, **headers},
            )

        async def executions() -> int:
            return int((await client.get("/v1/stats")).json()["executions"])

        # 1. The very same request twice: replayed, executed once.
        first = await charge("order-1", 1000)
        replay = await charge("order-1", 1000)
        assert first.status_code == 201
        assert replay.status_code == 201
        assert replay.headers["Idempotent-Replayed"] == "true"
        assert replay.json() == first.json()
        assert await executions() == 1

        # 2. The key reused for a different request: 422, nothing executed.
        mismatch = await charge("order-1", 9999)
        assert_problem(mismatch, 422, "idempotency-key-reused")
        assert await executions() == 1

        # 3. A duplicate while the first still runs: 409, then the replay once it is done.
        async def slow_charge_is_running() -> bool:
            return await executions() == 2

        slow = asyncio.create_task(charge("order-2", 500, **SLOW))
        await eventually(slow_charge_is_running, timeout=10.0, interval=0.05)
        conflict = await charge("order-2", 500, **SLOW)
        assert conflict.status_code == 409
        assert conflict.headers["Retry-After"]
        slow_answer = await slow
        assert slow_answer.status_code == 201
        # Not a 409 forever: once the first is done, the duplicate gets its answer.
        after = await charge("order-2", 500, **SLOW)
        assert after.status_code == 201
        assert after.headers["Idempotent-Replayed"] == "true"
        assert after.json() == slow_answer.json()
        assert await executions() == 2

    assert (demo.cwd / EMBEDDED_DATABASE_FILE).is_file()


@pytest.mark.parametrize("stop_signal", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
async def test_demo_stops_cleanly_on_a_signal(
    demo: DemoProcess, stop_signal: signal.Signals
) -> None:
    code = await demo.stop(stop_signal)

    # Exit 0, or death by the same signal (uvicorn re-raises it after a graceful shutdown).
    assert code in (0, -stop_signal)
    assert "Traceback" not in demo.output()


# ------------------------------------------------------------------------ console script


def test_console_script_is_installed_and_runs() -> None:
    script = shutil.which("idempotency-gateway", path=str(Path(sys.executable).parent))
    assert script is not None, f"no idempotency-gateway next to {sys.executable}"

    result = subprocess.run(
        [script, "--help"], capture_output=True, text=True, timeout=30, check=False
    )

    assert result.returncode == 0, result.stderr
    for command in ("serve", "demo", "migrate", "sweep", "check-config"):
        assert command in result.stdout
