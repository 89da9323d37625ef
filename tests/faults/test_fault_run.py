"""The short fault run: exactly-once holds through every kind of fault, one scenario each.

Three gateway processes share a private PostgreSQL and a private Redis in front of the
recording upstream; six SDK-like clients (some operations sent by two of them at once, some
sent again after they finished) keep them busy on an ``on_ambiguous: fail`` route and an
``on_ambiguous: retry`` route while one fault strikes: a gateway killed with SIGKILL
mid-request (and replaced), a gateway stopped past its lease and resumed, PostgreSQL crashed
and restarted, Redis killed and restarted, the upstream hanging, resetting after committing,
or answering 5xx. Each scenario proves, from the upstream's ledger, the records read straight
from PostgreSQL and every answer every client saw (``tests.faults.checker``): no key
committed twice where the route forbids it (and higher fencing tokens where it allows it),
one answer per key for every client and the record, nothing stuck ``IN_PROGRESS``, no
fenced-off finalize stored, no undocumented 5xx, every operation finished; and that the
fault really bit (its trace is in the report). The tables print at the end of the session.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import pytest_asyncio

from tests.faults.checker import Report
from tests.faults.faults import (
    DATABASE_LINK_PAUSE,
    GATEWAY_KILL,
    GATEWAY_STALL,
    GATEWAY_STALL_BETWEEN_ATTEMPTS,
    KINDS,
    POSTGRES_RESTART,
    REDIS_RESTART,
    UPSTREAM_5XX,
    UPSTREAM_HANG,
    UPSTREAM_RESET,
)
from tests.faults.scenario import FaultEnvironment, Plan, fault_environment, run_scenario

pytestmark = [
    pytest.mark.faults,
    pytest.mark.multiprocess,
    pytest.mark.asyncio(loop_scope="module"),
]


def _seen(*prefixes: str) -> Callable[[Report], bool]:
    """The report's errors include a kind starting with one of ``prefixes``."""
    return lambda report: any(kind.startswith(prefixes) for kind in report.errors)


# What each fault leaves behind when it really struck, so a fault that missed fails the test.
TRACE_OF: dict[str, Callable[[Report], bool]] = {
    GATEWAY_KILL: _seen("connection: "),
    GATEWAY_STALL: lambda report: any("fenced" in kind for kind in report.errors),
    # The upstream refused attempts (the gateways retried them) and a stalled owner was fenced.
    GATEWAY_STALL_BETWEEN_ATTEMPTS: lambda report: (
        report.counts["  refused: not processed"] > 0
        and any("fenced" in kind for kind in report.errors)
    ),
    # The cut-off owner either ran out its lease waiting for the store (and said so), or saw
    # its link come back after another gateway had taken the record over and was fenced off.
    DATABASE_LINK_PAUSE: lambda report: any(
        "lease" in kind or "fenced" in kind for kind in report.errors
    ),
    POSTGRES_RESTART: _seen("gateway 503 store-unavailable", "log error: finalize failed"),
    REDIS_RESTART: _seen("log warning: Redis"),
    UPSTREAM_HANG: _seen("gateway 504 upstream-timeout"),
    UPSTREAM_RESET: _seen("gateway 502 upstream-connection-lost"),
    UPSTREAM_5XX: _seen("upstream 5"),
}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def environment(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[FaultEnvironment]:
    async with fault_environment(tmp_path_factory.mktemp("fault-run")) as running:
        yield running


@pytest.mark.parametrize(
    "kind",
    KINDS,
    ids=[
        "gateway-kill",
        "gateway-stall",
        "gateway-stall-between-attempts",
        "database-link-pause",
        "postgres-restart",
        "redis-restart",
        "upstream-hang",
        "upstream-reset",
        "upstream-5xx",
    ],
)
async def test_exactly_once_holds_through(
    kind: str, environment: FaultEnvironment, fault_reports: list[Report]
) -> None:
    report = await run_scenario(environment, Plan(kind, faults=[kind], seed=KINDS.index(kind)))
    fault_reports.append(report)

    assert report.faults == {kind: 1}
    assert report.ok, report.table()
    assert TRACE_OF[kind](report), f"the fault left no trace:\n{report.table()}"
    counts: dict[str, Any] = report.counts
    assert counts["final answers"] == counts["sends (operations x clients, resends)"]
    assert counts["stuck records (IN_PROGRESS)"] == 0
    assert counts["duplicate executions (fail route)"] == 0
