"""The types the middleware and the app it wraps (the proxy, or a library user's app) share.

The channel from the app that executes a request back to the middleware that owns it.

The middleware puts an ``Execution`` into ``scope["state"]`` (``request.state.idempotency`` in
Starlette and FastAPI). The app may report that the request never reached the system of record
(``NOT_EXECUTED``: the key may run again) or that it cannot tell (``AMBIGUOUS``); without a
report the response status decides.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto

from idempotency_gateway.asgi import Scope

STATE_KEY = "idempotency"
# The execution's fencing token goes upstream under this name, so the upstream can refuse a
# stale owner's write too.
FENCING_TOKEN_HEADER = b"idempotency-fencing-token"


class Outcome(Enum):
    """What the executing app knows about whether the upstream acted on the request."""

    NOT_EXECUTED = auto()
    AMBIGUOUS = auto()


@dataclass(slots=True)
class Execution:
    idempotency_key: str
    fencing_token: int
    outcome: Outcome | None = None

    def report(self, outcome: Outcome) -> None:
        # The first report wins: a later, vaguer one must not erase "never sent".
        if self.outcome is None:
            self.outcome = outcome


def execution_of(scope: Scope) -> Execution | None:
    execution = scope.get("state", {}).get(STATE_KEY)
    return execution if isinstance(execution, Execution) else None
