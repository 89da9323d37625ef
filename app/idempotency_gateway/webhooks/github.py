"""GitHub's ``X-Hub-Signature-256``: ``sha256=`` and the hex HMAC-SHA256 of the raw body.

GitHub signs no timestamp and not its ``X-GitHub-Delivery`` id: a captured delivery verifies
forever, under any id. The record stops it from executing twice only under its own id and
for the record's ttl (docs/CONTRACT.md, Webhooks).
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from idempotency_gateway.asgi import Headers
from idempotency_gateway.errors import WebhookSignatureInvalid
from idempotency_gateway.webhooks.fields import one_field

SIGNATURE_FIELD = b"x-hub-signature-256"


class GitHubSignature:
    def __init__(self, secrets: Sequence[str]):
        self._keys = tuple(secret.encode() for secret in secrets)

    def verify(self, headers: Headers, body: bytes) -> None:
        algorithm, _, sent = one_field(headers, SIGNATURE_FIELD).partition("=")
        if algorithm != "sha256" or not sent:
            raise WebhookSignatureInvalid("x-hub-signature-256 must be sha256=<hex digest>")
        given = sent.lower().encode("ascii")
        for key in self._keys:
            # Constant time: a byte-by-byte compare would tell a forger how much was right.
            if hmac.compare_digest(hmac.new(key, body, hashlib.sha256).hexdigest().encode(), given):
                return
        raise WebhookSignatureInvalid(
            "x-hub-signature-256 does not match the body under this route's secrets"
        )
