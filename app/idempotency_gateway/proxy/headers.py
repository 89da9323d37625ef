"""RFC 9110 intermediary rules for the fields a proxy forwards and answers with."""

from __future__ import annotations

from ipaddress import IPv4Network, IPv6Network, ip_address

from idempotency_gateway.asgi import Headers, Scope, first_header

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
# Set by the client library or recomputed for the upstream connection, never copied over.
_REWRITTEN = frozenset({b"host", b"content-length", b"x-forwarded-for", b"x-forwarded-proto"})
_REWRITTEN |= {b"x-forwarded-host", b"x-request-timeout"}

TrustedProxies = tuple[IPv4Network | IPv6Network, ...]


def _connection_named(headers: Headers) -> set[bytes]:
    """Fields the sender marked as hop-by-hop by naming them in ``Connection``."""
    named: set[bytes] = set()
    for name, value in headers:
        if name == b"connection":
            named.update(token.strip().lower() for token in value.split(b","))
    return named


def end_to_end(headers: Headers) -> Headers:
    named = _connection_named(headers)
    dropped = HOP_BY_HOP | named if named else HOP_BY_HOP
    return [(name, value) for name, value in headers if name.lower() not in dropped]


def _with_via(headers: Headers, http_version: str) -> Headers:
    via = http_version.encode() + b" " + VIA_PSEUDONYM
    existing = first_header(headers, b"via")
    if existing is None:
        return [*headers, (b"via", via)]
    return [(name, value) for name, value in headers if name != b"via"] + [
        (b"via", existing + b", " + via)
    ]


def _is_trusted(client_host: str | None, trusted: TrustedProxies) -> bool:
    if client_host is None or not trusted:
        return False
    try:
        address = ip_address(client_host)
    except ValueError:
        return False
    return any(address in network for network in trusted)


def upstream_request_headers(
    scope: Scope, *, trusted_proxies: TrustedProxies, timeout_seconds: float
) -> list[tuple[str, str]]:
    """The fields sent upstream: end-to-end ones, ``Via``, ``X-Forwarded-*`` and the budget."""
    incoming: Headers = scope["headers"]
    client = scope.get("client")
    client_host = client[0] if client else None
    trusted = _is_trusted(client_host, trusted_proxies)
    forwarded = [(name, value) for name, value in end_to_end(incoming) if name not in _REWRITTEN]
    forwarded = _with_via(forwarded, scope.get("http_version", "1.1"))

    # Incoming X-Forwarded-* are believed only from proxies we were told to trust: anyone
    # else could claim any address.
    prior_for = first_header(incoming, b"x-forwarded-for") if trusted else None
    if client_host is not None:
        chain = (
            client_host.encode() if prior_for is None else prior_for + b", " + client_host.encode()
        )
        forwarded.append((b"x-forwarded-for", chain))
    proto = first_header(incoming, b"x-forwarded-proto") if trusted else None
    forwarded.append((b"x-forwarded-proto", proto or scope.get("scheme", "http").encode()))
    host = (first_header(incoming, b"x-forwarded-host") if trusted else None) or first_header(
        incoming, b"host"
    )
    if host is not None:
        forwarded.append((b"x-forwarded-host", host))
    forwarded.append((b"x-request-timeout", f"{timeout_seconds:.3f}".encode()))
    return [(name.decode("latin-1"), _header_text(value)) for name, value in forwarded]


def _header_text(value: bytes) -> str:
    """aiohttp writes header values as UTF-8: decoding UTF-8 here forwards such bytes exactly
    (the usual non-ASCII case); other bytes can only go on as their latin-1 reading."""
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError:
        return value.decode("latin-1")


# The gateway's server writes its own Date; two Date fields would confuse caches.
_SERVER_WRITTEN = frozenset({b"date"})


def client_response_headers(raw: Headers, http_version: str) -> Headers:
    """The upstream's answer as the client gets it: end-to-end fields plus ``Via``."""
    kept = [
        (name.lower(), value)
        for name, value in end_to_end(raw)
        if name.lower() not in _SERVER_WRITTEN
    ]
    return _with_via(kept, http_version)
