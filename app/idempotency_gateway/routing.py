"""Routing: the canonical target and its route, decided once per request.

``PrefixRouter`` matches on whole path segments: ``/v1/charges`` matches ``/v1/charges`` and
``/v1/charges/ch_1`` but not ``/v1/chargesX`` (a prefix that splits a segment would route by
accident). A route matches every spelling its upstream reads as the same path (``spelled``):
its case folded unless ``match.case_sensitive``, format suffixes left out with
``match.format_suffixes``, and a trailing slash left out of the operation it is named by.
``RouteRequests`` is the gateway's outermost routing layer: it canonicalizes the target,
matches it, and stores both in the scope for the idempotency layer and the proxy.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar
from urllib.parse import quote, unquote_to_bytes

from idempotency_gateway.asgi import ASGIApp, Receive, Scope, Send
from idempotency_gateway.config import ConfigError, RouteConfig, RouteMatch
from idempotency_gateway.target import canonical_prefix, target_or_refuse

T = TypeVar("T")

_ESCAPE = re.compile(r"%[0-9a-f]{2}")
# A run of percent-encoded octets that are not ASCII: UTF-8 text, or octets that are not.
_NON_ASCII = re.compile(r"(?:%[89A-F][0-9A-F])+")
# The last segment's format suffix: from its first dot on, when something comes before it;
# a trailing slash after it stays (Rails routes /v1/charges.json/ as /v1/charges.json).
_DOTTED_CAPITAL_I = "\u0130"
_FORMAT_SUFFIX = re.compile(r"(?<=[^/])\.[^/]*(?=/?$)")


def path_without_parameters(path: str) -> str:
    """The path as servlet containers (Tomcat, Jetty, Spring) resolve it: every segment's
    ``;parameters`` dropped, so ``/v1/charges;x=1`` and ``/v1;x/charges`` reach the upstream's
    ``/v1/charges`` handler. Routes match on this form, or such a path would pass a route's
    idempotency policy by. A segment left empty merges away, as ``//`` does."""
    if ";" not in path:
        return path
    segments = [segment.split(";", 1)[0] for segment in path.split("/")]
    kept = [segment for segment in segments[1:-1] if segment]
    return "/".join(["", *kept, segments[-1]])


def _folded_octets(match: re.Match[str]) -> str:
    # Octets that are not UTF-8 survive as surrogates, untouched by casefold: %FF and %FE
    # stay apart, as the canonical path keeps them.
    text = unquote_to_bytes(match.group()).decode("utf-8", "surrogateescape")
    # Upper-cased first: .NET's OrdinalIgnoreCase and Java's equalsIgnoreCase compare upper
    # cases, where the dotless i and the long s are I and S; casefold alone keeps them apart.
    # Java then compares the lower cases of those, where the dotted capital I is i: casefold
    # makes it i and a combining dot, another path.
    upper = text.upper().replace(_DOTTED_CAPITAL_I, "I")
    return quote(upper.casefold().encode("utf-8", "surrogateescape"), safe="")


def folded(path: str) -> str:
    """A canonical path with its case folded: ASCII letters lower-cased, and non-ASCII text
    (percent-encoded UTF-8) decoded, case-folded (``É`` and ``é``, ``ß`` and ``ss``, the
    dotless i and ``i``) and encoded again. Percent-encodings keep their upper-case hex."""
    lowered = path.lower()
    if "%" not in lowered:
        return lowered
    escapes_restored = _ESCAPE.sub(lambda escape: escape.group().upper(), lowered)
    return _NON_ASCII.sub(_folded_octets, escapes_restored)


def without_format_suffix(path: str) -> str:
    """``/v1/charges.json``, ``/v1/charges.`` -> ``/v1/charges``: the path's last segment
    without everything from its first dot on (a leading dot, as in ``/.env``, stays; so does
    a trailing slash: ``/v1/charges.json/`` -> ``/v1/charges/``)."""
    return _FORMAT_SUFFIX.sub("", path)


def without_trailing_slash(path: str) -> str:
    """``/v1/charges/`` -> ``/v1/charges`` (the root stays ``/``). A canonical path ends in
    at most one slash: repeated ones are merged."""
    return path[:-1] if len(path) > 1 and path.endswith("/") else path


def spelled(path: str, match: RouteMatch) -> str:
    """The one spelling of a canonical path under ``match``'s options: the form routes are
    compared in, and the operation is named by, so every spelling the upstream reads as the
    same path is one path here. A trailing slash is left out whatever the options: Express,
    Rails, ASP.NET Core and Spring before 6 route ``/v1/charges/`` to the ``/v1/charges``
    handler (others redirect or refuse it, so one name for both never hides an execution)."""
    path = path_without_parameters(path)
    if match.format_suffixes:
        path = without_format_suffix(path)
    path = without_trailing_slash(path)
    return path if match.case_sensitive else folded(path)


class _Entry(Generic[T]):
    __slots__ = ("case_sensitive", "directory", "format_suffixes", "prefix", "value")

    def __init__(self, match: RouteMatch, value: T) -> None:
        self.case_sensitive = match.case_sensitive
        self.format_suffixes = match.format_suffixes
        # Compared in the canonical form the request paths arrive in, folded as they will be.
        prefix = canonical_prefix(match.path_prefix)
        self.prefix = prefix if match.case_sensitive else folded(prefix)
        # The "/"-terminated form, built once rather than per request.
        self.directory = self.prefix + "/"
        self.value = value

    def covers(self, path: str) -> bool:
        return not self.prefix or path == self.prefix or path.startswith(self.directory)


class PrefixRouter(Generic[T]):
    def __init__(self, entries: Iterable[tuple[RouteMatch, T]]) -> None:
        # Longest first, so the first hit is the most specific route.
        self._entries = sorted(
            (_Entry(match, value) for match, value in entries),
            key=lambda entry: len(entry.prefix),
            reverse=True,
        )

    def match(self, path: str) -> T | None:
        path = path_without_parameters(path)
        folded_path: str | None = None
        for entry in self._entries:
            if entry.case_sensitive:
                form = path
            else:
                form = folded_path = folded(path) if folded_path is None else folded_path
            if entry.covers(form) or (
                entry.format_suffixes and entry.covers(without_format_suffix(form))
            ):
                return entry.value
        return None


def route_collisions(routes: Sequence[RouteConfig]) -> list[str]:
    """Pairs of routes whose prefixes are one once canonical (and case-folded, unless both
    match case-sensitively): which one a request reached would depend on their order."""
    found = []
    for index, first in enumerate(routes):
        for second in routes[index + 1 :]:
            one = canonical_prefix(first.match.path_prefix)
            other = canonical_prefix(second.match.path_prefix)
            if not (first.match.case_sensitive and second.match.case_sensitive):
                one, other = folded(one), folded(other)
            if one == other:
                found.append(
                    f"routes {first.name!r} and {second.name!r} match the same paths: "
                    f"{first.match.path_prefix!r} and {second.match.path_prefix!r} are one "
                    f"prefix, {one!r}, as requests are matched"
                )
    return found


def check_routes(routes: Sequence[RouteConfig], *, source: str) -> None:
    """``ConfigError`` when two routes collide (``route_collisions``)."""
    if collisions := route_collisions(routes):
        raise ConfigError(source, [f"routes: {collision}" for collision in collisions])


class RouteRequests:
    def __init__(self, app: ASGIApp, routes: Iterable[RouteConfig]) -> None:
        self.app = app
        self.router = PrefixRouter((route.match, route) for route in routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if await target_or_refuse(scope, send, self.router.match) is None:
            return
        await self.app(scope, receive, send)
