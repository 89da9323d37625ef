"""RFC 9110 intermediary rules for the fields a proxy forwards and answers with."""

from __future__ import annotations

import functools
from ipaddress import IPv4Network, IPv6Network, ip_address

from idempotency_gateway.asgi import Headers, Scope
from idempotency_gateway.execution import FENCING_TOKEN_HEADER, execution_of
from idempotency_gateway.request_id import REQUEST_ID_HEADER

# RFC 9110 section 7.6.1: meaningful for one connection only, never forwarded.
HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-connection",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
    }
)
VIA_PSEUDONYM = b"idempotency-gateway"
# Written by the gateway (or by its client for the upstream connection), never
# copied over from the client: a client must neither forge nor remove them.
_GATEWAY_WRITTEN = frozenset(
    {
        b"host",
        b"content-length",
        b"via",
        b"x-forwarded-for",
        b"x-forwarded-proto",
        b"x-forwarded-host",
        b"x-forwarded-prefix",
        b"x-request-timeout",
        b"x-request-id",
        FENCING_TOKEN_HEADER,
    }
)

TrustedProxies = tuple[IPv4Network | IPv6Network, ...]


def _connection_tokens(value: bytes) -> set[bytes]:
    """Fields the sender marked as hop-by-hop by naming them in ``Connection``."""
    return {token.strip().lower() for token in value.split(b",")}


def _via_value(existing: bytes | None, http_version: str) -> bytes:
    via = http_version.encode() + b" " + VIA_PSEUDONYM
    return via if existing is None else existing + b", " + via


def _is_trusted(client_host: str | None, trusted: TrustedProxies) -> bool:
    if client_host is None or not trusted:
        return False
    try:
        address = ip_address(client_host)
    except ValueError:
        return False
    return any(address in network for network in trusted)


@functools.lru_cache(maxsize=8)
def _not_copied(key_header: bytes) -> frozenset[bytes]:
    """Request fields the client's copy of is never forwarded as is: hop-by-hop ones and
    the gateway's own, the key included (built once per key field name, not per request)."""
    return HOP_BY_HOP | _GATEWAY_WRITTEN | {key_header}


def upstream_request_headers(
    scope: Scope, *, key_header: bytes, trusted_proxies: TrustedProxies, timeout_seconds: float
) -> Headers:
    """The fields sent upstream: the client's end-to-end ones, then the gateway's own (key,
    fencing token, request id, ``Via``, ``X-Forwarded-*``, the budget), as bytes: the
    client's go on byte for byte, whatever their encoding.

    ``key_header`` is the lower-case name of the idempotency key field. Hop-by-hop removal
    applies to the client's fields only, before the gateway adds its own. One pass over the
    client's fields finds both what is forwarded and what the gateway's fields are built from.
    """
    not_copied = _not_copied(key_header)
    forwarded: Headers = []
    keys: Headers = []
    # The first value of each field the gateway's own fields are built from.
    firsts: dict[bytes, bytes] = {}
    named: set[bytes] = set()
    for name, value in scope["headers"]:
        if name.lower() not in not_copied:
            forwarded.append((name, value))
            continue
        if name == key_header:
            # The key of record, and the fields below: no Connection option may remove them.
            keys.append((key_header, value))
        elif name == b"connection":
            named |= _connection_tokens(value)
        firsts.setdefault(name, value)
    if named:
        forwarded = [(name, value) for name, value in forwarded if name.lower() not in named]
    forwarded.extend(keys)
    execution = execution_of(scope)
    if execution is not None:
        forwarded.append((FENCING_TOKEN_HEADER, str(execution.fencing_token).encode()))
    request_id = firsts.get(REQUEST_ID_HEADER)
    if request_id is not None:
        forwarded.append((REQUEST_ID_HEADER, request_id))
    http_version = scope.get("http_version", "1.1")
    forwarded.append((b"via", _via_value(firsts.get(b"via"), http_version)))

    client = scope.get("client")
    client_host = client[0] if client else None
    # Incoming X-Forwarded-* are believed only from proxies we were told to trust: anyone
    # else could claim any address.
    trusted = _is_trusted(client_host, trusted_proxies)
    prior_for = firsts.get(b"x-forwarded-for") if trusted else None
    if client_host is not None:
        chain = (
            client_host.encode() if prior_for is None else prior_for + b", " + client_host.encode()
        )
        forwarded.append((b"x-forwarded-for", chain))
    proto = firsts.get(b"x-forwarded-proto") if trusted else None
    forwarded.append((b"x-forwarded-proto", proto or scope.get("scheme", "http").encode()))
    host = (firsts.get(b"x-forwarded-host") if trusted else None) or firsts.get(b"host")
    if host:  # an empty Host (a target without an authority) names no host
        forwarded.append((b"x-forwarded-host", host))
    # Spring and ASP.NET prepend it to the request path: only a trusted proxy may say it.
    prefix = firsts.get(b"x-forwarded-prefix") if trusted else None
    if prefix is not None:
        forwarded.append((b"x-forwarded-prefix", prefix))
    forwarded.append((b"x-request-timeout", f"{timeout_seconds:.3f}".encode()))
    return forwarded


# The gateway's server writes its own Date (two Date fields would confuse caches), and its
# own Via, which carries the upstream's on.
_NOT_RELAYED = HOP_BY_HOP | {b"date", b"via"}


# Answers that never have a body, whatever their fields say (RFC 9110 sections 15.3.5, 15.4.5).
_WITHOUT_CONTENT = frozenset({204, 304})


def client_response_headers(raw: Headers, http_version: str, *, status: int) -> Headers:
    """The upstream's answer as the client gets it: end-to-end fields plus ``Via``, in one
    pass over the upstream's fields.

    A 304 may carry the Content-Length of the representation it stands for (RFC 9110 section
    8.6), but the server holds an answer to that field's length and, with no body to send,
    would break the connection (the next pipelined request too): a 204 or 304 goes without it.
    """
    kept: Headers = []
    via: bytes | None = None
    named: set[bytes] = set()
    without_length = status in _WITHOUT_CONTENT
    for name, value in raw:
        name = name.lower()
        if name not in _NOT_RELAYED:
            if not (without_length and name == b"content-length"):
                kept.append((name, value))
        elif name == b"connection":
            named |= _connection_tokens(value)
        elif name == b"via" and via is None:
            via = value
    if named:
        kept = [(name, value) for name, value in kept if name not in named]
        if b"via" in named:
            via = None
    kept.append((b"via", _via_value(via, http_version)))
    return kept
