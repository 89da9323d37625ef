"""What every signature scheme reads: exactly one header field, and a signing time that lies
within the scheme's tolerance of the gateway's clock."""

from __future__ import annotations

from datetime import datetime

from idempotency_gateway.asgi import Headers, header_values
from idempotency_gateway.errors import WebhookSignatureInvalid

# Seconds since the epoch fit in 12 digits until the year 33658; more is no timestamp.
_MAX_TIMESTAMP_DIGITS = 12


def one_field(headers: Headers, name: bytes) -> str:
    """The one value of ``name``; missing, repeated or non-ASCII is no signature at all."""
    values = header_values(headers, name)
    shown = name.decode("ascii")
    if not values:
        raise WebhookSignatureInvalid(f"no {shown} field: this route takes signed deliveries only")
    if len(values) > 1:
        # Two fields would leave it to each reader which one counts.
        raise WebhookSignatureInvalid(f"send exactly one {shown} field")
    try:
        return values[0].decode("ascii").strip(" \t")
    except UnicodeDecodeError:
        raise WebhookSignatureInvalid(f"the {shown} field is not ASCII") from None


def check_timestamp(sent: str, *, tolerance: float, now: datetime) -> None:
    """Refuses a signature made longer ago than ``tolerance`` (a captured delivery sent
    again) or further ahead (a sender whose clock is off, or a signature made to last)."""
    if not (sent.isascii() and sent.isdigit() and len(sent) <= _MAX_TIMESTAMP_DIGITS):
        raise WebhookSignatureInvalid("the signature's timestamp is not seconds since the epoch")
    age = now.timestamp() - int(sent)
    window = f"this route accepts signatures made within {tolerance:g} s of its clock"
    if age > tolerance:
        raise WebhookSignatureInvalid(f"the signature was made {age:.0f} s ago; {window}")
    if -age > tolerance:
        raise WebhookSignatureInvalid(f"the signature is dated {-age:.0f} s ahead; {window}")
