"""Which of the supervisor's workers to replace: every worker is asked at once.

Each worker of uvicorn's supervisor answers a ping on its pipe from a thread of its own, so a
worker whose process runs answers at once, whatever its event loop is doing, and one that does
not answer within the health timeout is hung (stopped, or stuck holding the interpreter).
"""

from __future__ import annotations

import multiprocessing
import pickle
import time
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection, wait
from typing import Protocol, TypeVar


class Worker(Protocol):
    """What of uvicorn's ``Process`` this reads: the pipe it pings on, and the process."""

    @property
    def parent_conn(self) -> Connection[object, object]: ...

    @property
    def process(self) -> multiprocessing.process.BaseProcess: ...


W = TypeVar("W", bound=Worker)


def failing_workers(processes: Sequence[W], *, timeout: float) -> Iterator[tuple[W, bool]]:
    """Ping every worker, then yield each one that exits as soon as it is seen to, and last
    each that has not answered ``timeout`` seconds after its ping. With each, whether it
    exited (``True``) or stayed silent (``False``)."""
    asked: list[W] = []
    for process in processes:
        if process.process.is_alive() and _ping(process):
            asked.append(process)
        else:
            yield process, True
    deadline = time.monotonic() + timeout
    while asked and (remaining := deadline - time.monotonic()) > 0:
        handles = [handle for process in asked for handle in _handles(process)]
        ready = set(wait(handles, remaining))
        silent = []
        for process in asked:
            if process.process.sentinel in ready:
                yield process, True
            elif process.parent_conn not in ready:
                silent.append(process)
            elif not _pong(process):
                yield process, True
        asked = silent
    for process in asked:
        yield process, False


def _handles(process: Worker) -> tuple[Connection[object, object], int]:
    """Its pipe, readable once it answers, and its sentinel, readable once it exits."""
    return process.parent_conn, process.process.sentinel


def _ping(process: Worker) -> bool:
    try:
        process.parent_conn.send(b"ping")
    except OSError:
        return False
    return True


def _pong(process: Worker) -> bool:
    """Read the answer (whether its server has started); ``False`` if the pipe broke."""
    try:
        process.parent_conn.recv()
    except (OSError, EOFError, pickle.UnpicklingError):
        return False
    return True
