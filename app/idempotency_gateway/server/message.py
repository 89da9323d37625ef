"""RFC 9112 rules on a request head that llhttp leaves to the server.

- Only HTTP/1.0 and HTTP/1.1 are spoken here: llhttp also reads a request line with no
  version (HTTP/0.9) or with ``HTTP/2.0``, which this server would answer as HTTP/1.1.
- ``Host`` (section 3.2): an HTTP/1.1 request must carry exactly one, any request at most
  one, and its value must be a host name or IP literal with an optional port of at most five
  digits (no percent-encoding, no sub-delimiters such as ``,``). The gateway passes it
  upstream as ``X-Forwarded-Host``, where applications build links and redirects from it;
  two of them, or one that a framework splits at a comma, leave the gateway and the
  upstream free to read different hosts.
- An absolute-form target (section 3.2.2) names the request's authority itself: it must be
  an ``http`` or ``https`` URI with a valid host and no user information, and it replaces
  ``Host`` for every layer above the server.
- ``Transfer-Encoding`` (section 6.1): a lone ``chunked`` is the only coding read here; any
  other is a 501, since decoding the chunks alone would pass the upstream a gzip body, say,
  as plain bytes. An HTTP/1.0 request carrying the field at all is a 400: HTTP/1.0 has no
  transfer codings, so its framing is faulty (section 6.1), and an HTTP/1.0 intermediary in
  front would have read the chunks llhttp decodes as a body as the next request instead.
"""

from __future__ import annotations

import functools
import re

from idempotency_gateway.asgi import Headers
from idempotency_gateway.errors import MalformedRequest, TransferCodingNotImplemented

_VERSIONS = frozenset({"1.0", "1.1"})
# An IP-literal, or a DNS name or IPv4 address (RFC 3986 reg-name without percent-encoding
# and sub-delimiters), then an optional port.
_HOST = re.compile(rb"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9\-._~]+)(?::([0-9]{1,5}))?")
# RFC 1035: a DNS name is at most 253 characters; IPv6 literals are shorter still.
_MAX_HOST = 253 + len(":65535")
_MAX_PORT = 65535
_SCHEMES = frozenset({b"http", b"https"})
_CHUNKED = b"chunked"


# A connection sends the same Host with every request: its verdict is remembered, bounded so
# that a client sending a new value each time only ever costs the match itself.
@functools.lru_cache(maxsize=256)
def _is_authority(authority: bytes) -> bool:
    match = _HOST.fullmatch(authority)
    return match is not None and (match.group(1) is None or int(match.group(1)) <= _MAX_PORT)


def _check_authority(authority: bytes, what: str) -> None:
    # An over-long value is refused before the cache: it would only take up room there.
    if len(authority) > _MAX_HOST or not _is_authority(authority):
        raise MalformedRequest(f"{what} is not a host with an optional port (0 to {_MAX_PORT})")


def absolute_form(method: bytes, target: bytes) -> tuple[bytes, bytes] | None:
    """The authority of an absolute-form target (``http://host:port/path``) and the target
    with its path made explicit (an empty one is ``/``, RFC 9112 section 3.2.2); ``None``
    for any other form, ``MalformedRequest`` for one the gateway does not serve."""
    scheme, separator, rest = target.partition(b"://")
    if not separator or b"/" in scheme:
        return None
    if scheme.lower() not in _SCHEMES:
        raise MalformedRequest("an absolute request target must be an http or https URI")
    authority = re.split(rb"[/?#]", rest, maxsplit=1)[0]
    if b"@" in authority:
        raise MalformedRequest("the request target holds user information (user@host)")
    _check_authority(authority, "the request target's authority")
    after = rest[len(authority) :]
    if not after.startswith(b"/"):
        if method == b"OPTIONS":
            # Section 3.2.4: this names the server itself, as OPTIONS * does, not /.
            raise MalformedRequest("OPTIONS for the server itself (*) is not served here")
        target = scheme + separator + authority + b"/" + after
    return authority, target


def _check_transfer_coding(values: list[bytes]) -> None:
    """Only the one spelling llhttp frames as chunked passes: the parser reads codings
    leniently (so that this check sees them all) and would take anything else, ``chunked,``
    included, as a body delimited by the connection's close."""
    if len(values) == 1 and values[0].strip(b" \t").lower() == _CHUNKED:
        return
    codings = {token.strip(b" \t").lower() for value in values for token in value.split(b",")}
    unknown = sorted(codings - {_CHUNKED, b""})
    if unknown:
        raise TransferCodingNotImplemented(
            f"the request's transfer coding {unknown[0].decode('latin-1')!r} is not "
            "implemented here: send the body with Content-Length or a lone chunked coding"
        )
    raise MalformedRequest("Transfer-Encoding must be chunked alone, in one field")


def check_request_head(version: str, headers: Headers) -> None:
    """Raise ``MalformedRequest`` for a head this server must refuse with a 400, and
    ``TransferCodingNotImplemented`` for one whose body it cannot read."""
    if version not in _VERSIONS:
        raise MalformedRequest(f"HTTP/{version} is not spoken here; send HTTP/1.1")
    hosts: list[bytes] = []
    codings: list[bytes] = []
    for name, value in headers:
        if name == b"host":
            hosts.append(value)
        elif name == b"transfer-encoding":
            codings.append(value)
    if codings:
        if version == "1.0":
            raise MalformedRequest(
                "an HTTP/1.0 request has no transfer codings: send its body with Content-Length"
            )
        _check_transfer_coding(codings)
    if len(hosts) > 1:
        raise MalformedRequest("the request has more than one Host field")
    if not hosts:
        if version == "1.1":
            raise MalformedRequest("an HTTP/1.1 request must carry a Host field")
        return
    # An empty value is what a client sends for a target without an authority.
    if hosts[0]:
        _check_authority(hosts[0], "the Host field")
