"""Processes under test: start them, wait until they answer, measure them, stop them.

Every process is started in a session of its own, so stopping it signals exactly the process
group this harness created (never anything found by name). CPU time and resident memory are
read from ``/proc``.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
# Variables the gateway reads: the harness sets the ones a server needs, and nothing leaks
# in from the shell that started the harness.
_SCRUBBED_PREFIXES = ("GATEWAY_", "BENCH_", "PROMETHEUS_MULTIPROC_DIR")
_PROXY_VARIABLES = ("http_proxy", "https_proxy", "all_proxy", "HTTP_PROXY", "HTTPS_PROXY")


class StartError(RuntimeError):
    """A process did not come up; the message carries the end of its log."""


_handed_out: set[int] = set()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free a moment ago (bind port 0, read it, close), and that this
    process has not handed out before: the kernel may offer a port again as soon as it is
    closed, and two servers told the same port (a gateway's proxy and admin ports, seen) then
    share its connections."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        if port not in _handed_out:
            _handed_out.add(port)
            return port


def clean_environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith(_SCRUBBED_PREFIXES) and name not in _PROXY_VARIABLES
    }
    env["NO_PROXY"] = "127.0.0.1,localhost"
    env.update(extra or {})
    return env


def venv_tool(name: str) -> str:
    """A console script next to the running interpreter (the venv's), else on PATH."""
    beside = Path(sys.executable).parent / name
    if beside.exists():
        return str(beside)
    found = shutil.which(name)
    if found is None:
        raise StartError(f"{name} is not installed")
    return found


@dataclass
class ManagedProcess:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    ports: tuple[int, ...] = ()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def log_tail(self, lines: int = 15) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def tree(self) -> list[int]:
        """This process and everything it started (uvicorn workers, nginx workers)."""
        return [self.pid, *descendants(self.pid)] if self.alive() else []

    def stop(self, timeout: float = 20.0) -> None:
        if self.popen.poll() is not None:
            return
        # Its own session: the group id is its pid and holds only what it started.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.pid, signal.SIGTERM)
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.popen.wait(5)


def spawn(
    name: str,
    argv: Sequence[str],
    *,
    log_dir: Path,
    env: Mapping[str, str],
    cwd: Path | None = None,
    ports: tuple[int, ...] = (),
) -> ManagedProcess:
    log_path = log_dir / f"{name}.log"
    with log_path.open("ab") as log:
        popen = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
        )
    return ManagedProcess(name, popen, log_path, ports)


def http_status(port: int, path: str, *, method: str = "GET", timeout: float = 2.0) -> int | None:
    """The status of one request over loopback, or ``None`` when nothing answered."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request(method, path)
        response = connection.getresponse()
        response.read()
        return response.status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        connection.close()


def wait_until_answers(
    process: ManagedProcess, port: int, path: str, *, timeout: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not process.alive():
            raise StartError(f"{process.name} exited early:\n{process.log_tail()}")
        if http_status(port, path) == 200:
            return
        time.sleep(0.1)
    process.stop()
    raise StartError(
        f"{process.name} did not answer {path} within {timeout:g}s:\n{process.log_tail()}"
    )


# /proc readings -------------------------------------------------------------------------


def stat_fields(pid: int) -> list[str] | None:
    """The fields of ``/proc/PID/stat`` after the command name (state first); ``None``: gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces: split after its closing one.
    return raw[raw.rindex(")") + 2 :].split()


def _all_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid in _all_pids():
        fields = stat_fields(pid)
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(pid)
    found: list[int] = []
    frontier = [root]
    while frontier:
        kids = children.get(frontier.pop(), [])
        found.extend(kids)
        frontier.extend(kids)
    return found


def pids_named(name: str) -> list[int]:
    """Processes whose command name is ``name`` (read only: to measure, never to signal)."""
    found = []
    for pid in _all_pids():
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/comm").read_text().strip() == name:
                found.append(pid)
    return found


def cpu_seconds(pids: Iterable[int]) -> float:
    """User plus system CPU time of these processes so far (vanished ones count nothing)."""
    ticks = 0
    for pid in pids:
        fields = stat_fields(pid)
        if fields is not None:
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / CLOCK_TICKS


def machine_cpu_seconds() -> tuple[float, float]:
    """(busy, total) CPU seconds of the whole machine since boot, from /proc/stat."""
    values = [int(value) for value in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = sum(values[:8])  # user nice system idle iowait irq softirq steal
    idle = values[3] + values[4]
    return (total - idle) / CLOCK_TICKS, total / CLOCK_TICKS


def rss_kib(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def uvicorn_workers(process: ManagedProcess, expected: int) -> list[int]:
    """The pids that serve requests: the process itself with one worker, else its spawned
    workers (uvicorn's supervisor starts them with multiprocessing's spawn_main)."""
    if expected <= 1:
        return [process.pid]
    workers = []
    for pid in descendants(process.pid):
        with contextlib.suppress(OSError):
            if b"spawn_main" in Path(f"/proc/{pid}/cmdline").read_bytes():
                workers.append(pid)
    return workers


@dataclass
class CpuSample:
    """CPU seconds of each group of processes at one moment."""

    groups: dict[str, float]
    machine_busy: float
    machine_total: float
    wall: float = field(default_factory=time.monotonic)


def sample_cpu(groups: Mapping[str, Iterable[int]]) -> CpuSample:
    busy, total = machine_cpu_seconds()
    return CpuSample({name: cpu_seconds(pids) for name, pids in groups.items()}, busy, total)


def load_average() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"
