"""The types the middleware and the app it wraps (the proxy, or a library user's app) share.

The channel from the app that executes a request back to the middleware that owns it.

The middleware puts an ``Execution`` into ``scope["state"]`` (``request.state.idempotency`` in
Starlette and FastAPI). The app may report that the request never reached the system of record
(``NOT_EXECUTED``: the key may run again) or that it cannot tell (``AMBIGUOUS``); without a
report the response status decides.

An attempt leaves only while the execution's owner holds the record's lease: before each
attempt the app awaits ``execution.confirm()`` (after a pause, ``confirm(fresh=True)``), and
calls ``execution.check()`` right before writing the attempt's bytes. Either raises
``LeaseNotConfirmed`` and then reports the outcome itself: ``NOT_EXECUTED`` when no attempt
had left yet, ``AMBIGUOUS`` when one had.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto
from typing import Protocol

from idempotency_gateway.asgi import Scope
from idempotency_gateway.errors import LeaseNotConfirmed

STATE_KEY = "idempotency"
# The execution's fencing token goes upstream under this name, so the upstream can refuse a
# stale owner's write too.
FENCING_TOKEN_HEADER = b"idempotency-fencing-token"


class Outcome(Enum):
    """What the executing app knows about whether the upstream acted on the request."""

    NOT_EXECUTED = auto()
    AMBIGUOUS = auto()


class LeaseGuard(Protocol):
    """The owner's lease as an execution sees it (``idempotency.lease.Lease``)."""

    async def confirm(self, *, fresh: bool = False) -> None: ...

    def check(self) -> None: ...


@dataclass(slots=True)
class Execution:
    idempotency_key: str
    fencing_token: int
    lease: LeaseGuard | None = None
    outcome: Outcome | None = None
    sent: bool = False
    """Whether an attempt of this execution has left (``check`` passed)."""

    def report(self, outcome: Outcome) -> None:
        # The first report wins: a later, vaguer one must not erase "never sent".
        if self.outcome is None:
            self.outcome = outcome

    async def confirm(self, *, fresh: bool = False) -> None:
        """Before an attempt: make sure the lease holds (a round trip only when it is not
        trusted any more, or ``fresh`` after a pause)."""
        if self.lease is not None:
            try:
                await self.lease.confirm(fresh=fresh)
            except LeaseNotConfirmed:
                self._refused()
                raise

    def check(self) -> None:
        """Right before an attempt's bytes are written: the lease is trusted now, and from
        here on the attempt counts as sent."""
        if self.lease is not None:
            try:
                self.lease.check()
            except LeaseNotConfirmed:
                self._refused()
                raise
        self.sent = True

    def _refused(self) -> None:
        # Nothing more goes out; whether the upstream acted depends on what went before.
        self.report(Outcome.AMBIGUOUS if self.sent else Outcome.NOT_EXECUTED)


def execution_of(scope: Scope) -> Execution | None:
    execution = scope.get("state", {}).get(STATE_KEY)
    return execution if isinstance(execution, Execution) else None
