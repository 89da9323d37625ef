"""The state machine's two decisions, as tables: what an existing record means for an incoming
request (``decide``), and which final state an execution's answer leads to (``classify``)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from idempotency_gateway.config import IdempotencyConfig, OnAmbiguous
from idempotency_gateway.execution import Outcome
from idempotency_gateway.idempotency.machine import Action, classify, decide
from idempotency_gateway.storage.records import Record, RecordKey, Status, StoredResponse

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
REQUEST_HASH = "a" * 64
OTHER_HASH = "b" * 64
FINISHED = (Status.SUCCEEDED, Status.FAILED_FINAL)


def record(
    status: Status,
    *,
    lease_left: float = 20.0,
    ttl_left: float = 3600.0,
    request_hash: str = REQUEST_HASH,
) -> Record:
    """A record as seen at ``NOW``: its lease and its life end the given seconds later."""
    response = None
    if status is not Status.IN_PROGRESS:
        response = StoredResponse(status=200, headers=[], body=b"{}")
    return Record(
        key=RecordKey("scope", "POST /v1/charges", "order-42"),
        request_hash=request_hash,
        status=status,
        owner_id="0" * 32,
        fencing_token=1,
        lease_expires_at=NOW + timedelta(seconds=lease_left),
        response=response,
        attempts=1,
        created_at=NOW - timedelta(seconds=60),
        updated_at=NOW - timedelta(seconds=30),
        expires_at=NOW + timedelta(seconds=ttl_left),
    )


# ---------------------------------------------------------------------------------- decide


# Every record past its TTL except an execution in flight (IN_PROGRESS, lease live).
EXPIRED_NOT_LIVE = [
    *[(status, lease_left) for status in Status for lease_left in (0.0, -1.0)],
    *[(status, 20.0) for status in Status if status is not Status.IN_PROGRESS],
]


@pytest.mark.parametrize(("status", "lease_left"), EXPIRED_NOT_LIVE)
@pytest.mark.parametrize("request_hash", [REQUEST_HASH, OTHER_HASH], ids=["same", "different"])
@pytest.mark.parametrize("ttl_left", [0.0, -1.0], ids=["expires-now", "expired"])
def test_expired_record_restarts_whatever_it_holds(
    status: Status, request_hash: str, ttl_left: float, lease_left: float
) -> None:
    seen = record(status, lease_left=lease_left, ttl_left=ttl_left)

    assert decide(seen, request_hash=request_hash, now=NOW) is Action.RESTART


@pytest.mark.parametrize(
    ("request_hash", "action"),
    [
        pytest.param(REQUEST_HASH, Action.IN_FLIGHT, id="same-request-in-flight"),
        pytest.param(OTHER_HASH, Action.MISMATCH, id="different-request-mismatch"),
    ],
)
@pytest.mark.parametrize("ttl_left", [0.0, -1.0, -3600.0], ids=["expires-now", "expired", "long"])
@pytest.mark.parametrize("lease_left", [20.0, 0.001], ids=["lease-live", "lease-ending"])
def test_live_execution_is_never_expired(
    request_hash: str, action: Action, ttl_left: float, lease_left: float
) -> None:
    # ttl 8 s and an upstream taking 12 s: a duplicate at 9 s must not execute again.
    seen = record(Status.IN_PROGRESS, lease_left=lease_left, ttl_left=ttl_left)

    assert not seen.is_expired(NOW)
    assert decide(seen, request_hash=request_hash, now=NOW) is action


@pytest.mark.parametrize("status", list(Status))
@pytest.mark.parametrize("lease_left", [20.0, -1.0], ids=["lease-live", "lease-over"])
def test_different_request_is_a_mismatch_in_every_state(status: Status, lease_left: float) -> None:
    seen = record(status, lease_left=lease_left)

    assert decide(seen, request_hash=OTHER_HASH, now=NOW) is Action.MISMATCH


@pytest.mark.parametrize(
    ("status", "lease_left", "action"),
    [
        pytest.param(Status.IN_PROGRESS, 20.0, Action.IN_FLIGHT, id="in-progress-lease-live"),
        pytest.param(Status.IN_PROGRESS, 0.001, Action.IN_FLIGHT, id="in-progress-lease-ending"),
        pytest.param(Status.IN_PROGRESS, 0.0, Action.ABANDONED, id="in-progress-lease-ends-now"),
        pytest.param(Status.IN_PROGRESS, -1.0, Action.ABANDONED, id="in-progress-lease-over"),
        pytest.param(Status.FAILED_RETRYABLE, 20.0, Action.RESTART, id="retryable-lease-live"),
        pytest.param(Status.FAILED_RETRYABLE, -1.0, Action.RESTART, id="retryable-lease-over"),
        pytest.param(Status.SUCCEEDED, 20.0, Action.REPLAY, id="succeeded-lease-live"),
        pytest.param(Status.SUCCEEDED, -1.0, Action.REPLAY, id="succeeded-lease-over"),
        pytest.param(Status.FAILED_FINAL, 20.0, Action.REPLAY, id="failed-final-lease-live"),
        pytest.param(Status.FAILED_FINAL, -1.0, Action.REPLAY, id="failed-final-lease-over"),
    ],
)
def test_same_request_on_a_live_record(status: Status, lease_left: float, action: Action) -> None:
    seen = record(status, lease_left=lease_left)

    assert decide(seen, request_hash=REQUEST_HASH, now=NOW) is action


# -------------------------------------------------------------------------------- classify

FAIL = IdempotencyConfig()
RETRY = IdempotencyConfig(on_ambiguous=OnAmbiguous.RETRY)
POLICIES = [
    pytest.param(FAIL, id="on-ambiguous-fail"),
    pytest.param(RETRY, id="on-ambiguous-retry"),
]


@pytest.mark.parametrize("config", POLICIES)
@pytest.mark.parametrize(
    ("status", "expected"),
    [
        *[(code, Status.SUCCEEDED) for code in (200, 201, 202, 204, 301, 302, 304)],
        *[(code, Status.FAILED_FINAL) for code in (400, 401, 403, 404, 409, 422, 500, 501)],
        *[(code, Status.FAILED_RETRYABLE) for code in (408, 425, 429, 503)],
    ],
)
def test_status_decides_the_state_whatever_the_ambiguity_policy(
    config: IdempotencyConfig, status: int, expected: Status
) -> None:
    assert classify(status, None, config) is expected


# What an ambiguous result leaves behind under each ``on_ambiguous`` policy.
STATE_AFTER_AMBIGUITY = [
    pytest.param(FAIL, Status.FAILED_FINAL, id="on-ambiguous-fail"),
    pytest.param(RETRY, Status.FAILED_RETRYABLE, id="on-ambiguous-retry"),
]


@pytest.mark.parametrize("status", [502, 504])
@pytest.mark.parametrize(("config", "expected"), STATE_AFTER_AMBIGUITY)
def test_ambiguous_status_follows_on_ambiguous(
    status: int, config: IdempotencyConfig, expected: Status
) -> None:
    assert classify(status, None, config) is expected


@pytest.mark.parametrize("config", POLICIES)
@pytest.mark.parametrize("status", [200, 500, 502, 504])
def test_not_executed_outcome_overrides_the_status(config: IdempotencyConfig, status: int) -> None:
    assert classify(status, Outcome.NOT_EXECUTED, config) is Status.FAILED_RETRYABLE


@pytest.mark.parametrize("status", [200, 201, 429, 503])
@pytest.mark.parametrize(("config", "expected"), STATE_AFTER_AMBIGUITY)
def test_ambiguous_outcome_overrides_the_status(
    status: int, config: IdempotencyConfig, expected: Status
) -> None:
    assert classify(status, Outcome.AMBIGUOUS, config) is expected


def custom_outcomes(on_ambiguous: str) -> IdempotencyConfig:
    return IdempotencyConfig.model_validate(
        {
            "on_ambiguous": on_ambiguous,
            "outcomes": {"not_executed": [409, 503], "ambiguous": [500, 520]},
        }
    )


@pytest.mark.parametrize(
    ("on_ambiguous", "status", "expected"),
    [
        ("fail", 409, Status.FAILED_RETRYABLE),
        ("fail", 503, Status.FAILED_RETRYABLE),
        ("fail", 500, Status.FAILED_FINAL),
        ("retry", 500, Status.FAILED_RETRYABLE),
        ("retry", 520, Status.FAILED_RETRYABLE),
        # Replaced, not added to: the defaults no longer apply.
        ("fail", 429, Status.FAILED_FINAL),
        ("retry", 429, Status.FAILED_FINAL),
        ("retry", 502, Status.FAILED_FINAL),
        ("retry", 504, Status.FAILED_FINAL),
        ("retry", 201, Status.SUCCEEDED),
    ],
)
def test_custom_outcomes_replace_the_default_tables(
    on_ambiguous: str, status: int, expected: Status
) -> None:
    assert classify(status, None, custom_outcomes(on_ambiguous)) is expected
