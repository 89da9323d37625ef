"""Full-jitter exponential backoff and ``Retry-After`` parsing.

Full jitter (``uniform(0, min(cap, base * 2**n))``) spreads the retries of many clients over
the whole window instead of synchronising them into waves (the AWS Architecture Blog's
"Exponential Backoff And Jitter" measured it as the cheapest of the schemes).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime

from idempotency_gateway.clock import utc_now


def full_jitter(
    attempt: int,
    *,
    base: float,
    cap: float,
    uniform: Callable[[float, float], float] = random.uniform,
) -> float:
    """The pause before retry number ``attempt`` (0 for the first retry)."""
    ceiling = min(cap, base * 2 ** min(attempt, 62))
    return uniform(0.0, ceiling)


def pause_before_retry(
    attempt: int,
    *,
    retry_after: float | None,
    base: float,
    cap: float,
    uniform: Callable[[float, float], float] = random.uniform,
) -> float:
    """The pause before retry number ``attempt`` (1 for the first): the server's own
    ``Retry-After`` when it sent one, else full jitter. Callers check it fits the deadline."""
    delay = full_jitter(attempt - 1, base=base, cap=cap, uniform=uniform)
    return delay if retry_after is None else retry_after


def parse_retry_after(value: str | None, *, now: datetime | None = None) -> float | None:
    """Seconds from ``Retry-After``: delay-seconds or an HTTP-date (RFC 9110 section 10.2.3)."""
    if value is None:
        return None
    value = value.strip()
    # isdigit() alone also accepts digits such as "\u00b2" that float() rejects.
    if value.isascii() and value.isdigit():
        return float(value)
    try:
        moment = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return max(0.0, (moment - (now or utc_now())).total_seconds())
