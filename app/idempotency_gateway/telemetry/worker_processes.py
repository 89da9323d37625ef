"""``process_*`` metrics of every live worker, read from ``/proc`` at scrape time.

prometheus-client's own process collector describes only the process it runs in, and with
``--workers N`` a scrape is answered by any one worker. This collector reports each live
worker (a ``pid`` label) so CPU, memory and file descriptors of every worker show, and a
worker that exited disappears with its pid.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _boot_time() -> float:
    for line in Path("/proc/stat").read_text().splitlines():
        if line.startswith("btime "):
            return float(line.split()[1])
    return 0.0


class WorkerProcessCollector(Collector):
    def __init__(self, pids: Callable[[], Iterable[int]]) -> None:
        self._pids = pids
        self._boot = _boot_time()

    def collect(self) -> Iterator[Metric]:
        cpu = CounterMetricFamily(
            "process_cpu_seconds_total", "User and system CPU time of the worker", labels=["pid"]
        )
        memory = GaugeMetricFamily(
            "process_resident_memory_bytes", "Resident memory of the worker", labels=["pid"]
        )
        started = GaugeMetricFamily(
            "process_start_time_seconds", "Start of the worker, Unix time", labels=["pid"]
        )
        descriptors = GaugeMetricFamily(
            "process_open_fds", "Open file descriptors of the worker", labels=["pid"]
        )
        for pid in sorted(self._pids()):
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                fds = len(os.listdir(f"/proc/{pid}/fd"))
            except OSError:
                continue  # exited since it was listed
            label = [str(pid)]
            # Field numbers of proc(5), counted after the command name: utime 14, stime 15,
            # starttime 22, rss 24 (so index = number - 3).
            cpu.add_metric(label, (int(stat[11]) + int(stat[12])) / _TICKS)
            started.add_metric(label, self._boot + int(stat[19]) / _TICKS)
            memory.add_metric(label, int(stat[21]) * _PAGE)
            descriptors.add_metric(label, fds)
        yield from (cpu, memory, started, descriptors)
