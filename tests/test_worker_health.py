"""The supervisor's health check (``server/worker_health``) and its reaper of dead workers'
gauges (``telemetry/multiprocess``), on real processes and pipes.

Each worker is a child process with the pipe uvicorn gives its workers: one answers pings,
one never does (as a stopped or stuck worker), one has exited, one exits while being asked.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TypeAlias

import pytest

from idempotency_gateway.server.worker_health import WorkerHealth
from idempotency_gateway.telemetry.multiprocess import DeadWorkerReaper

_FORK = multiprocessing.get_context("fork")
TIMEOUT = 1.0

Pipe: TypeAlias = "Connection[object, object]"


@dataclass(eq=False)  # hashed by identity, as uvicorn's Process is
class Child:
    name: str
    parent_conn: Pipe
    process: multiprocessing.process.BaseProcess
    answers: int = field(default=0)


def _answers(connection: Pipe) -> None:
    while True:
        connection.recv()
        connection.send(True)


def _silent(connection: Pipe) -> None:
    time.sleep(60)


def _exits_when_asked(connection: Pipe) -> None:
    connection.recv()


def _exits(connection: Pipe) -> None:
    return


StartChild = Callable[[str, Callable[[Pipe], None]], Child]


@pytest.fixture
def start_child() -> Iterator[StartChild]:
    children: list[Child] = []

    def start(name: str, target: Callable[[Pipe], None]) -> Child:
        parent, child = _FORK.Pipe()
        process = _FORK.Process(target=target, args=(child,), daemon=True)
        process.start()
        children.append(Child(name, parent, process))
        return children[-1]

    yield start
    for child in children:
        child.process.kill()
        child.process.join()


def turns_until(
    health: WorkerHealth[Child], workers: list[Child], *, seconds: float
) -> Iterator[tuple[float, list[tuple[str, bool]]]]:
    """Turns of a supervisor's loop, every 20 ms, for ``seconds``: when, and who failed."""
    started = time.monotonic()
    while (elapsed := time.monotonic() - started) < seconds:
        failing = health.failing(workers)
        yield elapsed, [(worker.name, exited) for worker, exited in failing]
        for worker, _ in failing:
            workers.remove(worker)  # as the supervisor replaces it
        time.sleep(0.02)  # the supervisor's loop period, shortened


def test_exited_workers_are_named_on_the_next_turn_and_silent_ones_after_the_timeout(
    start_child: StartChild,
) -> None:
    health: WorkerHealth[Child] = WorkerHealth(timeout=TIMEOUT)
    silent = start_child("silent", _silent)
    healthy = start_child("healthy", _answers)
    gone = start_child("gone", _exits)
    gone.process.join()
    workers = [silent, healthy, gone]

    seen: list[tuple[float, str, bool]] = []
    leaving: Child | None = None
    for elapsed, failing in turns_until(health, workers, seconds=TIMEOUT + 1.0):
        seen += [(elapsed, name, exited) for name, exited in failing]
        if leaving is None and elapsed > TIMEOUT / 4:
            # Started after the silent one's ping went out, as a replacement would be.
            leaving = start_child("leaving", _exits_when_asked)
            workers.append(leaving)

    assert [(name, exited) for _, name, exited in seen] == [
        ("gone", True),
        ("leaving", True),
        ("silent", False),
    ]
    at = {name: elapsed for elapsed, name, _ in seen}
    assert at["gone"] < TIMEOUT / 4
    # Named while the silent one was still waited for, not when its timeout ran out.
    assert at["leaving"] < at["silent"]
    assert at["silent"] >= TIMEOUT
    assert healthy in workers


def test_workers_that_all_answer_are_asked_again_and_left_alone(
    start_child: StartChild,
) -> None:
    health: WorkerHealth[Child] = WorkerHealth(timeout=TIMEOUT)
    workers = [start_child(f"healthy-{n}", _answers) for n in range(3)]

    for _, failing in turns_until(health, workers, seconds=TIMEOUT * 2):
        assert failing == []
    assert len(workers) == 3


def test_a_worker_the_supervisor_started_has_its_gauges_dropped_though_never_seen_alive(
    tmp_path: Path,
) -> None:
    """A replacement that dies before a turn of the loop sees it alive: its live gauges go
    too, and a pid neither started nor seen (another supervisor's) keeps its files."""
    reaper = DeadWorkerReaper(str(tmp_path))
    pids = []
    for _ in range(2):
        child = _FORK.Process(target=_exits, args=(None,))
        child.start()
        child.join()
        assert child.pid is not None
        pids.append(child.pid)
        (tmp_path / f"gauge_livemax_{child.pid}.db").touch()
    started, unknown = pids

    reaper.watch([started])
    reaper.reap()

    assert not (tmp_path / f"gauge_livemax_{started}.db").exists()
    assert (tmp_path / f"gauge_livemax_{unknown}.db").exists()
