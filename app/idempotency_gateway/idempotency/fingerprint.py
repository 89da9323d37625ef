"""The request fingerprint (``request_hash``) that tells a retry from a different request.

SHA-256 over method, canonical path bytes, the query ordered by name (as sent, when it holds
a ``;`` or a malformed %-escape), content type, chosen extra headers and the body. A JSON
body up to the route's ``max_canonical_body`` is canonicalized first, so key order and
whitespace do not turn a faithful retry into a 422; the canonical form is lossless, so two
different requests never share a fingerprint:

- numbers are compared by exact decimal value (``20`` and ``19.999999999999999`` differ,
  integers of any size keep every digit); ``1``, ``1.0`` and ``1e0`` are the same value;
- a body with a duplicate object key, a number literal over ``MAX_NUMBER_LITERAL``
  characters, ``NaN``, a string that cannot be re-encoded, nesting deeper than orjson writes
  (255 levels), a body not in UTF-8 (or led by a byte order mark), under a
  ``Content-Encoding`` or under two content types, or anything that does not parse is hashed
  as bytes: still exact, only stricter (a changed byte is a different request).

A larger body is hashed as bytes whatever its type: the canonical form costs CPU and memory
in proportion to the number of values (a Python object each), the hash only a pass over the
bytes. The route's limit therefore bounds what one request's canonical form can cost, and
``fingerprint`` moves any body over ``OFFLOAD_ABOVE`` bytes off the event loop, so a worker
keeps serving its other requests while a large body is hashed.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
from collections import OrderedDict
from collections.abc import Callable
from typing import Any
from urllib.parse import unquote_to_bytes

import orjson

from idempotency_gateway.asgi import Headers, header_values
from idempotency_gateway.config import DEFAULT_MAX_CANONICAL_BODY

# Bodies larger than this are fingerprinted in a worker thread, where hashing releases the
# GIL and a canonical form yields it every switch interval (5 ms): the loop stays live.
# Smaller ones stay on the loop: their canonical form costs at most about 2 ms on the
# benchmark machine (an eighth of the 64 KiB body's in benchmarks/RESULTS.md), and most
# bodies are far smaller, where the hop to a thread and back would cost more than the work.
OFFLOAD_ABOVE = 8 * 1024

# A query whose fields the upstream may split or decode otherwise than the gateway: some
# frameworks also separate fields at ";" (so "x=1;a=2&a=3" holds two values of "a" that
# reordering would swap), and a "%" without two hex digits is kept by some and refused or
# dropped by others (so "%GG" and "%25GG" may be two requests).
_AMBIGUOUS_QUERY = re.compile(rb";|%(?![0-9A-Fa-f]{2})")


class _NotCanonical(Exception):
    """The body has no canonical JSON form; it is compared as bytes."""


def _is_json(content_type: bytes) -> bool:
    media_type = content_type.split(b";", 1)[0].strip().lower()
    return media_type == b"application/json" or media_type.endswith(b"+json")


def _unique_members(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    members = dict(pairs)
    if len(members) != len(pairs):
        # Parsers disagree on which duplicate wins: the upstream may act on the other one.
        raise _NotCanonical
    return members


# Longer number literals are compared as bytes: exact all the same, and a megabyte-long
# literal is no amount anyone means. (4300 is Python's own default cap on int digits.)
MAX_NUMBER_LITERAL = 4300


def _exact_integer(literal: str) -> orjson.Fragment:
    """An integer as ``[-]digitsEexponent`` with no trailing zeros (or ``0``): what
    ``_exact_number`` writes, in fewer steps, since most numbers in a body are integers."""
    if len(literal) > MAX_NUMBER_LITERAL:
        raise _NotCanonical
    significant = literal.rstrip("0")
    if significant in ("", "-"):
        return _ZERO
    return orjson.Fragment(f"{significant}E{len(literal) - len(significant)}")


def _exact_number(literal: str) -> orjson.Fragment:
    """The exact value as ``[-]digitsEexponent`` with no trailing zeros (or ``0``): no
    rounding, so equal strings mean equal values and nothing else.

    Worked out on the literal's text, which the JSON grammar has already checked, so no
    ``Decimal`` is built per number; the result is a ``Fragment`` orjson writes as is."""
    if len(literal) > MAX_NUMBER_LITERAL:
        raise _NotCanonical
    sign = "-" if literal.startswith("-") else ""
    mantissa, _, exponent_text = literal.lstrip("-").replace("E", "e").partition("e")
    whole, _, fraction = mantissa.partition(".")
    digits = (whole + fraction).lstrip("0")
    significant = digits.rstrip("0")
    if not significant:
        return _ZERO  # -0, 0.0 and 0e5 are all zero
    exponent = int(exponent_text or 0) - len(fraction) + len(digits) - len(significant)
    return orjson.Fragment(f"{sign}{significant}E{exponent}")


_ZERO = orjson.Fragment(b"0")


def _refuse_constant(name: str) -> Any:
    raise _NotCanonical  # NaN, Infinity: not JSON, and no exact value


def canonical_json(content_type: bytes, body: bytes) -> bytes | None:
    """The body's canonical JSON form, or ``None`` when it is compared as bytes."""
    if not body or not _is_json(content_type):
        return None
    try:
        # UTF-8 with no byte order mark only (RFC 8259 section 8.1): json.loads would also
        # read UTF-16, UTF-32 and a BOM, which many upstreams refuse; as bytes they differ.
        parsed = json.loads(
            body.decode("utf-8"),
            parse_float=_exact_number,
            parse_int=_exact_integer,
            parse_constant=_refuse_constant,
            object_pairs_hook=_unique_members,
        )
        # Members ordered by name (code point order, as UTF-8 bytes order them), no
        # whitespace, each string written one way only: the walk and the writing run in C.
        return orjson.dumps(parsed, option=orjson.OPT_SORT_KEYS)
    except (
        _NotCanonical,
        ValueError,  # not JSON, not UTF-8 (UnicodeDecodeError), a BOM, an exponent too long
        orjson.JSONEncodeError,  # a lone surrogate in a string, nesting past 255 levels
        RecursionError,
    ):
        return None


