"""Metrics across worker processes.

``prepare_metrics_directory`` runs before prometheus_client is first imported. The supervisor
then runs ``forget_dead_workers``: a worker that exits (crash, ``kill -9``, restart) has its
live gauges dropped, so no gauge keeps speaking for a process that is gone. Counters and
histograms of dead workers stay: a sum over workers must not go backwards.
"""

from __future__ import annotations

import logging
import os
import re
import tempfile
import threading
import time
from pathlib import Path

MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Often enough that a scrape rarely sees a dead worker's gauge; cheap (one directory listing).
_CHECK_EVERY = 0.5
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


def forget_dead_workers() -> None:
    """In the supervisor, before the workers start: drop each dead worker's live gauges from
    now on (a daemon thread; it ends with the supervisor). No-op without multiprocess mode."""
    directory = os.environ.get(MULTIPROCESS_ENV)
    if not directory:
        return
    thread = threading.Thread(
        target=_forget_dead_workers_forever, args=(directory,), name="metrics-reaper", daemon=True
    )
    thread.start()


def _forget_dead_workers_forever(directory: str) -> None:
    from prometheus_client import multiprocess

    # Only pids once seen alive as our children: a directory shared with another supervisor
    # (PROMETHEUS_MULTIPROC_DIR is the operator's to set) must keep that one's workers.
    workers: set[int] = set()
    while True:
        time.sleep(_CHECK_EVERY)
        for pid in metric_file_pids(directory):
            if is_live_child(pid):
                workers.add(pid)
            elif pid in workers:
                multiprocess.mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]
                workers.discard(pid)
                log.info("dropped the live gauges of exited worker %d", pid)
