"""Serving things for tests: any ASGI app in the current loop, or the real gateway CLI process."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Generator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, Literal, Protocol

import uvicorn
import yaml

from benchmarks.processes import free_port
from idempotency_gateway.idempotency.scope_secret import SCOPE_SECRET_ENV
from tests.support.lifecycle import StartedInContext

LOOPBACK = "127.0.0.1"
# The GATEWAY_SCOPE_SECRET of every gateway the tests start (in process or not).
TEST_SCOPE_SECRET = "test-scope-secret"
PROJECT_ROOT = Path(__file__).resolve().parents[2]

LifespanMode = Literal["auto", "on", "off"]


def write_config(tmp_path: Path, data: Mapping[str, Any], name: str = "gateway.yaml") -> Path:
    """Dump ``data`` as YAML to ``tmp_path / name`` (default ``gateway.yaml``); return the path."""
    path = Path(tmp_path) / name
    path.write_text(yaml.safe_dump(dict(data), sort_keys=False), encoding="utf-8")
    return path


# --------------------------------------------------------------------------- in-loop ASGI


class _InLoopServer(uvicorn.Server):
    """A uvicorn server that leaves the process's signal handlers alone (pytest owns them)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield


async def _serve(server: uvicorn.Server, sock: socket.socket) -> None:
    try:
        await server.serve(sockets=[sock])
    except SystemExit as exc:
        # uvicorn calls sys.exit() when lifespan startup fails; never let that reach the loop.
        raise RuntimeError(f"ASGI server failed to start (exit code {exc.code})") from None


@contextlib.asynccontextmanager
async def serve_asgi(
    app: Any,
    *,
    lifespan: LifespanMode = "on",
    startup_timeout: float = 10.0,
    graceful_timeout: float = 5.0,
    **config: Any,
) -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn in the running loop on ``127.0.0.1:<ephemeral>``.

    Yields the base URL (``http://127.0.0.1:PORT``) once the server has started (lifespan
    startup included). On exit the server drains: it stops accepting, waits up to
    ``graceful_timeout`` seconds for in-flight requests, runs lifespan shutdown, and the serve
    task is awaited. Extra keyword arguments go to ``uvicorn.Config``.
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((LOOPBACK, 0))
        port = int(sock.getsockname()[1])
        options: dict[str, Any] = {
            "lifespan": lifespan,
            "log_level": "warning",
            "log_config": None,
            "access_log": False,
            "loop": "none",
            "ws": "none",
            "timeout_graceful_shutdown": graceful_timeout,
        }
        options.update(config)
        server = _InLoopServer(uvicorn.Config(app, **options))
        task = asyncio.create_task(_serve(server, sock), name=f"uvicorn:{port}")
        try:
            loop = asyncio.get_running_loop()
            deadline = loop.time() + startup_timeout
            while not server.started:
                if task.done():
                    task.result()  # raises the startup failure
                    raise RuntimeError("ASGI server exited before it started")
                if loop.time() >= deadline:
                    raise TimeoutError(f"ASGI server did not start within {startup_timeout}s")
                await asyncio.sleep(0.01)
            yield f"http://{LOOPBACK}:{port}"
        finally:
            server.should_exit = True
            if not task.done():
                try:
                    await asyncio.wait_for(asyncio.shield(task), graceful_timeout + 5.0)
                except TimeoutError:
                    server.force_exit = True
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
            elif not task.cancelled():
                task.exception()  # retrieved; a startup failure was already raised above
    finally:
        sock.close()


# ----------------------------------------------------------------------- gateway process


