"""The Standard Webhooks scheme (``webhook-id``, ``webhook-timestamp``, ``webhook-signature``),
verified by the ``standardwebhooks`` package: the scheme's own code, not a second reading."""

from __future__ import annotations

from collections.abc import Sequence

from standardwebhooks.webhooks import Webhook, WebhookVerificationError

from idempotency_gateway.asgi import Headers
from idempotency_gateway.clock import Clock, utc_now
from idempotency_gateway.errors import WebhookSignatureInvalid
from idempotency_gateway.webhooks.fields import check_timestamp, one_field

SIGNED_FIELDS = ("webhook-id", "webhook-timestamp", "webhook-signature")


class StandardWebhooksSignature:
    def __init__(self, secrets: Sequence[str], *, tolerance: float, clock: Clock = utc_now):
        # Decoded here, so a secret that is not ``whsec_`` and base64 fails at start.
        self._webhooks = tuple(Webhook(secret) for secret in secrets)
        self._tolerance = tolerance
        self._clock = clock

    def verify(self, headers: Headers, body: bytes) -> None:
        fields = {name: one_field(headers, name.encode("ascii")) for name in SIGNED_FIELDS}
        # The package holds its own 5-minute window on the wall clock; a route's shorter one
        # is held here, on the gateway's clock.
        check_timestamp(fields["webhook-timestamp"], tolerance=self._tolerance, now=self._clock())
        for webhook in self._webhooks:
            try:
                webhook.verify(body, fields, json_parse=False)
            # ValueError: a signature that is not "v1,<base64>", a body that is not UTF-8.
            except (WebhookVerificationError, ValueError):
                continue
            return
        raise WebhookSignatureInvalid(
            "no signature in webhook-signature matches the id, timestamp and body "
            "under this route's secrets"
        )
