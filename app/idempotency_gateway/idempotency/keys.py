"""The ``Idempotency-Key`` field and the client's tenant.

A tenant is who sends the request: an HMAC of its credential fields (the config's ``scope``
section names them). Records are kept per ``(tenant, operation, key)``, so two clients never
share a key; the store calls the tenant a record's ``scope``.

The key is a bare token or an RFC 8941 sf-string (``"abc"``), the form the IETF draft
``draft-ietf-httpapi-idempotency-key-header`` uses. Either way the key itself must be 1 to 255
visible ASCII characters.
"""

from __future__ import annotations

import hashlib
import hmac
import re

from idempotency_gateway.asgi import Headers, header_values
from idempotency_gateway.errors import InvalidIdempotencyKey

MAX_KEY_LENGTH = 255
ANONYMOUS_TENANT = "anonymous"


def _is_visible_ascii(text: str) -> bool:
    """Every character 0x21 to 0x7E: ASCII, printable (0x20 to 0x7E), and no space. Three
    string methods in C, a tenth of a loop over the characters in Python."""
    return text.isascii() and text.isprintable() and " " not in text


def is_key(text: str) -> bool:
    """Whether ``text`` can be a key as it is: 1 to 255 visible ASCII characters."""
    return 1 <= len(text) <= MAX_KEY_LENGTH and _is_visible_ascii(text)


def _unquote_sf_string(raw: str) -> str:
    """The content of an RFC 8941 sf-string, or an error for anything that is not exactly one."""
    inner = raw[1:]
    chars: list[str] = []
    index = 0
    while index < len(inner):
        char = inner[index]
        if char == "\\":
            if index + 1 >= len(inner) or inner[index + 1] not in '"\\':
                raise InvalidIdempotencyKey("sf-string has an invalid escape")
            chars.append(inner[index + 1])
            index += 2
            continue
        if char == '"':
            if index != len(inner) - 1:
                raise InvalidIdempotencyKey(
                    "only a single sf-string is allowed, with no parameters after it"
                )
            return "".join(chars)
        if not 0x20 <= ord(char) <= 0x7E:
            raise InvalidIdempotencyKey("sf-string holds a character outside printable ASCII")
        chars.append(char)
        index += 1
    raise InvalidIdempotencyKey("sf-string has no closing quote")


def parse_idempotency_key(headers: Headers, header_name: bytes) -> str | None:
    """The key the client sent, ``None`` when absent; a malformed key raises."""
    values = header_values(headers, header_name)
    if not values:
        return None
    if len(values) > 1:
        raise InvalidIdempotencyKey("send exactly one Idempotency-Key field")
    try:
        raw = values[0].decode("ascii").strip(" \t")
    except UnicodeDecodeError:
        raise InvalidIdempotencyKey("the key must be visible ASCII") from None
    key = _unquote_sf_string(raw) if raw.startswith('"') else raw
    if not 1 <= len(key) <= MAX_KEY_LENGTH:
        raise InvalidIdempotencyKey(f"the key must be 1 to {MAX_KEY_LENGTH} characters long")
    if not _is_visible_ascii(key):
        raise InvalidIdempotencyKey("the key must be visible ASCII (0x21 to 0x7E), no spaces")
    return key


def with_bare_key(headers: Headers, header_name: bytes, key: str) -> Headers:
    """``headers`` with the key field holding the bare key: ``abc`` and ``"abc"`` are one key
    here, so the upstream must see them as one key too. Bare, because the APIs behind
    gateways (Stripe's among them) read the field as an opaque string, quotes included."""
    bare = key.encode("ascii")
    if (header_name, bare) in headers:
        return headers  # sent bare already, as nearly every client does
    return [(name, bare if name == header_name else value) for name, value in headers]


# Fields whose value is ``<auth-scheme> <credentials>`` (RFC 9110 section 11.6.2): the scheme
# is case-insensitive and one or more spaces come before the credentials, so ``bearer sk_1``
# and ``Bearer  sk_1`` are the credential of ``Bearer sk_1`` to the upstream. Hashed as sent,
# they were three tenants: a retry in another spelling ran its key again.
_CREDENTIAL_FIELDS = frozenset({b"authorization", b"proxy-authorization"})
_SCHEME_AND_CREDENTIALS = re.compile(rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+) +(.*)", re.DOTALL)


def _credential(value: bytes) -> bytes:
    """A credential field's value in one spelling: the scheme capitalized as usually sent
    (``Bearer``, ``Basic``) and one space; the credentials themselves, case and all, as sent."""
    match = _SCHEME_AND_CREDENTIALS.fullmatch(value)
    if match is None:
        return value
    return match.group(1).capitalize() + b" " + match.group(2)


def key_hash(key: str) -> str:
    """The key as the access log and the admin lookup name it: 16 hex digits of its SHA-256.
    Joins a log line to ``GET /admin/records/by-key`` without writing the key itself (a key
    may carry a client's order or customer number) into the logs."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def tenant_of(headers: Headers, credential_headers: tuple[bytes, ...], *, secret: bytes) -> str:
    """Who the client is, as an HMAC-SHA256 hex digest keyed by the deployment's secret.

    The raw credential is never stored, and without the secret a stored tenant cannot be
    matched against guessed credentials (a bare hash of a short password can).
    """
    # One HMAC over the fields joined, in one call in C: the digest of the same bytes fed to
    # it field by field, as the stored records' scopes were computed.
    message: list[bytes] = []
    for name in credential_headers:
        # An empty field is no credential: counted as one, it would be a tenant shared by
        # everyone who sends it, past an ``anonymous: refuse`` route.
        values = [value for value in header_values(headers, name) if value.strip(b" \t")]
        if name in _CREDENTIAL_FIELDS:
            values = [_credential(value) for value in values]
        message.extend(name + b"\x00" + len(value).to_bytes(4, "big") + value for value in values)
        message.append(b"\x01")
    if len(message) == len(credential_headers):
        return ANONYMOUS_TENANT  # only the separators: no credential was sent
    return hmac.digest(secret, b"".join(message), "sha256").hex()


# A header name never starts with 0x02, so a sender's scope never equals a client's.
_TENANT_DOMAIN = b"\x02webhook-tenant\x00"


def tenant_scope(tenant: bytes, *, secret: bytes) -> str:
    """A webhook sender's scope: its tenant under the same HMAC as clients' credentials."""
    return hmac.new(secret, _TENANT_DOMAIN + tenant, hashlib.sha256).hexdigest()
