"""Signing deliveries as each sender does, with the senders' own code where there is one.

Standard Webhooks by ``standardwebhooks``' ``Webhook.sign``; Stripe as its docs spell the
scheme (``tests/test_webhooks.py`` proves ``stripe.Webhook.construct_event`` accepts the same
header); GitHub as its docs do, checked against their published test vector.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
from datetime import UTC, datetime

from standardwebhooks.webhooks import Webhook

STANDARD_SECRET = "whsec_" + base64.b64encode(b"standard-webhooks-test-secret!!").decode()
STANDARD_OLD_SECRET = "whsec_" + base64.b64encode(b"the-secret-being-rotated-out!!!").decode()
STRIPE_SECRET = "whsec_stripe_test_secret_0123456789"
# GitHub's documented test vector: this secret signs "Hello, World!" as GITHUB_VECTOR.
GITHUB_SECRET = "It's a Secret to Everybody"
GITHUB_PAYLOAD = b"Hello, World!"
GITHUB_VECTOR = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"


def unix_now() -> int:
    return int(datetime.now(UTC).timestamp())


def standard_headers(
    secret: str, delivery_id: str, body: bytes, *, at: int | None = None
) -> dict[str, str]:
    signed_at = unix_now() if at is None else at
    signature = Webhook(secret).sign(
        delivery_id, datetime.fromtimestamp(signed_at, UTC), body.decode()
    )
    return {
        "webhook-id": delivery_id,
        "webhook-timestamp": str(signed_at),
        "webhook-signature": signature,
        "content-type": "application/json",
    }


def stripe_signature(secret: str, body: bytes, *, at: int | None = None) -> str:
    """``t=<time>,v1=<HMAC-SHA256 of "<time>." + body>``, as Stripe's docs describe it."""
    signed_at = unix_now() if at is None else at
    signed = f"{signed_at}.".encode() + body
    return f"t={signed_at},v1={hmac.new(secret.encode(), signed, hashlib.sha256).hexdigest()}"


def github_signature(secret: str, body: bytes) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
