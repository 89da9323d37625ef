"""A webhook delivery as a keyed request: verified first, then keyed by the sender's own id.

Senders send no ``Idempotency-Key``: the key is their delivery id (a header, or a JSON
Pointer into the body) and the scope their tenant. The signature is checked on the raw bytes
before either is read, so nothing unsigned ever reaches a record, the replay cache or the
upstream: a forger who guesses the next delivery id cannot take it first.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterable, Mapping

import orjson

from idempotency_gateway.asgi import Headers, header_values
from idempotency_gateway.clock import Clock, utc_now
from idempotency_gateway.config import ConfigError, RouteConfig, WebhookConfig
from idempotency_gateway.errors import WebhookDeliveryUnidentified
from idempotency_gateway.idempotency.keys import MAX_KEY_LENGTH, is_key, tenant_scope
from idempotency_gateway.webhooks.pointer import reference_tokens, resolve
from idempotency_gateway.webhooks.signatures import SignatureVerifier, verifier_for


class WebhookReceiver:
    """One webhook route's verifier, delivery id and tenant."""

    def __init__(
        self,
        config: WebhookConfig,
        *,
        route: str,
        environ: Mapping[str, str] = os.environ,
        clock: Clock = utc_now,
    ) -> None:
        self.verifier: SignatureVerifier | None = (
            None
            if config.signature is None
            else verifier_for(config.signature, route=route, environ=environ, clock=clock)
        )
        id_source, tenant = config.delivery_id, config.tenant
        self._delivery_id: Callable[[Headers, bytes], str] = (
            functools.partial(_id_in_header, id_source.header.encode("ascii"))
            if id_source.header is not None
            else functools.partial(_id_in_body, id_source.json_pointer or "")
        )
        self._tenant: Callable[[Headers], bytes] = (
            functools.partial(_one_value, name=tenant.header.encode("ascii"), what="tenant")
            if tenant.header is not None
            else functools.partial(_fixed, (tenant.name or "").encode("ascii"))
        )

    def identify(self, headers: Headers, body: bytes, *, scope_secret: bytes) -> tuple[str, str]:
        """The delivery's key and scope, once its signature verifies on ``body`` as sent."""
        if self.verifier is not None:
            self.verifier.verify(headers, body)
        key = self._delivery_id(headers, body)
        if not is_key(key):
            raise WebhookDeliveryUnidentified(
                f"the delivery id must be 1 to {MAX_KEY_LENGTH} visible ASCII characters"
            )
        return key, tenant_scope(self._tenant(headers), secret=scope_secret)


def _fixed(tenant: bytes, _headers: Headers) -> bytes:
    return tenant


def _one_value(headers: Headers, *, name: bytes, what: str) -> bytes:
    values = [value.strip(b" \t") for value in header_values(headers, name)]
    if len(values) != 1 or not values[0]:
        raise WebhookDeliveryUnidentified(f"the {what} is one non-empty {name.decode()} field")
    return values[0]


def _id_in_header(name: bytes, headers: Headers, _body: bytes) -> str:
    return _one_value(headers, name=name, what="delivery id").decode("latin-1")


def _id_in_body(pointer: str, _headers: Headers, body: bytes) -> str:
    try:
        value = resolve(orjson.loads(body), reference_tokens(pointer))
    except orjson.JSONDecodeError:
        raise WebhookDeliveryUnidentified(
            f"the body is not JSON, so it has no delivery id at {pointer}"
        ) from None
    except LookupError:
        raise WebhookDeliveryUnidentified(f"the body has no delivery id at {pointer}") from None
    # bool is an int to Python, never an id to a sender.
    if isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool)):
        return str(value)
    raise WebhookDeliveryUnidentified(f"the delivery id at {pointer} is no string or integer")


def check_webhook_secrets(
    routes: Iterable[RouteConfig], environ: Mapping[str, str] = os.environ
) -> None:
    """At start, before any worker: one ``ConfigError`` naming every webhook secret missing."""
    errors: list[str] = []
    for route in routes:
        webhook = route.idempotency.webhook
        if webhook is not None:
            try:
                WebhookReceiver(webhook, route=route.name, environ=environ)
            except ConfigError as exc:
                errors.extend(exc.errors)
    if errors:
        raise ConfigError("the environment", errors)
