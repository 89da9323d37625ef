"""``store_errors``: the one place where a driver's errors become ``StoreUnavailable``.

Every backend runs every statement, the operators' included, inside it, naming its
``Driver``: which exceptions the driver raises for a store that is down, slow or misbehaving,
and how it says a table is missing. The client's problem says what is wrong in the gateway's
terms; the driver's class and message stay in the exception chain and the logs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from idempotency_gateway.errors import StoreReadOnly, StoreUnavailable
from idempotency_gateway.telemetry import tracing
from idempotency_gateway.telemetry.degradation import DegradationLog
from idempotency_gateway.telemetry.iteration_metrics import counts, observations
from idempotency_gateway.telemetry.metrics import STORE_ERRORS, STORE_LATENCY

# SQLSTATEs: a write on a standby (or a database or session set read-only); a connection
# over the server's, the database's or the role's limit.
READ_ONLY_SQLSTATE = "25006"
_TOO_MANY_CONNECTIONS = "53300"

SCHEMA_MISSING_DETAIL = (
    "the idempotency store's tables are missing or out of date; the database must be "
    "migrated (idempotency-gateway migrate)"
)
READ_ONLY_DETAIL = (
    "the idempotency store is read-only (a standby, or a database set read-only); keyed "
    "requests are refused until a writable primary answers"
)


@dataclass(frozen=True, slots=True)
class Driver:
    """What ``store_errors`` must know of a backend's driver."""

    system: str
    """The database as traces name it (``db.system``): ``postgresql`` or ``sqlite``."""
    errors: tuple[type[BaseException], ...]
    """Every error the driver or its pool raises for a store that is down or failing."""
    schema_missing: Callable[[BaseException], bool]
    """Whether an error says a table or column the statement names does not exist."""


_store_errors = counts(STORE_ERRORS)
# One log per statement kind, so a failing admin read cannot hide why reserves fail.
_store_degradations: dict[str, DegradationLog] = {}
_store_latency = observations(STORE_LATENCY)


def _unavailable(exc: BaseException, driver: Driver) -> StoreUnavailable:
    sqlstate = getattr(exc, "sqlstate", None)
    if sqlstate == READ_ONLY_SQLSTATE:
        return StoreReadOnly(READ_ONLY_DETAIL)
    if sqlstate == _TOO_MANY_CONNECTIONS:
        return StoreUnavailable("the idempotency store has no connection to spare")
    if driver.schema_missing(exc):
        return StoreUnavailable(SCHEMA_MISSING_DETAIL)
    if isinstance(exc, TimeoutError):
        return StoreUnavailable("the idempotency store did not answer in time")
    return StoreUnavailable("the idempotency store is unreachable or failed")


def _degradation(operation: str) -> DegradationLog:
    degradation = _store_degradations.get(operation)
    if degradation is None:
        degradation = _store_degradations[operation] = DegradationLog(
            f"idempotency store ({operation})", fallback="answering store-unavailable"
        )
    return degradation


@contextmanager
def store_errors(operation: str, driver: Driver) -> Iterator[None]:
    """Run one store operation: its driver's errors become ``StoreUnavailable``, and its
    latency and failures are measured and traced (``db.operation``: ``operation``)."""
    span = tracing.store_span(operation, driver.system)
    started = time.perf_counter()
    # A socket's and a wait's failures, whichever driver met them.
    caught: tuple[type[BaseException], ...] = (*driver.errors, OSError, TimeoutError)
    try:
        yield
    except caught as exc:
        _store_errors(operation).inc()
        # The driver's class and message go to the log, never into a client's problem.
        _degradation(operation).failed(exc)
        error = _unavailable(exc, driver)
        if span is not None:
            span.fail(error)
        raise error from exc
    finally:
        _store_latency(operation).observe(time.perf_counter() - started)
        if span is not None:
            span.end()