class CanonicalMemo:
    """The canonical forms of the JSON bodies seen lately, by the SHA-256 of their bytes.

    A retry sends the very bytes of its first request: its canonical form is the one already
    worked out, found for the cost of hashing the body (about a tenth of parsing and
    rewriting it). It is a memo, not a second function: what it returns is what
    ``canonical_json`` returned for those bytes, so every fingerprint stays what it was.
    Bounded by entries and by the bytes it holds; bodies up to ``max_body`` only, which are
    fingerprinted on the event loop (``OFFLOAD_ABOVE``), so no worker thread touches it."""

    def __init__(self, *, max_entries: int, max_body: int, max_bytes: int) -> None:
        self.max_entries = max_entries
        self.max_body = max_body
        self.max_bytes = max_bytes
        self._forms: OrderedDict[bytes, bytes | None] = OrderedDict()
        self._bytes = 0

    def canonical_json(self, content_type: bytes, body: bytes) -> bytes | None:
        if len(body) > self.max_body or not body or not _is_json(content_type):
            return canonical_json(content_type, body)
        name = hashlib.sha256(body).digest()
        if name in self._forms:
            self._forms.move_to_end(name)
            return self._forms[name]
        form = canonical_json(content_type, body)
        self._forms[name] = form
        self._bytes += len(form or b"")
        while len(self._forms) > self.max_entries or self._bytes > self.max_bytes:
            self._bytes -= len(self._forms.popitem(last=False)[1] or b"")
        return form

    def __len__(self) -> int:
        return len(self._forms)

    @property
    def size_bytes(self) -> int:
        return self._bytes


# A few MiB at most per process: 4,096 bodies of up to 4 KiB (under ``OFFLOAD_ABOVE``), 4 MiB
# of canonical forms in all.
_memo = CanonicalMemo(max_entries=4096, max_body=4096, max_bytes=4 * 1024 * 1024)