class GatewayProcess(StartedInContext):
    """The real gateway CLI in a subprocess, listening on ``127.0.0.1:<free port>``.

    Runs ``python -m idempotency_gateway.cli serve --config CONFIG --host 127.0.0.1
    --port PORT *extra_args`` with ``os.environ`` plus ``env``; stdout and stderr go to
    ``log_dir/<name>.log``. The child gets its own session (process group) so
    SIGSTOP/SIGCONT/SIGKILL also reach any workers.
    """

    def __init__(
        self,
        config_path: Path | str,
        *,
        env: Mapping[str, str] | None = None,
        extra_args: Sequence[str] = (),
        log_dir: Path | str | None = None,
        port: int | None = None,
        host: str = LOOPBACK,
        name: str = "gateway",
        # Generous: a loaded machine (CI, a test run beside others) can take tens of seconds
        # to import and start a worker; a gateway that starts sooner costs nothing extra.
        startup_timeout: float = 60.0,
        command: Sequence[str] | None = None,
        cwd: Path | str | None = None,
    ) -> None:
        self.config_path = Path(config_path)
        # Gateways on a shared database refuse to start without one.
        self.env = {SCOPE_SECRET_ENV: TEST_SCOPE_SECRET, **(env or {})}
        self.extra_args = list(extra_args)
        self.host = host
        self.port = port if port is not None else free_port(host)
        # Every gateway also listens on an admin port; each test process needs its own.
        self.admin_port = free_port(host)
        self.name = name
        self.startup_timeout = startup_timeout
        self.command = (
            list(command) if command else [sys.executable, "-m", "idempotency_gateway.cli"]
        )
        self.cwd = Path(cwd) if cwd is not None else PROJECT_ROOT
        base = Path(log_dir) if log_dir is not None else self.config_path.parent
        self.log_path = base / f"{name}-{self.port}.log"
        self._proc: asyncio.subprocess.Process | None = None
        self._log: IO[bytes] | None = None
        self._paused = False

    # ---------------------------------------------------------------- properties

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.host}:{self.admin_port}"

    @property
    def listen_args(self) -> list[str]:
        """Where ``serve`` listens: the host, port and admin port this object chose."""
        return ["--host", self.host, "--port", str(self.port), "--admin-port", str(self.admin_port)]

    @property
    def argv(self) -> list[str]:
        return [
            *self.command,
            "serve",
            "--config",
            str(self.config_path),
            *self.listen_args,
            *self.extra_args,
        ]

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("process not started")
        return self._proc.pid

    @property
    def returncode(self) -> int | None:
        return None if self._proc is None else self._proc.returncode

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.returncode is None

    @property
    def paused(self) -> bool:
        return self._paused

    def log_text(self) -> str:
        if self._log is not None:
            self._log.flush()
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Launch the process and wait (up to ``startup_timeout``) until its port accepts."""
        if self._proc is not None:
            raise RuntimeError("process already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        environment = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env}
        self._proc = await asyncio.create_subprocess_exec(
            *self.argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self._log,
            stderr=asyncio.subprocess.STDOUT,
            env=environment,
            cwd=str(self.cwd),
            start_new_session=True,
        )
        try:
            await self._wait_until_listening()
        except BaseException:
            await self.kill()
            raise

    async def _wait_until_listening(self) -> None:
        assert self._proc is not None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.startup_timeout
        while True:
            if self._proc.returncode is not None:
                raise RuntimeError(
                    f"{self.name} exited with code {self._proc.returncode} before listening "
                    f"on {self.url}; log tail:\n{self.log_tail()}"
                )
            try:
                _, writer = await asyncio.wait_for(
                    asyncio.open_connection(self.host, self.port), timeout=1.0
                )
            except (OSError, TimeoutError):
                pass
            else:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
                return
            if loop.time() >= deadline:
                raise TimeoutError(
                    f"{self.name} did not listen on {self.url} within {self.startup_timeout}s; "
                    f"log tail:\n{self.log_tail()}"
                )
            await asyncio.sleep(0.05)

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self._proc is not None
        if self._proc.returncode is not None:
            return  # reaped: its id may be reused, so never signal it again
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self._proc.pid, sig)

    def pause(self) -> None:
        """SIGSTOP the process (group): it keeps its sockets but does nothing."""
        if not self.running:
            raise RuntimeError("process is not running")
        self._signal_group(signal.SIGSTOP)
        self._paused = True

    def resume(self) -> None:
        """SIGCONT a paused process (group)."""
        if self._proc is None:
            raise RuntimeError("process not started")
        self._signal_group(signal.SIGCONT)
        self._paused = False

    def terminate(self) -> None:
        """Send SIGTERM (graceful shutdown) without waiting; a paused process is resumed."""
        if not self.running:
            return
        assert self._proc is not None
        with contextlib.suppress(ProcessLookupError):
            self._proc.send_signal(signal.SIGTERM)
        if self._paused:
            self.resume()

    async def wait(self, timeout: float = 20.0) -> int:  # noqa: ASYNC109
        """Wait for the process to exit; return its code (raises ``TimeoutError``)."""
        if self._proc is None:
            raise RuntimeError("process not started")
        code = await asyncio.wait_for(self._proc.wait(), timeout)
        self._close_log()
        return code

    async def stop(self, timeout: float = 15.0) -> int | None:  # noqa: ASYNC109
        """SIGTERM, wait up to ``timeout`` seconds, then SIGKILL. Returns the exit code."""
        if self._proc is None:
            return None
        if self._proc.returncode is None:
            self.terminate()
            try:
                return await self.wait(timeout)
            except TimeoutError:
                pass
        return await self.kill()

    async def kill(self) -> int | None:
        """SIGKILL the process group and reap the process. Returns the exit code."""
        if self._proc is None:
            return None
        self._signal_group(signal.SIGKILL)
        self._paused = False
        code = await self._proc.wait()
        self._close_log()
        return code

    def _close_log(self) -> None:
        log, self._log = self._log, None
        if log is not None:
            log.close()

    async def close(self) -> None:
        """Leaving ``async with``: a graceful ``stop()`` (SIGTERM, then SIGKILL if it hangs)."""
        await self.stop()


class StartGatewayProcess(Protocol):
    """The ``start_gateway_process`` fixture (tests/conftest.py): ``serve`` on ``config`` (the
    dict a YAML file would hold) with ``env`` and ``extra_args``; stopped when the test ends,
    its log tail printed (pytest shows it when the test fails)."""

    async def __call__(
        self, config: dict[str, Any], *, env: dict[str, str], extra_args: Sequence[str] = ()
    ) -> GatewayProcess: ...
