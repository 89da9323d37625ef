"""The request target in its one canonical form: what routing, the idempotency policy, the
operation, the fingerprint and the upstream all see (rules and reasons: docs/paths.md).

Only origin-form targets (a path starting with ``/``) are accepted. The path is normalized
(RFC 3986 section 6: percent-encoded unreserved characters decoded, other percent-encodings
in upper-case hex, dot segments removed, repeated slashes merged) and kept as ASCII bytes:
an octet that is not valid UTF-8 stays percent-encoded, so ``%ff`` and ``%fe`` stay two
paths. Forms that upstreams read in different ways (``%2F``, ``\\``, ``%5C``, ``..;``)
are refused rather than guessed at.

The canonical target is computed once per request and kept in the ASGI scope, with the
route the gateway matched for it; every layer reads it with ``target_of``.
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import quote, unquote

from idempotency_gateway.asgi import Headers, Scope, Send
from idempotency_gateway.config import RouteConfig
from idempotency_gateway.errors import InvalidRequestTarget
from idempotency_gateway.problems import send_problem
from idempotency_gateway.request_id import request_id_of

STATE_KEY = "request_target"

_UNRESERVED = frozenset((string.ascii_letters + string.digits + "-._~").encode())
# RFC 3986 pchar: unreserved, sub-delims, ":" and "@", or a percent-encoded octet.
_SEGMENT = re.compile(rb"(?:[A-Za-z0-9\-._~!$&'()*+,;=:@]|%[0-9A-Fa-f]{2})*")
_PERCENT_ENCODED = re.compile(rb"%([0-9A-Fa-f]{2})")
# Octets that would change the path's structure if an upstream decoded them (a slash or a
# backslash splitting a segment), or that truncate it (NUL ends a C string; PostgreSQL text
# cannot hold it).
_REFUSED_OCTETS = {0x2F: "%2F (an encoded slash)", 0x5C: "%5C (an encoded backslash)", 0x00: "%00"}
_DOT_SEGMENTS = (b".", b"..")
# Fields that frameworks behind a proxy obey as the request's real target (IIS, Symfony,
# Zend) or method (Express, Rails, Laravel, Spring, ASP.NET). The gateway would route, protect
# and fingerprint one request while the upstream executed another: an unkeyed GET naming POST
# in X-HTTP-Method-Override would run a POST unprotected, and be retried as a safe GET.
_TARGET_OVERRIDES = frozenset(
    {
        b"x-original-url",
        b"x-rewrite-url",
        b"x-http-method-override",
        b"x-http-method",
        b"x-method-override",
    }
)

# A path that is already canonical: non-empty segments of pchar without "%", none of them a
# dot segment (with or without ";" parameters), an optional trailing slash. Most requests
# arrive like this; they skip the segment-by-segment rewrite, which would return them as is.
_ALREADY_CANONICAL = re.compile(rb"/|(?:/(?!\.\.?(?:[/;]|$))[A-Za-z0-9\-._~!$&'()*+,;=:@]+)+/?")


@dataclass(frozen=True, slots=True)
class RequestTarget:
    path: bytes
    """Canonical, ASCII only."""
    query: bytes
    """As the client sent it: it never decides routing, policy or where the request goes."""
    route: RouteConfig | None = None
    """The gateway's route for ``path``; ``None`` when nothing matched or outside the gateway."""

    @property
    def path_text(self) -> str:
        return self.path.decode("ascii")


RouteFinder = Callable[[str], RouteConfig | None]
"""The route for a canonical path, ``None`` when nothing matches."""


def _normalized_octet(match: re.Match[bytes]) -> bytes:
    octet = int(match.group(1), 16)
    refused = _REFUSED_OCTETS.get(octet)
    if refused is not None:
        raise InvalidRequestTarget(f"the path holds {refused}, which upstreams read differently")
    if octet in _UNRESERVED:
        return bytes([octet])
    return b"%" + match.group(1).upper()


