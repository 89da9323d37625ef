"""The request fingerprint (``request_hash``) that tells a retry from a different request.

SHA-256 over method, path, sorted query, content type, chosen extra headers and the body.
JSON bodies are canonicalized with RFC 8785 first, so key order and whitespace do not turn a
faithful retry into a 422. A body that does not parse, or that RFC 8785 cannot represent
(integers beyond IEEE 754 doubles, for one), is hashed as bytes: still exact, only stricter.
"""

from __future__ import annotations

import hashlib
from urllib.parse import parse_qsl

import orjson
import rfc8785

from idempotency_gateway.asgi import Headers, first_header, header_values


def _is_json(content_type: bytes) -> bool:
    media_type = content_type.split(b";", 1)[0].strip().lower()
    return media_type == b"application/json" or media_type.endswith(b"+json")


def canonical_body(content_type: bytes, body: bytes) -> bytes:
    if not body or not _is_json(content_type):
        return body
    try:
        return rfc8785.dumps(orjson.loads(body))
    except (orjson.JSONDecodeError, rfc8785.CanonicalizationError, RecursionError):
        return body


def _field(digest: hashlib._Hash, value: bytes) -> None:
    # Length-prefixed, so no two different requests can concatenate to the same input.
    digest.update(len(value).to_bytes(8, "big"))
    digest.update(value)


def request_hash(
    *,
    method: str,
    path: str,
    query_string: bytes,
    headers: Headers,
    body: bytes,
    extra_headers: tuple[bytes, ...] = (),
) -> str:
    digest = hashlib.sha256()
    _field(digest, method.encode())
    _field(digest, path.encode())
    # Percent-decoded to latin-1, one code point per byte: every query decodes and encodes
    # back exactly (UTF-8 decoding turned "%E2%82%AC" into a character latin-1 cannot hold).
    query = sorted(
        parse_qsl(query_string.decode("latin-1"), keep_blank_values=True, encoding="latin-1")
    )
    _field(digest, str(len(query)).encode())
    for query_name, query_value in query:
        _field(digest, query_name.encode("latin-1"))
        _field(digest, query_value.encode("latin-1"))
    content_type = first_header(headers, b"content-type") or b""
    _field(digest, content_type)
    for name in extra_headers:
        values = header_values(headers, name)
        _field(digest, name + b":" + str(len(values)).encode())
        for value in values:
            _field(digest, value)
    _field(digest, canonical_body(content_type, body))
    return digest.hexdigest()
