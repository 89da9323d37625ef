"""The request fingerprint (``request_hash``) that tells a retry from a different request.

SHA-256 over method, canonical path bytes, the query ordered by name (as sent, when it holds
a ``;`` or a malformed %-escape), content type, chosen extra headers and the body. JSON
bodies are canonicalized first, so key order and whitespace do not turn a faithful retry
into a 422; the canonical form is lossless, so two different requests never share a
fingerprint:

- numbers are compared by exact decimal value (``20`` and ``19.999999999999999`` differ,
  integers of any size keep every digit); ``1``, ``1.0`` and ``1e0`` are the same value;
- a body with a duplicate object key, a number the decimal type cannot hold, a number
  literal over ``MAX_NUMBER_LITERAL`` characters, ``NaN``, a string that cannot be
  re-encoded, a body not in UTF-8 (or led by a byte order mark), under a
  ``Content-Encoding`` or under two content types, or anything that does not parse is
  hashed as bytes: still exact, only stricter (a changed byte is a different request).
"""

from __future__ import annotations

import decimal
import hashlib
import json
import re
from typing import Any
from urllib.parse import unquote_to_bytes

import orjson

from idempotency_gateway.asgi import Headers, header_values

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


# Longer number literals are compared as bytes: exact all the same, and converting a
# megabyte-long literal to a decimal would cost a second of CPU per request.
# (4300 is Python's own default cap on int digits.)
MAX_NUMBER_LITERAL = 4300


def _exact_number(literal: str) -> decimal.Decimal:
    if len(literal) > MAX_NUMBER_LITERAL:
        raise _NotCanonical
    return decimal.Decimal(literal)


def _refuse_constant(name: str) -> Any:
    raise _NotCanonical  # NaN, Infinity: not JSON, and no exact value


def _canonical_number(value: decimal.Decimal) -> bytes:
    """The exact value as ``[-]digitsEexponent`` with no trailing zeros: no rounding, so
    equal strings mean equal values and nothing else."""
    sign, digits, exponent = value.as_tuple()
    if not isinstance(exponent, int):
        raise _NotCanonical
    # One pass over the digits: a body may hold a number with millions of trailing zeros,
    # and dropping them one at a time would cost time quadratic in its length.
    text = "".join(map(str, digits))
    significant = text.rstrip("0")
    if not significant:
        return b"0"
    exponent += len(text) - len(significant)
    return (b"-" if sign else b"") + significant.encode() + b"E%d" % exponent


def _canonical(value: Any, out: list[bytes]) -> None:
    if isinstance(value, dict):
        out.append(b"{")
        for index, name in enumerate(sorted(value)):
            out.append(b"," if index else b"")
            out.append(orjson.dumps(name) + b":")
            _canonical(value[name], out)
        out.append(b"}")
    elif isinstance(value, list):
        out.append(b"[")
        for index, item in enumerate(value):
            out.append(b"," if index else b"")
            _canonical(item, out)
        out.append(b"]")
    elif isinstance(value, decimal.Decimal):
        out.append(_canonical_number(value))
    else:  # str, True, False, None: orjson writes each one way only
        out.append(orjson.dumps(value))


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
            parse_int=_exact_number,
            parse_constant=_refuse_constant,
            object_pairs_hook=_unique_members,
        )
        out: list[bytes] = []
        _canonical(parsed, out)
    except (
        _NotCanonical,
        ValueError,  # not JSON, not UTF-8 (UnicodeDecodeError), a BOM
        decimal.InvalidOperation,  # an exponent beyond what Decimal holds
        orjson.JSONEncodeError,  # a lone surrogate in a string
        RecursionError,
    ):
        return None
    return b"".join(out)


def _query_fields(query_string: bytes) -> list[tuple[bytes, bytes | None]]:
    """The query's fields, percent-decoded to bytes and ordered by name only.

    Different names commute, but a repeated name keeps the order its values came in:
    frameworks read ``a=1&a=2`` as a list, or take its first or its last value, so
    ``amount=1&amount=1000`` and ``amount=1000&amount=1`` are two different requests."""
    fields: list[tuple[bytes, bytes | None]] = []
    for pair in query_string.split(b"&"):
        if not pair:
            continue
        name, equals, value = pair.partition(b"=")
        fields.append((_unquote_plus(name), _unquote_plus(value) if equals else None))
    fields.sort(key=lambda field: field[0])  # stable: values of one name keep their order
    return fields


def _unquote_plus(text: bytes) -> bytes:
    return unquote_to_bytes(text.replace(b"+", b" "))


def _listed(values: list[bytes]) -> bytes:
    """Field values, count and lengths first, so no two lists encode alike; led by NUL, which
    no field value holds (the HTTP parser refuses it), so never equal to one plain value."""
    encoded = b"".join(len(value).to_bytes(4, "big") + value for value in values)
    return b"\x00" + len(values).to_bytes(4, "big") + encoded


def _field(digest: hashlib._Hash, value: bytes) -> None:
    # Length-prefixed, so no two different requests can concatenate to the same input.
    digest.update(len(value).to_bytes(8, "big"))
    digest.update(value)


def _query(digest: hashlib._Hash, query_string: bytes) -> None:
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
    canonical = canonical_json(content_type, body) if plain else None
    # Tagged, so a canonical form never equals a body compared as bytes.
    _field(digest, b"bytes" if canonical is None else b"json")
    _field(digest, body if canonical is None else canonical)
    return digest.hexdigest()
