"""A route's signature verifier, built once at start from its config and the environment.

A secret lives in the environment only, named by the config; a variable that is unset or
empty stops the gateway at start (an empty HMAC key is one anyone can sign with). Errors name
the variable, never its value.
"""

from __future__ import annotations

import binascii
from collections.abc import Mapping
from typing import Protocol

from standardwebhooks.webhooks import EmptyWebhookSecretError

from idempotency_gateway.asgi import Headers
from idempotency_gateway.clock import Clock, utc_now
from idempotency_gateway.config import (
    SCHEME_TOLERANCE,
    ConfigError,
    SignatureConfig,
    SignatureScheme,
)
from idempotency_gateway.webhooks.github import GitHubSignature
from idempotency_gateway.webhooks.standard import StandardWebhooksSignature
from idempotency_gateway.webhooks.stripe import StripeSignature


class SignatureVerifier(Protocol):
    def verify(self, headers: Headers, body: bytes) -> None:
        """Returns when the sender signed ``body`` (and the headers the scheme signs);
        raises ``WebhookSignatureInvalid`` otherwise."""


def verifier_for(
    config: SignatureConfig, *, route: str, environ: Mapping[str, str], clock: Clock = utc_now
) -> SignatureVerifier:
    """``ConfigError`` naming every secret variable of ``route`` that is unset or unusable."""
    missing = [name for name in config.secrets if not environ.get(name)]
    if missing:
        raise ConfigError(
            "the environment",
            [f"{name} is not set (a webhook secret of the route {route!r})" for name in missing],
        )
    secrets = [environ[name] for name in config.secrets]
    if config.scheme is SignatureScheme.GITHUB:
        return GitHubSignature(secrets)
    tolerance = SCHEME_TOLERANCE[config.scheme] if config.tolerance is None else config.tolerance
    if config.scheme is SignatureScheme.STRIPE:
        return StripeSignature(secrets, tolerance=tolerance, clock=clock)
    try:
        return StandardWebhooksSignature(secrets, tolerance=tolerance, clock=clock)
    except (binascii.Error, EmptyWebhookSecretError):
        names = ", ".join(config.secrets)
        raise ConfigError(
            "the environment",
            [f"{names}: a Standard Webhooks secret is whsec_ then base64 (route {route!r})"],
        ) from None
