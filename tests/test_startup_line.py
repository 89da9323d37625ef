"""The supervisor's startup line names the store and cache without their passwords, whatever
the URL's form: a URL it cannot parse must never stop the gateway from starting."""

from __future__ import annotations

import pytest

from idempotency_gateway.telemetry.startup import without_password


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (
            "postgresql://gateway:s3cret@db.internal:5432/gateway",
            "postgresql://gateway:***@db.internal:5432/gateway",
        ),
        ("redis://:s3cret@127.0.0.1:6379/0", "redis://:***@127.0.0.1:6379/0"),
        (
            "redis+cluster://app:s3cret@10.0.0.1:6379,10.0.0.2:6379",
            "redis+cluster://app:***@10.0.0.1:6379,10.0.0.2:6379",
        ),
        (
            "redis+cluster://10.0.0.1:6379,10.0.0.2:6379",
            "redis+cluster://10.0.0.1:6379,10.0.0.2:6379",
        ),
        (
            "sqlite+aiosqlite:///idempotency-gateway.db",
            "sqlite+aiosqlite:///idempotency-gateway.db",
        ),
        ("postgresql://gateway@db:5432/gateway", "postgresql://gateway@db:5432/gateway"),
    ],
)
def test_passwords_never_reach_the_startup_line(url: str, shown: str) -> None:
    assert without_password(url) == shown
    assert "s3cret" not in without_password(url)
