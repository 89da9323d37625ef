"""Metrics across worker processes.

``prepare_metrics_directory`` runs before prometheus_client is first imported. The supervisor
then runs a ``DeadWorkerReaper`` on each turn of its loop: a worker that exits (crash,
``kill -9``, restart) has its live gauges dropped, so no gauge keeps speaking for a process
that is gone. Counters and histograms of dead workers stay: a sum over workers must not go
backwards.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path

MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"
# prometheus_client names a worker's files ``<kind>_<pid>.db``.
_PID_OF_FILE = re.compile(r"_(\d+)\.db$")

log = logging.getLogger(__name__)


def prepare_metrics_directory() -> str:
    """A fresh directory for the workers' metric files; a scrape of any worker sums them."""
    directory = tempfile.mkdtemp(prefix="idempotency-gateway-metrics-")
    os.environ[MULTIPROCESS_ENV] = directory
    return directory


def metric_file_pids(directory: str, pattern: str = "*.db") -> set[int]:
    """The pids of every process that wrote metric files (matching ``pattern``)."""
    return {
        int(match.group(1))
        for path in Path(directory).glob(pattern)
        if (match := _PID_OF_FILE.search(path.name))
    }


def live_worker_pids(directory: str) -> set[int]:
    """Workers that have not exited: only they still have ``live*`` gauge files."""
    return metric_file_pids(directory, "gauge_live*.db")


def is_live_child(pid: int) -> bool:
    """Running (not a zombie) and a child of this process. The parent check keeps a pid the
    kernel reused for an unrelated process from passing for a live worker."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    state, parent = stat.rsplit(")", 1)[1].split()[:2]
    return state != "Z" and int(parent) == os.getpid()


class DeadWorkerReaper:
    """Drops the live gauges of workers that exited. The supervisor calls ``reap`` on each
    turn of its loop (every half second: a scrape rarely sees a dead worker's gauge, and a
    pass is one directory listing), on the supervisor's own thread: a thread of its own
    sleeping beside the supervisor was one more thing to go wrong (under libfaketime its
    sleep failed with EINVAL)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        # Only pids started by this supervisor (``watch``) or once seen alive as its children:
        # a directory shared with another supervisor (PROMETHEUS_MULTIPROC_DIR is the
        # operator's to set) keeps its workers.
        self._workers: set[int] = set()

    def watch(self, pids: Iterable[int | None]) -> None:
        """Workers the supervisor started: reaped once they exit, even if no turn of its loop
        saw them alive."""
        self._workers.update(pid for pid in pids if pid is not None)

    def reap(self) -> None:
        from prometheus_client import multiprocess

        with_files = metric_file_pids(self.directory)
        for pid in with_files:
            if is_live_child(pid):
                self._workers.add(pid)
            elif pid in self._workers:
                multiprocess.mark_process_dead(pid, self.directory)  # type: ignore[no-untyped-call]
                self._workers.discard(pid)
                log.info("dropped the live gauges of exited worker %d", pid)
        # A worker that exited before writing any file has nothing to drop: forget it.
        self._workers = {pid for pid in self._workers if pid in with_files or is_live_child(pid)}


def dead_worker_reaper() -> DeadWorkerReaper | None:
    """For the supervisor; ``None`` without multiprocess metrics."""
    directory = os.environ.get(MULTIPROCESS_ENV)
    return DeadWorkerReaper(directory) if directory else None
