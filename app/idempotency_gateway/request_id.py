"""``X-Request-Id``: kept when the client sends one, generated otherwise.

The id is written into the request headers (so the upstream and problem bodies carry it) and
echoed on the response (by ``AccessLogMiddleware``), so one id follows a request through
every log line.
"""

from __future__ import annotations

import random
import re

from idempotency_gateway.asgi import Scope, first_header

REQUEST_ID_HEADER = b"x-request-id"
# A generator of its own: ids never draw from (or disturb) the process-wide random state
# that the application or its tests may have seeded.
_IDS = random.Random()
# A client-chosen id ends up in logs and upstream headers: accept only a tame shape.
_ACCEPTABLE_ID = re.compile(rb"^[A-Za-z0-9._:-]{1,128}$")


def request_id_of(scope: Scope) -> str | None:
    value = first_header(scope["headers"], REQUEST_ID_HEADER)
    return value.decode("ascii") if value is not None else None


def ensure_request_id(scope: Scope) -> bytes:
    """The request's id: the client's when it is tame, else a new one written into the
    request headers, so the upstream and every problem body carry it."""
    incoming = first_header(scope["headers"], REQUEST_ID_HEADER)
    if incoming is not None and _ACCEPTABLE_ID.match(incoming):
        return incoming
    # An id only has to be unique in practice, not unguessable: no syscall per request.
    request_id = f"{_IDS.getrandbits(128):032x}".encode()
    scope["headers"] = [
        (name, value) for name, value in scope["headers"] if name != REQUEST_ID_HEADER
    ]
    scope["headers"].append((REQUEST_ID_HEADER, request_id))
    return request_id
