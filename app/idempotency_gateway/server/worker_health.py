"""Which of the supervisor's workers to replace, judged on every turn of its loop.

Each worker of uvicorn's supervisor answers a ping on its pipe from a thread of its own, so a
worker whose process runs answers at once, whatever its event loop is doing, and one that does
not answer within the health timeout is hung (stopped, or stuck holding the interpreter).

uvicorn's own check pings one worker and waits for it before asking the next: one hung worker
held up the supervisor for the whole timeout, and with it the replacement of any other worker
that died meanwhile, and the handling of SIGHUP and SIGTERM. Here nothing waits: each turn
sends a ping to every worker not already asked, reads the answers that came, and names the
workers that exited and those whose ping has gone unanswered for the timeout.
"""

from __future__ import annotations

import multiprocessing
import pickle
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Generic, Protocol, TypeVar


class Worker(Protocol):
    """What of uvicorn's ``Process`` this reads: the pipe it pings on, and the process."""

    @property
    def parent_conn(self) -> Connection[object, object]: ...

    @property
    def process(self) -> multiprocessing.process.BaseProcess: ...


W = TypeVar("W", bound=Worker)


class WorkerHealth(Generic[W]):
    def __init__(self, *, timeout: float) -> None:
        self.timeout = timeout
        # Worker -> when its unanswered ping was sent (time.monotonic).
        self._asked: dict[W, float] = {}

    def failing(self, workers: Sequence[W]) -> list[tuple[W, bool]]:
        """The workers to replace, each with whether it exited (``True``) or has left a ping
        unanswered for ``timeout`` seconds (``False``). Never waits."""
        now = time.monotonic()
        failing: list[tuple[W, bool]] = []
        asked: dict[W, float] = {}
        for worker in workers:
            verdict = self._judge(worker, now)
            if isinstance(verdict, bool):
                failing.append((worker, verdict))
            elif verdict is not None:
                asked[worker] = verdict
        self._asked = asked  # workers replaced or gone are forgotten with their pings
        return failing

    def _judge(self, worker: W, now: float) -> bool | float | None:
        """``True``/``False`` to replace it (exited/silent); else when its pending ping was
        sent, or ``None`` when it has none (it answered)."""
        if not worker.process.is_alive():
            return True
        asked_at = self._asked.get(worker)
        if asked_at is None:
            return now if _ping(worker) else True
        if worker.parent_conn.poll():
            return None if _pong(worker) else True
        return False if now - asked_at >= self.timeout else asked_at


def _ping(worker: Worker) -> bool:
    try:
        worker.parent_conn.send(b"ping")
    except OSError:
        return False
    return True


def _pong(worker: Worker) -> bool:
    """Read the answer (whether its server has started); ``False`` if the pipe broke."""
    try:
        worker.parent_conn.recv()
    except (OSError, EOFError, pickle.UnpicklingError):
        return False
    return True
