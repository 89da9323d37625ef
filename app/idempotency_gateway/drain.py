"""Whether this gateway is draining: ``/readyz`` fails so load balancers stop sending to it.

``serve`` runs several worker processes behind one supervisor; a probe reaches any one of
them, so the state must be the same in all of them. ``serve`` names a marker file in
``GATEWAY_DRAIN_MARKER``: draining is that file existing, whichever worker (the admin API)
or the supervisor (SIGTERM) created it, and a worker started later (a config reload) sees it
too. Without that variable (a library user, ``uvicorn --factory``) the state is this
process's alone.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

DRAIN_MARKER_ENV = "GATEWAY_DRAIN_MARKER"


class DrainState:
    def __init__(self, marker: Path | None = None) -> None:
        self._marker = marker
        self._draining = False

    @classmethod
    def from_environment(cls) -> DrainState:
        marker = os.environ.get(DRAIN_MARKER_ENV)
        return cls(Path(marker) if marker else None)

    @property
    def draining(self) -> bool:
        if self._marker is None:
            return self._draining
        return self._marker.exists()

    def start(self) -> None:
        if self._marker is None:
            self._draining = True
        else:
            self._marker.touch()

    def cancel(self) -> None:
        if self._marker is None:
            self._draining = False
        else:
            with contextlib.suppress(FileNotFoundError):
                self._marker.unlink()
