"""Request bodies at the gateway's limits, shared by the stall benchmark and its test."""

from __future__ import annotations

# The gateway's default ``limits.max_request_body``.
MAX_BODY = 10 * 1024 * 1024


def numbers(size: int) -> bytes:
    """A JSON array of at most ``size`` bytes, every value a decimal number (9 bytes each):
    the most values, so the most work, a canonical form can meet in that many bytes."""
    count = (size - 1) // 9
    return b"[" + b",".join(b"%d.5" % (100_000 + index % 900_000) for index in range(count)) + b"]"
