"""The supervisor's health check (``server/worker_health``), on real processes and pipes.

Each worker is a child process with the pipe uvicorn gives its workers: one answers pings,
one never does (as a stopped or stuck worker), one has exited, one exits while being asked.
"""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection

import pytest

from idempotency_gateway.server.worker_health import failing_workers

_FORK = multiprocessing.get_context("fork")


@dataclass
class Child:
    name: str
    parent_conn: Connection[object, object]
    process: multiprocessing.process.BaseProcess


def _answers(connection: Connection[object, object]) -> None:
    while True:
        connection.recv()
        connection.send(True)


def _silent(connection: Connection[object, object]) -> None:
    time.sleep(60)


def _exits_when_asked(connection: Connection[object, object]) -> None:
    connection.recv()


def _exited(connection: Connection[object, object]) -> None:
    return


@pytest.fixture
def start_child() -> Iterator[Callable[[str, Callable[[Connection[object, object]], None]], Child]]:
    children: list[Child] = []

    def start(name: str, target: Callable[[Connection[object, object]], None]) -> Child:
        parent, child = _FORK.Pipe()
        process = _FORK.Process(target=target, args=(child,), daemon=True)
        process.start()
        children.append(Child(name, parent, process))
        return children[-1]

    yield start
    for child in children:
        child.process.kill()
        child.process.join()


def test_exited_workers_come_at_once_and_silent_ones_after_the_timeout(
    start_child: Callable[[str, Callable[[Connection[object, object]], None]], Child],
) -> None:
    silent = start_child("silent", _silent)
    healthy = start_child("healthy", _answers)
    leaving = start_child("leaving", _exits_when_asked)
    gone = start_child("gone", _exited)
    gone.process.join()
    timeout = 4.0

    started = time.monotonic()
    seen: list[tuple[str, bool, float]] = []
    for child, exited in failing_workers([silent, healthy, leaving, gone], timeout=timeout):
        seen.append((child.name, exited, time.monotonic() - started))

    assert [(name, exited) for name, exited, _ in seen] == [
        ("gone", True),
        ("leaving", True),
        ("silent", False),
    ]
    # The exits were seen while the silent one was still being waited for, not after it.
    assert all(at < timeout for name, _, at in seen if name != "silent")
    assert seen[-1][2] >= timeout


def test_workers_that_all_answer_are_left_alone(
    start_child: Callable[[str, Callable[[Connection[object, object]], None]], Child],
) -> None:
    workers = [start_child(f"healthy-{n}", _answers) for n in range(3)]
    for _ in range(3):  # each round reads its own answers: none is left over for the next
        assert list(failing_workers(workers, timeout=10.0)) == []
