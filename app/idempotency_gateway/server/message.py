"""RFC 9112 rules on a request head that llhttp leaves to the server.

- Only HTTP/1.0 and HTTP/1.1 are spoken here: llhttp also reads a request line with no
  version (HTTP/0.9) or with ``HTTP/2.0``, which this server would answer as HTTP/1.1.
- ``Host`` (section 3.2): an HTTP/1.1 request must carry exactly one, any request at most
  one, and its value must be an authority (``host[:port]``). The gateway passes it upstream
  as ``X-Forwarded-Host``, where applications build links and redirects from it; two of them
  leave the gateway and the upstream free to read different ones.
"""

from __future__ import annotations

import re

from idempotency_gateway.asgi import Headers
from idempotency_gateway.errors import MalformedRequest

_VERSIONS = frozenset({"1.0", "1.1"})
# RFC 3986 authority without userinfo: an IP-literal or a reg-name/IPv4, then an optional port.
_HOST = re.compile(rb"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9\-._~!$&'()*+,;=%]*)(?::[0-9]*)?")


def check_request_head(version: str, headers: Headers) -> None:
    """Raise ``MalformedRequest`` for a head this server must refuse with a 400."""
    if version not in _VERSIONS:
        raise MalformedRequest(f"HTTP/{version} is not spoken here; send HTTP/1.1")
    hosts = [value for name, value in headers if name == b"host"]
    if len(hosts) > 1:
        raise MalformedRequest("the request has more than one Host field")
    if not hosts:
        if version == "1.1":
            raise MalformedRequest("an HTTP/1.1 request must carry a Host field")
        return
    if _HOST.fullmatch(hosts[0]) is None:
        raise MalformedRequest("the Host field is not a host with an optional port")
