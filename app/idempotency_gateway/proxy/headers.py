"""RFC 9110 intermediary rules for the fields a proxy forwards and answers with."""

from __future__ import annotations

from ipaddress import IPv4Network, IPv6Network, ip_address

from idempotency_gateway.asgi import Headers, Scope, first_header, header_values
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
# Written by the gateway (or by aiohttp for the upstream connection), never
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


def _via_value(existing: bytes | None, http_version: str) -> bytes:
    via = http_version.encode() + b" " + VIA_PSEUDONYM
    return via if existing is None else existing + b", " + via


def _with_via(headers: Headers, http_version: str) -> Headers:
    existing = first_header(headers, b"via")
    kept = [(name, value) for name, value in headers if name != b"via"]
    return [*kept, (b"via", _via_value(existing, http_version))]


def _is_trusted(client_host: str | None, trusted: TrustedProxies) -> bool:
    if client_host is None or not trusted:
        return False
    try:
        address = ip_address(client_host)
    except ValueError:
        return False
    return any(address in network for network in trusted)


def _gateway_fields(scope: Scope, key_header: bytes) -> Headers:
    """The idempotency key of record, its fencing token and the request id: what the upstream
    dedupes and correlates on, so no ``Connection`` option of the client's may remove them."""
    incoming: Headers = scope["headers"]
    fields = [(key_header, value) for value in header_values(incoming, key_header)]
    execution = execution_of(scope)
    if execution is not None:
        fields.append((FENCING_TOKEN_HEADER, str(execution.fencing_token).encode()))
    request_id = first_header(incoming, REQUEST_ID_HEADER)
    if request_id is not None:
        fields.append((REQUEST_ID_HEADER, request_id))
    return fields


def upstream_request_headers(
    scope: Scope, *, key_header: bytes, trusted_proxies: TrustedProxies, timeout_seconds: float
) -> list[tuple[str, str]]:
    """The fields sent upstream: the client's end-to-end ones, then the gateway's own (key,
    fencing token, request id, ``Via``, ``X-Forwarded-*``, the budget).

    ``key_header`` is the lower-case name of the idempotency key field. Hop-by-hop removal
    applies to the client's fields only, before the gateway adds its own."""
    incoming: Headers = scope["headers"]
    client = scope.get("client")
    client_host = client[0] if client else None
    trusted = _is_trusted(client_host, trusted_proxies)
    gateway_written = _GATEWAY_WRITTEN | {key_header}
    forwarded = [
        (name, value) for name, value in end_to_end(incoming) if name not in gateway_written
    ]
    forwarded.extend(_gateway_fields(scope, key_header))
    http_version = scope.get("http_version", "1.1")
    forwarded.append((b"via", _via_value(first_header(incoming, b"via"), http_version)))

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
    # Spring and ASP.NET prepend it to the request path: only a trusted proxy may say it.
    prefix = first_header(incoming, b"x-forwarded-prefix") if trusted else None
    if prefix is not None:
        forwarded.append((b"x-forwarded-prefix", prefix))
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
