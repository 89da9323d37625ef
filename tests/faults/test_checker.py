"""The fault run's checker has teeth: each invariant, broken on purpose in a hand-made run,
is reported, and a clean run (including what the rules allow: refused executions, same-owner
resends and higher-token re-executions on an ``on_ambiguous: retry`` route, documented 5xx
problems) is not. A checker that passed everything would make the fault run prove nothing.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from idempotency_gateway.errors import PROBLEM_TYPE_BASE
from tests.faults.checker import Report, StoredRecord, check
from tests.faults.clients import Attempt, Operation, Send
from tests.support.charges import CHARGES
from tests.support.upstream import Execution

TRANSFERS = "/v1/transfers"  # on_ambiguous: retry
TENANT = "Bearer sk_test_checker"


def execution(number: int, key: str, token: int, **behavior: str) -> Execution:
    return Execution(
        method="POST",
        path=CHARGES,
        query_string="",
        headers={},
        raw_headers=[],
        body=b"",
        idempotency_key=key,
        fencing_token=token,
        number=number,
        behavior=dict(behavior),
    )


def upstream_body(number: int, key: str, token: int) -> bytes:
    return json.dumps({"execution": number, "key": key, "fencing_token": token}).encode()


def problem(slug: str, status: int) -> bytes:
    return json.dumps({"type": PROBLEM_TYPE_BASE + slug, "status": status}).encode()


def answer(
    client: str, key: str, status: int, body: bytes, *, upstream: int | None, replayed: bool
) -> Attempt:
    headers = {"content-type": "application/json"}
    if upstream is not None:
        headers["x-upstream-execution"] = str(upstream)
    else:
        headers["content-type"] = "application/problem+json"
    if replayed:
        headers["idempotent-replayed"] = "true"
    return Attempt(client, key, "gateway-1", status, body, headers, None, 0.01)


@dataclass
class Run:
    """A hand-made run: one key, its executions, its record and what the clients saw."""

    operation: Operation
    ledger: list[Execution] = field(default_factory=list)
    record: StoredRecord | None = None
    sends: list[Send] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)

    def executed(self, number: int, token: int, **behavior: str) -> None:
        self.ledger.append(execution(number, self.operation.key, token, **behavior))

    def stores(
        self, status: str, token: int, code: int | None, body: bytes, origin: int | None
    ) -> None:
        headers = {"x-upstream-execution": str(origin)} if origin is not None else {}
        self.record = StoredRecord(self.operation.key, status, token, code, headers, body)

    def sees(self, client: str, attempt: Attempt, *, final: bool = True) -> None:
        self.attempts.append(attempt)
        send = Send(client, self.operation)
        if final:
            send.final = attempt
        else:
            send.gave_up = "deadline passed after status 503"
        self.sends.append(send)

    def check(self) -> Report:
        records = {self.operation.key: self.record} if self.record is not None else {}
        return check(
            "hand-made",
            operations=[self.operation],
            sends=self.sends,
            attempts=self.attempts,
            ledger=self.ledger,
            records=records,
            faults=Counter(),
        )


def clean_run(path: str = CHARGES, *, token: int = 1) -> Run:
    """One execution, stored, answered to the owner's client and replayed to another."""
    run = Run(Operation("k-1", path, TENANT, 100))
    body = upstream_body(1, "k-1", token)
    run.executed(1, token)
    run.stores("SUCCEEDED", token, 201, body, origin=1)
    run.sees("client-1", answer("client-1", "k-1", 201, body, upstream=1, replayed=False))
    run.sees("client-2", answer("client-2", "k-1", 201, body, upstream=1, replayed=True))
    return run


def test_a_clean_run_passes() -> None:
    report = clean_run().check()
    assert report.ok, report.table()
    assert report.counts["upstream executions (all)"] == 1
    assert report.counts["final answers"] == 2


def test_what_the_rules_allow_passes() -> None:
    """Refused attempts are no commits; on a retry route a same-owner resend and a takeover
    with a higher token are allowed; documented 5xx problems are fine."""
    run = Run(Operation("k-1", TRANSFERS, TENANT, 100))
    run.executed(1, 1, status="503")  # not processed: refused
    run.executed(2, 1, reset="")  # committed, answer lost
    run.executed(3, 1)  # the same owner resends
    run.executed(4, 1, stale="2")  # a fenced-off owner, refused by the upstream
    run.executed(5, 2)  # a new owner with a higher token
    body = upstream_body(5, "k-1", 2)
    run.stores("SUCCEEDED", 2, 201, body, origin=5)
    unavailable = problem("store-unavailable", 503)
    run.attempts.append(answer("client-1", "k-1", 503, unavailable, upstream=None, replayed=False))
    run.sees("client-1", answer("client-1", "k-1", 201, body, upstream=5, replayed=True))
    report = run.check()
    assert report.ok, report.table()
    assert report.counts["  committed"] == 3
    assert report.counts["  refused: not processed"] == 1
    assert report.counts["  refused: stale fencing token"] == 1
    assert report.counts["duplicate executions (retry route)"] == 2
    assert report.errors["gateway 503 store-unavailable"] == 1


def _twice_on_fail_route() -> Run:
    run = clean_run()
    run.executed(2, 2)
    return run


def _lower_token_later() -> Run:
    run = clean_run(TRANSFERS, token=2)
    run.executed(2, 1)
    return run


def _different_answers() -> Run:
    run = clean_run()
    other = upstream_body(9, "k-1", 1)
    run.sees("client-3", answer("client-3", "k-1", 201, other, upstream=9, replayed=False))
    return run


def _stuck() -> Run:
    run = clean_run()
    run.stores("IN_PROGRESS", 1, None, b"", origin=None)
    return run


def _fenced_finalize() -> Run:
    # A second owner (token 2) executed, but the stored answer is the first owner's.
    run = clean_run(TRANSFERS)
    run.executed(2, 2)
    run.stores("SUCCEEDED", 2, 201, upstream_body(1, "k-1", 1), origin=1)
    return run


def _undocumented_500() -> Run:
    run = clean_run()
    plain = {"content-type": "text/plain"}
    run.attempts.append(
        Attempt("client-1", "k-1", "gateway-1", 500, b"Internal Server Error", plain, None, 0.0)
    )
    return run


def _no_final_answer() -> Run:
    run = clean_run()
    run.sends.append(Send("client-4", run.operation, gave_up="deadline passed after ReadError"))
    return run


def _answer_not_stored() -> Run:
    run = clean_run()
    run.stores("FAILED_RETRYABLE", 1, None, b"", origin=None)
    return run


@pytest.mark.parametrize(
    ("breach", "reported"),
    [
        pytest.param(_twice_on_fail_route, "committed 2 times", id="executed-twice"),
        pytest.param(_lower_token_later, "lower fencing token", id="lower-token-later"),
        pytest.param(_different_answers, "client-3 got 201", id="different-answers"),
        pytest.param(_stuck, "stuck IN_PROGRESS", id="stuck-record"),
        pytest.param(_fenced_finalize, "fenced-off owner's finalize landed", id="fenced-finalize"),
        pytest.param(_undocumented_500, "undocumented 500", id="undocumented-5xx"),
        pytest.param(_no_final_answer, "client-4 got no final answer", id="no-final-answer"),
        pytest.param(_answer_not_stored, "the record is FAILED_RETRYABLE", id="answer-not-stored"),
    ],
)
def test_each_breach_is_reported(breach: Callable[[], Run], reported: str) -> None:
    report = breach().check()
    assert not report.ok
    assert any(reported in violation for violation in report.violations), report.table()