def _normalized_segment(segment: bytes) -> bytes:
    if _SEGMENT.fullmatch(segment) is None:
        if b"\\" in segment:
            raise InvalidRequestTarget("the path holds a backslash, which some servers read as /")
        raise InvalidRequestTarget(
            "the path holds a character that must be percent-encoded, or a malformed %-escape"
        )
    if b"%" in segment:
        segment = _PERCENT_ENCODED.sub(_normalized_octet, segment)
    if segment not in _DOT_SEGMENTS and segment.split(b";", 1)[0] in _DOT_SEGMENTS:
        # Servlet containers read "..;x" as "..": it would climb out of the route upstream.
        raise InvalidRequestTarget("the path holds a dot segment with parameters (..;)")
    return segment


def canonical_path(raw: bytes) -> bytes:
    """The canonical form of an origin-form path, or ``InvalidRequestTarget``."""
    if _ALREADY_CANONICAL.fullmatch(raw) is not None:
        return raw
    return rewritten_path(raw)


def rewritten_path(raw: bytes) -> bytes:
    """``canonical_path`` segment by segment, without the shortcut for canonical input."""
    if not raw.startswith(b"/"):
        raise InvalidRequestTarget(
            "only a path starting with / is accepted as the request target "
            "(not *, an authority, or a relative reference)"
        )
    segments = [_normalized_segment(segment) for segment in raw[1:].split(b"/")]
    kept: list[bytes] = []
    for segment in segments:
        if segment == b"..":
            if kept:
                kept.pop()
        elif segment and segment != b".":
            kept.append(segment)
    # "/a/", "/a/." and "/a/b/.." all name the directory "/a/": the trailing slash stays.
    trailing = b"/" if kept and segments[-1] in (b"", *_DOT_SEGMENTS) else b""
    return b"/" + b"/".join(kept) + trailing


def canonical_prefix(prefix: str) -> str:
    """A configured route prefix in the form it is compared with: canonical, no trailing /."""
    encoded = quote(prefix, safe="/%!$&'()*+,;=:@~").encode("ascii")
    return canonical_path(encoded).decode("ascii").rstrip("/")


def _refuse_overrides(headers: Headers) -> None:
    for name, _ in headers:
        if name in _TARGET_OVERRIDES:  # ASGI field names are lower-case
            raise InvalidRequestTarget(
                f"{name.decode('latin-1')} would make the upstream execute another target or "
                "method than the one the gateway routes and protects; send the real one"
            )


def _canonical_target(scope: Scope, route_for: RouteFinder | None) -> RequestTarget:
    raw: bytes | None = scope.get("raw_path")
    if raw is None:
        # A server that gives no raw path: its decoded path, encoded back as UTF-8.
        raw = quote(scope["path"], safe="/!$&'()*+,;=:@~").encode("ascii")
    else:
        # The ASGI raw path is the target as received; a query some servers leave on it.
        raw = raw.split(b"?", 1)[0]
    _refuse_overrides(scope["headers"])
    path = canonical_path(raw)
    # Every layer below, and a library user's own app, sees the canonical path too.
    scope["raw_path"] = path
    text = path.decode("ascii")
    scope["path"] = unquote(text)
    route = route_for(text) if route_for is not None else None
    return RequestTarget(path, scope.get("query_string", b""), route)


def known_target(scope: Scope) -> RequestTarget | None:
    """The canonical target a layer outside already stored, or ``None`` (none computed it)."""
    target = scope.get("state", {}).get(STATE_KEY)
    return target if isinstance(target, RequestTarget) else None


def target_of(scope: Scope, route_for: RouteFinder | None = None) -> RequestTarget:
    """The request's canonical target: the one the outermost layer stored, or computed now
    (``IdempotencyMiddleware`` in a user's app has no gateway layer around it). ``route_for``
    matches the route of a target computed now, so it is built once, with its route."""
    target = known_target(scope)
    if target is None:
        target = scope.setdefault("state", {})[STATE_KEY] = _canonical_target(scope, route_for)
    return target


async def target_or_refuse(
    scope: Scope, send: Send, route_for: RouteFinder | None = None
) -> RequestTarget | None:
    """The canonical target, or ``None`` once the client got its 400 problem: refused before
    anything reads the body, touches the store or opens a connection."""
    try:
        return target_of(scope, route_for)
    except InvalidRequestTarget as error:
        await send_problem(send, error, request_id=request_id_of(scope))
        return None
