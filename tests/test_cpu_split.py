"""``benchmarks.cpu_split`` reads a process's CPU and context switches from ``/proc``."""

from __future__ import annotations

import os
import time
from pathlib import Path

from benchmarks.cpu_split import Usage, usage_of


def test_cpu_spent_shows_in_its_times() -> None:
    before = usage_of([os.getpid()])
    deadline = time.process_time() + 0.3
    while time.process_time() < deadline:
        pass
    spent = usage_of([os.getpid()]) - before
    # Clock ticks of 10 ms: most of the 0.3 s shows, in user or system time.
    assert spent.user + spent.system >= 0.2
    assert spent.voluntary >= 0
    assert spent.involuntary >= 0


def test_a_process_that_is_gone_counts_nothing() -> None:
    pid = int(Path("/proc/sys/kernel/pid_max").read_text()) + 1  # no process has it
    assert usage_of([pid]) == Usage(0.0, 0.0, 0, 0)