def _query_fields(query_string: bytes) -> list[tuple[bytes, bytes | None]]:
    """The query's fields, percent-decoded to bytes and ordered by name only.

    Different names commute, but a repeated name keeps the order its values came in:
    frameworks read ``a=1&a=2`` as a list, or take its first or its last value, so
    ``amount=1&amount=1000`` and ``amount=1000&amount=1`` are two different requests. Names
    that differ only in ASCII case count as one name here, since some frameworks (ASP.NET
    Core) bind them as one: ``amount=1&Amount=1000`` and ``Amount=1000&amount=1`` keep their
    orders, and differ."""
    fields: list[tuple[bytes, bytes | None]] = []
    for pair in query_string.split(b"&"):
        if not pair:
            continue
        name, equals, value = pair.partition(b"=")
        fields.append((_unquote_plus(name), _unquote_plus(value) if equals else None))
    # Stable: the values of one name (in any case) keep their order.
    fields.sort(key=lambda field: field[0].lower())
    return fields


def _unquote_plus(text: bytes) -> bytes:
    return unquote_to_bytes(text.replace(b"+", b" "))


def _listed(values: list[bytes]) -> bytes:
    """Field values, count and lengths first, so no two lists encode alike; led by NUL, which
    no field value holds (the HTTP parser refuses it), so never equal to one plain value."""
    encoded = b"".join(len(value).to_bytes(4, "big") + value for value in values)
    return b"\x00" + len(values).to_bytes(4, "big") + encoded


def _field(digest: hashlib._Hash, value: bytes) -> None:
    # Length-prefixed, so no two different requests can concatenate to the same input. One
    # update of both: the digest is the same as of two, for one call fewer.
    digest.update(len(value).to_bytes(8, "big") + value)


# What an empty query hashes as: a count of no fields (most keyed requests have no query).
_NO_QUERY = b"0"


def _query(digest: hashlib._Hash, query_string: bytes) -> None:
    if not query_string:
        _field(digest, _NO_QUERY)
        return
    if _AMBIGUOUS_QUERY.search(query_string) is not None:
        # Compared byte for byte: only what no upstream can tell apart hashes alike. Tagged
        # with a word, never equal to the field count that leads a query compared by field.
        _field(digest, b"as sent")
        _field(digest, query_string)
        return
    query = _query_fields(query_string)
    # "flag" and "flag=" stay apart (Rails and PHP read them as null and ""): the fields with
    # no "=" are listed after the count, so a query without one hashes as it always did.
    bare = b",".join(b"%d" % index for index, (_, value) in enumerate(query) if value is None)
    _field(digest, str(len(query)).encode() + (b" bare " + bare if bare else b""))
    for query_name, query_value in query:
        _field(digest, query_name)
        _field(digest, query_value or b"")


def request_hash(
    *,
    method: str,
    path: bytes,
    query_string: bytes,
    headers: Headers,
    body: bytes,
    extra_headers: tuple[bytes, ...] = (),
    max_canonical_body: int = DEFAULT_MAX_CANONICAL_BODY,
) -> str:
    digest = hashlib.sha256()
    _field(digest, method.encode())
    _field(digest, path)
    _query(digest, query_string)
    content_types = header_values(headers, b"content-type")
    encodings = header_values(headers, b"content-encoding")
    # JSON is compared canonically only under one content type, sent in the clear: the same
    # bytes mean another body once the upstream decodes them, and of two content types it
    # may obey either. Such a request hashes every value; one content type hashes as always.
    plain = len(content_types) <= 1 and not encodings
    content_type = content_types[0] if content_types else b""
    _field(digest, content_type if plain else _listed(content_types) + _listed(encodings))
    for name in extra_headers:
        values = header_values(headers, name)
        _field(digest, name + b":" + str(len(values)).encode())
        for value in values:
            _field(digest, value)
    canonical = (
        _memo.canonical_json(content_type, body)
        if plain and len(body) <= max_canonical_body
        else None
    )
    # Tagged, so a canonical form never equals a body compared as bytes.
    _field(digest, b"bytes" if canonical is None else b"json")
    _field(digest, body if canonical is None else canonical)
    return digest.hexdigest()


async def fingerprint(compute: Callable[[], str], *, body_size: int) -> str:
    """``compute`` (a ``request_hash`` of a request whose body has ``body_size`` bytes), in a
    worker thread when the body is over ``OFFLOAD_ABOVE`` bytes."""
    if body_size <= OFFLOAD_ABOVE:
        return compute()
    return await asyncio.to_thread(compute)
