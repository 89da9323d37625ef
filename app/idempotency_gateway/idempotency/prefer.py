"""``Prefer: wait=N`` (RFC 7240): how long a duplicate is willing to wait for the owner."""

from __future__ import annotations

from idempotency_gateway.asgi import Headers, header_values


def requested_wait(headers: Headers) -> int | None:
    """Seconds asked for by ``Prefer: wait=N``; ``None`` when absent or malformed."""
    for value in header_values(headers, b"prefer"):
        for preference in value.split(b","):
            name, _, argument = preference.strip().partition(b"=")
            if name.strip().lower() != b"wait":
                continue
            # RFC 7240 allows a quoted value and parameters after ";".
            seconds = argument.split(b";", 1)[0].strip().strip(b'"')
            if seconds.isdigit():
                return int(seconds)
            return None
    return None
