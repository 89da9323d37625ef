"""Stripe's ``Stripe-Signature``: ``t=<unix time>,v1=<hex>[,v1=<hex>...]``, each ``v1`` an
HMAC-SHA256 of ``"<t>." + body`` (several while Stripe rolls a secret). Stripe's SDK refuses
only old timestamps; this refuses ones too far ahead as well."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence

from idempotency_gateway.asgi import Headers
from idempotency_gateway.clock import Clock, utc_now
from idempotency_gateway.errors import WebhookSignatureInvalid
from idempotency_gateway.webhooks.fields import check_timestamp, one_field

SIGNATURE_FIELD = b"stripe-signature"


class StripeSignature:
    def __init__(self, secrets: Sequence[str], *, tolerance: float, clock: Clock = utc_now):
        # Stripe keys the HMAC with the whole secret as written, ``whsec_`` included.
        self._keys = tuple(secret.encode() for secret in secrets)
        self._tolerance = tolerance
        self._clock = clock

    def verify(self, headers: Headers, body: bytes) -> None:
        timestamps: list[str] = []
        signatures: list[bytes] = []
        for item in one_field(headers, SIGNATURE_FIELD).split(","):
            name, _, value = item.strip().partition("=")
            if name == "t":
                timestamps.append(value)
            elif name == "v1":
                signatures.append(value.lower().encode("ascii"))
        if len(timestamps) != 1 or not signatures:
            raise WebhookSignatureInvalid("stripe-signature must carry one t= and a v1=")
        check_timestamp(timestamps[0], tolerance=self._tolerance, now=self._clock())
        signed = timestamps[0].encode("ascii") + b"." + body
        for key in self._keys:
            expected = hmac.new(key, signed, hashlib.sha256).hexdigest().encode()
            if any(hmac.compare_digest(expected, signature) for signature in signatures):
                return
        raise WebhookSignatureInvalid(
            "no v1 signature in stripe-signature matches the timestamp and body "
            "under this route's secrets"
        )
