"""``Prefer: wait=N`` (RFC 7240): how long a duplicate is willing to wait for the owner."""

from __future__ import annotations

from idempotency_gateway.asgi import Headers, header_values

_MAX_DIGITS = 9


def requested_wait(headers: Headers) -> int | None:
    """Seconds asked for by ``Prefer: wait=N``; ``None`` when absent or malformed."""
    for value in header_values(headers, b"prefer"):
        for preference in value.split(b","):
            name, _, argument = preference.strip().partition(b"=")
            if name.strip().lower() != b"wait":
                continue
            # RFC 7240 allows a quoted value and parameters after ";".
            seconds = argument.split(b";", 1)[0].strip().strip(b'"')
            if not seconds.isdigit():
                return None
            # Any route caps the wait far below this; a longer number (Python refuses to
            # convert one over 4300 digits) asks for no more than the cap either.
            seconds = seconds.lstrip(b"0") or b"0"
            return int(seconds) if len(seconds) <= _MAX_DIGITS else 10**_MAX_DIGITS
    return None
