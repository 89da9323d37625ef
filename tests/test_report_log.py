"""The engine's report reaches the request log whole: every verdict has its outcome."""

from __future__ import annotations

import pytest

from idempotency_gateway.idempotency.keys import key_hash
from idempotency_gateway.idempotency.report import Report, Verdict
from idempotency_gateway.idempotency.report_log import note_report
from idempotency_gateway.storage.records import RecordKey
from idempotency_gateway.telemetry.request_log import STATE_KEY, RequestLog, RequestOutcome


@pytest.mark.parametrize("verdict", list(Verdict))
def test_every_verdict_is_noted_as_an_outcome(verdict: Verdict) -> None:
    entry = RequestLog("id", "POST", "/v1/charges")
    key = RecordKey("tenant-hash", "POST /v1/charges", "key-1")

    note_report({"state": {STATE_KEY: entry}}, Report("charges", key, verdict))

    assert entry.outcome is not RequestOutcome.UNPROTECTED
    assert (entry.route, entry.scope_hash, entry.key_hash) == (
        "charges",
        "tenant-hash",
        key_hash("key-1"),
    )


def test_a_report_with_nothing_to_say_leaves_what_other_layers_noted() -> None:
    entry = RequestLog("id", "POST", "/v1/charges", route="proxy-route")
    entry.outcome = RequestOutcome.SHED

    note_report({"state": {STATE_KEY: entry}}, Report())

    assert (entry.route, entry.outcome) == ("proxy-route", RequestOutcome.SHED)
