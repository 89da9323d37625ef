"""Running the gateway under uvicorn: the proxy and admin listeners in every worker.

uvicorn's ``run`` binds one socket. The gateway needs two, so it binds both itself and hands
them to a supervisor process that runs the workers (one, or ``--workers N``): every worker
accepts on both, and one lifespan starts everything a worker needs. One worker gets a
supervisor too, so that SIGHUP can replace it while the supervisor keeps the sockets open.

The supervisor is uvicorn's, plus what a fleet needs from it:

* SIGHUP re-reads and validates the config file. An invalid one is refused (logged, field by
  field) and the workers keep running the old one; a valid one reaches every worker through a
  rolling restart: each new worker starts before the one it replaces is stopped.
* SIGTERM drains: ``/readyz`` fails in every worker at once while they keep serving, for
  ``lifecycle.drain_grace``; then the workers stop as uvicorn stops them (listeners close,
  in-flight requests finish, executions finalize) and the process exits 0.
* SIGINT (Ctrl-C) stops at once, without the grace.
* On every turn of its loop (every half second) every worker is asked whether it lives,
  without waiting for the answers: one that exited is replaced at once, one that leaves a
  ping unanswered for ``WORKER_HEALTHCHECK_SECONDS`` (stopped, or stuck holding the
  interpreter) is killed and replaced, and signals are handled meanwhile. A stopped worker
  is continued before a reload or a shutdown tells it to stop.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable

import uvicorn
from uvicorn.config import STARTUP_FAILURE
from uvicorn.supervisors import Multiprocess
from uvicorn.supervisors.multiprocess import Process

from idempotency_gateway.config import ConfigError, GatewayConfig, LimitsConfig
from idempotency_gateway.drain import DrainState
from idempotency_gateway.main import RESOLVED_CONFIG_ENV
from idempotency_gateway.server.listeners import BACKLOG, Listeners
from idempotency_gateway.server.protocol import EdgeServerConfig
from idempotency_gateway.server.worker_health import WorkerHealth
from idempotency_gateway.telemetry.logs import LogFormat, uvicorn_log_config
from idempotency_gateway.telemetry.multiprocess import dead_worker_reaper

log = logging.getLogger("idempotency_gateway.serve")

GATEWAY_FACTORY = "idempotency_gateway.main:gateway_from_environment"
# Long enough for in-flight executions to finish and finalize after SIGTERM.
GRACEFUL_SHUTDOWN_SECONDS = 30
# How long the supervisor waits for a worker to answer its health check before it kills and
# replaces it. uvicorn's 5 s kills workers that are merely starved of CPU (a busy host, a
# worker still importing at start), and each replacement starts the slow import again.
WORKER_HEALTHCHECK_SECONDS = 30


class GatewaySupervisor(Multiprocess):
    def __init__(
        self,
        config: uvicorn.Config,
        sockets: list[socket.socket],
        *,
        gateway_config: GatewayConfig,
        reload_config: Callable[[], GatewayConfig],
        drain: DrainState,
    ) -> None:
        super().__init__(config, sockets)
        self.gateway_config = gateway_config
        self._reload_config = reload_config
        self._drain = drain
        self._drain_ends: float | None = None
        self._reaper = dead_worker_reaper()
        self._health: WorkerHealth[Process] = WorkerHealth(
            timeout=config.timeout_worker_healthcheck
        )
        os.environ[RESOLVED_CONFIG_ENV] = gateway_config.model_dump_json()

    def handle_hup(self) -> None:
        try:
            new_config = self._reload_config()
        except ConfigError as exc:
            log.error(
                "config reload refused, the workers keep the running config: "
                "invalid configuration in %s: %s",
                exc.source,
                "; ".join(exc.errors),
            )
            return
        self.gateway_config = new_config
        # Workers are spawned with this process's environment: the new ones read it there.
        os.environ[RESOLVED_CONFIG_ENV] = new_config.model_dump_json()
        log.info("config reloaded; replacing the workers one at a time")
        before = set(self.processes)
        self._continue_stopped_workers()
        super().handle_hup()
        if self._reaper is not None:
            self._reaper.watch(process.pid for process in self.processes)
        if before & set(self.processes):
            log.error("config reload incomplete: a new worker did not start; see above")

    def handle_term(self) -> None:
        if self._drain_ends is not None:
            return  # a second SIGTERM (an impatient orchestrator) must not cut the grace short
        grace = self.gateway_config.lifecycle.drain_grace
        self._drain.start()
        self._drain_ends = time.monotonic() + grace
        log.info("SIGTERM: draining; /readyz fails, requests are still served for %gs", grace)

    def handle_signals(self) -> None:
        super().handle_signals()
        if self._drain_ends is not None and time.monotonic() >= self._drain_ends:
            log.info("drain grace over; stopping the workers")
            self.should_exit.set()

    def keep_subprocess_alive(self) -> None:
        # Replaces uvicorn's, which asks one worker after another and waits for each: see
        # ``server.worker_health``. This turn never waits.
        if self.should_exit.is_set():
            return
        for process, exited in self._health.failing(self.processes):
            if not self._replace(process, exited=exited):
                return
        if self._reaper is not None:
            self._reaper.watch(process.pid for process in self.processes)
            self._reaper.reap()

    def _replace(self, process: Process, *, exited: bool) -> bool:
        """A new worker in ``process``'s place; ``False`` when the supervisor is to stop."""
        process.kill()
        process.join()
        if process.exitcode == STARTUP_FAILURE:
            # It failed before serving: the app, the config or the sockets would fail the
            # same way in every replacement.
            log.error("worker %s failed to start; stopping", process.pid)
            self.should_exit.set()
            return False
        if self.should_exit.is_set():
            return False
        if exited:
            log.info("worker %s died; starting another", process.pid)
        else:
            log.error(
                "worker %s did not answer its health check in %gs; killed it, starting another",
                process.pid,
                self._health.timeout,
            )
        replacement = Process(self.config, self.sockets)
        replacement.start()
        self.processes[self.processes.index(process)] = replacement
        if self._reaper is not None:
            # Known from its start: a worker that dies before a turn sees it alive still has
            # its gauges dropped.
            self._reaper.watch([replacement.pid])
        return True

    def terminate_all(self) -> None:
        # Our copies of the listening sockets would keep them open once the workers close
        # theirs: the kernel would queue connections nobody accepts instead of refusing them.
        for sock in self.sockets:
            sock.close()
        self._continue_stopped_workers()
        super().terminate_all()

    def _continue_stopped_workers(self) -> None:
        """SIGCONT to every worker before it is told to stop (a rolling restart, a shutdown),
        each of which waits for the worker to exit: a stopped worker holds a SIGTERM until it
        is continued, and the supervisor would have waited for it forever."""
        for process in self.processes:
            if process.pid is not None and process.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, signal.SIGCONT)

    def failed_to_start(self) -> bool:
        return any(process.exitcode == STARTUP_FAILURE for process in self.processes)


def serve(
    *,
    host: str,
    listeners: Listeners,
    workers: int,
    log_level: str,
    log_format: LogFormat,
    limits: LimitsConfig,
    gateway_config: GatewayConfig,
    reload_config: Callable[[], GatewayConfig],
    drain: DrainState,
) -> int:
    """Run until stopped; the exit status is uvicorn's startup failure code if a worker
    could not start, else 0."""
    config = EdgeServerConfig(
        GATEWAY_FACTORY,
        limits=limits,
        admin_port=listeners.admin_port,
        factory=True,
        host=host,
        port=listeners.port,
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
        timeout_worker_healthcheck=WORKER_HEALTHCHECK_SECONDS,
        # The sockets already listen with it; each worker's listen() names it again.
        backlog=BACKLOG,
    )
    supervisor = GatewaySupervisor(
        config,
        [listeners.proxy, listeners.admin],
        gateway_config=gateway_config,
        reload_config=reload_config,
        drain=drain,
    )
    supervisor.run()
    return STARTUP_FAILURE if supervisor.failed_to_start() else 0
