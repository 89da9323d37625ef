"""The key parser accepts exactly what contract section 3 allows, the scope never reveals or
mixes up credentials, the request fingerprint tells a faithful retry from a different
request without ever raising on a hostile body, and a key's cache entry keeps the name
earlier releases gave it."""

from __future__ import annotations

import base64
import hashlib
import hmac
import re
from collections.abc import Sequence

import pytest
from hypothesis import given
from hypothesis import strategies as st

from idempotency_gateway.asgi import Headers, header_values
from idempotency_gateway.errors import InvalidIdempotencyKey
from idempotency_gateway.idempotency.fingerprint import request_hash
from idempotency_gateway.idempotency.keys import (
    ANONYMOUS_TENANT,
    is_key,
    parse_idempotency_key,
    tenant_of,
)
from idempotency_gateway.replay.cache import cache_key
from idempotency_gateway.storage.records import RecordKey

KEY_HEADER = b"idempotency-key"
SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def key_of(*values: bytes) -> str | None:
    headers: Headers = [(b"content-type", b"application/json")]
    headers += [(KEY_HEADER, value) for value in values]
    return parse_idempotency_key(headers, KEY_HEADER)


# ------------------------------------------------------------------------ Idempotency-Key


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        pytest.param(b"order-42", "order-42", id="bare-token"),
        pytest.param(
            b"9f1c2b7e-5a4d-4f7e-8c3b-2a1d0e9f8c7b",
            "9f1c2b7e-5a4d-4f7e-8c3b-2a1d0e9f8c7b",
            id="uuid",
        ),
        pytest.param(b"!#$%&'*+-.^_`|~:/=?@[]{}", "!#$%&'*+-.^_`|~:/=?@[]{}", id="punctuation"),
        pytest.param(b'"abc"', "abc", id="sf-string"),
        pytest.param(rb'"a\"b\\c"', 'a"b\\c', id="sf-string-escapes"),
        pytest.param(b"x" * 255, "x" * 255, id="255-chars"),
        pytest.param(b'"' + b"x" * 255 + b'"', "x" * 255, id="255-chars-sf-string"),
        pytest.param(b" \t order-42 \t ", "order-42", id="surrounding-ows"),
        pytest.param(b'  "abc"\t', "abc", id="sf-string-surrounding-ows"),
    ],
)
def test_valid_key_is_accepted(raw: bytes, expected: str) -> None:
    assert key_of(raw) == expected


@pytest.mark.parametrize(
    "raw",
    [
        pytest.param(b"x" * 256, id="256-chars"),
        pytest.param(b'"' + b"x" * 256 + b'"', id="256-chars-sf-string"),
        pytest.param(b"", id="empty"),
        pytest.param(b"   ", id="only-whitespace"),
        pytest.param(b'""', id="empty-sf-string"),
        pytest.param(b"order 42", id="space-inside"),
        pytest.param(b'"order 42"', id="space-inside-sf-string"),
        pytest.param(b"order\t42", id="tab-inside"),
        pytest.param("café".encode(), id="non-ascii-utf8"),
        pytest.param(b"caf\xe9", id="non-ascii-latin1"),
        pytest.param(b"order\x0042", id="nul"),
        pytest.param(b"order\x1b42", id="escape-control"),
        pytest.param(b"order\x7f42", id="delete-control"),
        pytest.param(b'"a";x=1', id="sf-string-with-parameter"),
        pytest.param(b'"abc', id="unterminated-sf-string"),
        pytest.param(b'"abc\\"', id="escaped-closing-quote"),
        pytest.param(rb'"a\nb"', id="invalid-escape"),
        pytest.param(b'"a"b"', id="text-after-sf-string"),
        pytest.param(b'"a", "b"', id="sf-list"),
    ],
)
def test_malformed_key_is_rejected(raw: bytes) -> None:
    with pytest.raises(InvalidIdempotencyKey):
        key_of(raw)


def test_two_key_fields_are_rejected() -> None:
    with pytest.raises(InvalidIdempotencyKey):
        key_of(b"order-42", b"order-42")


def test_absent_key_is_none() -> None:
    assert key_of() is None


def test_key_is_read_from_the_configured_header_only() -> None:
    headers: Headers = [(b"x-request-key", b"custom"), (KEY_HEADER, b"standard")]
    assert parse_idempotency_key(headers, b"x-request-key") == "custom"
    assert parse_idempotency_key(headers, b"x-other") is None


# ---------------------------------------------------------------------------------- scope

AUTHORIZATION = (b"authorization",)
ACCOUNT_AND_AUTHORIZATION = (b"authorization", b"stripe-account")
SECRET = b"deployment-secret"


def scope(headers: Headers, names: tuple[bytes, ...], *, secret: bytes = SECRET) -> str:
    return tenant_of(headers, names, secret=secret)


def bare_sha256_scope(headers: Headers, names: tuple[bytes, ...]) -> str:
    """What scopes used to be: a hash anyone can recompute from a guessed credential."""
    digest = hashlib.sha256()
    for name in names:
        for value in header_values(headers, name):
            digest.update(name + b"\x00" + len(value).to_bytes(4, "big") + value)
        digest.update(b"\x01")
    return digest.hexdigest()


def test_a_basic_credential_cannot_be_recovered_from_its_scope_with_a_dictionary() -> None:
    stolen = scope(
        [(b"authorization", b"Basic " + base64.b64encode(b"alice:hunter2"))], AUTHORIZATION
    )
    dictionary = [b"password", b"123456", b"hunter2", b"letmein"]

    guesses = {
        bare_sha256_scope(
            [(b"authorization", b"Basic " + base64.b64encode(b"alice:" + word))], AUTHORIZATION
        )
        for word in dictionary
    }

    assert stolen not in guesses


def test_a_credential_is_one_scope_in_every_spelling_of_its_scheme() -> None:
    # The scheme is case-insensitive and any number of spaces may follow it (RFC 9110
    # section 11.6.2): one client, one scope, or its retry in another spelling runs again.
    sent_as = scope([(b"authorization", b"Bearer sk_live_1")], AUTHORIZATION)
    for spelling in (b"bearer sk_live_1", b"BEARER sk_live_1", b"Bearer   sk_live_1"):
        assert scope([(b"authorization", spelling)], AUTHORIZATION) == sent_as, spelling
    # The credentials are compared as sent: another case is another client.
    assert scope([(b"authorization", b"Bearer SK_LIVE_1")], AUTHORIZATION) != sent_as
    assert scope([(b"stripe-account", b"acct 1")], (b"stripe-account",)) != scope(
        [(b"stripe-account", b"Acct 1")], (b"stripe-account",)
    )


def test_the_deployment_secret_keys_the_scope() -> None:
    headers = [(b"authorization", b"Bearer sk_live_1")]

    assert scope(headers, AUTHORIZATION) == scope(headers, AUTHORIZATION, secret=SECRET)
    assert scope(headers, AUTHORIZATION) != scope(headers, AUTHORIZATION, secret=b"other")
    assert (
        scope(headers, AUTHORIZATION)
        == hmac.new(
            SECRET,
            b"authorization\x00" + len(headers[0][1]).to_bytes(4, "big") + headers[0][1] + b"\x01",
            hashlib.sha256,
        ).hexdigest()
    )


def test_same_credential_gives_same_scope() -> None:
    first = scope([(b"authorization", b"Bearer sk_live_1")], AUTHORIZATION)
    again = scope([(b"accept", b"*/*"), (b"authorization", b"Bearer sk_live_1")], AUTHORIZATION)
    assert first == again


def test_different_credentials_give_different_scopes() -> None:
    assert scope([(b"authorization", b"Bearer sk_live_1")], AUTHORIZATION) != scope(
        [(b"authorization", b"Bearer sk_live_2")], AUTHORIZATION
    )


@pytest.mark.parametrize(
    "headers",
    [
        pytest.param([], id="no-headers"),
        pytest.param([(b"x-api-key", b"secret")], id="unconfigured-credential-header"),
        pytest.param([(b"authorization", b"")], id="empty-credential"),
        pytest.param([(b"authorization", b" \t"), (b"authorization", b"")], id="blank-credentials"),
    ],
)
def test_no_credential_is_anonymous(headers: Headers) -> None:
    assert scope(headers, AUTHORIZATION) == ANONYMOUS_TENANT


def test_scope_never_contains_the_credential() -> None:
    credential = b"Bearer sk_live_0123456789abcdef0123456789abcdef"

    hashed = scope([(b"authorization", credential)], AUTHORIZATION)

    assert SHA256_HEX.fullmatch(hashed)
    assert "sk_live" not in hashed
    assert credential.split()[1].decode() not in hashed


def test_scope_from_two_headers_ignores_field_order() -> None:
    auth = (b"authorization", b"Bearer sk_1")
    account = (b"stripe-account", b"acct_1")

    assert scope([auth, account], ACCOUNT_AND_AUTHORIZATION) == scope(
        [account, auth], ACCOUNT_AND_AUTHORIZATION
    )


@pytest.mark.parametrize(
    ("one", "other"),
    [
        pytest.param(
            [(b"authorization", b"A"), (b"stripe-account", b"B")],
            [(b"authorization", b"B"), (b"stripe-account", b"A")],
            id="values-swapped-between-headers",
        ),
        pytest.param(
            [(b"authorization", b"ab"), (b"stripe-account", b"c")],
            [(b"authorization", b"a"), (b"stripe-account", b"bc")],
            id="value-boundary-moved",
        ),
        pytest.param(
            [(b"authorization", b"A")],
            [(b"stripe-account", b"A")],
            id="same-value-under-other-header",
        ),
        pytest.param(
            [(b"authorization", b"A")],
            [(b"authorization", b"A"), (b"stripe-account", b"B")],
            id="second-header-added",
        ),
    ],
)
def test_scope_from_two_headers_keeps_tenants_apart(one: Headers, other: Headers) -> None:
    assert scope(one, ACCOUNT_AND_AUTHORIZATION) != scope(other, ACCOUNT_AND_AUTHORIZATION)


def scope_as_first_released(headers: Headers, names: tuple[bytes, ...], secret: bytes) -> str:
    """The scope as 0.1 computed it, field by field into one HMAC, for fields whose spelling
    needs no normalizing: stored records are found by it, so every later way of computing it
    must give the same digest."""
    digest = hmac.new(secret, digestmod=hashlib.sha256)
    present = False
    for name in names:
        for value in header_values(headers, name):
            if value.strip(b" \t"):
                present = True
                digest.update(name + b"\x00" + len(value).to_bytes(4, "big") + value)
        digest.update(b"\x01")
    return digest.hexdigest() if present else ANONYMOUS_TENANT


field_values = st.binary(max_size=40).filter(lambda value: not {13, 10} & set(value))
# ``Bearer <token>`` as clients send it: the spelling the scope normalizes every other one to.
bearer_values = (
    st.binary(min_size=1, max_size=40)
    .filter(lambda token: not {13, 10} & set(token) and not token.startswith((b" ", b"\t")))
    .map(lambda token: b"Bearer " + token)
)


@given(
    authorization=st.lists(bearer_values, max_size=2),
    account=st.lists(field_values, max_size=2),
    secret=st.binary(min_size=1, max_size=64),
)
def test_a_scope_is_the_digest_stored_records_were_keyed_by(
    authorization: list[bytes], account: list[bytes], secret: bytes
) -> None:
    headers: Headers = [(b"authorization", value) for value in authorization]
    headers += [(b"stripe-account", value) for value in account]

    assert scope(headers, ACCOUNT_AND_AUTHORIZATION, secret=secret) == scope_as_first_released(
        headers, ACCOUNT_AND_AUTHORIZATION, secret
    )


@given(st.text(max_size=300))
def test_a_key_is_1_to_255_characters_from_0x21_to_0x7e(text: str) -> None:
    visible = 1 <= len(text) <= 255 and all(0x21 <= ord(char) <= 0x7E for char in text)

    assert is_key(text) == visible


# ---------------------------------------------------------------------------- fingerprint


def fingerprint(
    *,
    method: str = "POST",
    path: bytes = b"/v1/charges",
    query: bytes = b"",
    content_type: bytes | None = b"application/json",
    body: bytes = b'{"amount":1250,"currency":"EUR"}',
    headers: Sequence[tuple[bytes, bytes]] = (),
    extra_headers: tuple[bytes, ...] = (),
) -> str:
    all_headers: Headers = [(b"host", b"api.example")]
    if content_type is not None:
        all_headers.append((b"content-type", content_type))
    all_headers += list(headers)
    return request_hash(
        method=method,
        path=path,
        query_string=query,
        headers=all_headers,
        body=body,
        extra_headers=extra_headers,
    )


@pytest.mark.parametrize(
    "content_type",
    [b"application/json", b"application/json; charset=utf-8", b"application/vnd.x+json"],
)
def test_json_key_order_and_whitespace_do_not_change_the_hash(content_type: bytes) -> None:
    compact = b'{"amount":1250,"metadata":{"a":1,"b":[1,2]},"currency":"EUR"}'
    reordered = (
        b'{\n  "currency": "EUR",\n  "metadata": {"b": [1, 2], "a": 1},\n  "amount": 1250\n}'
    )

    assert fingerprint(content_type=content_type, body=compact) == fingerprint(
        content_type=content_type, body=reordered
    )


@pytest.mark.parametrize(
    ("body", "other_body"),
    [
        pytest.param(b'{"amount":1250}', b'{"amount":1251}', id="number"),
        pytest.param(b'{"currency":"EUR"}', b'{"currency":"USD"}', id="string"),
        pytest.param(b'{"items":[1,2]}', b'{"items":[2,1]}', id="array-order"),
        pytest.param(b'{"a":1}', b'{"a":1,"b":null}', id="extra-null-member"),
    ],
)
def test_different_json_value_changes_the_hash(body: bytes, other_body: bytes) -> None:
    assert fingerprint(body=body) != fingerprint(body=other_body)


def test_invalid_json_under_json_content_type_hashes_as_bytes() -> None:
    truncated = fingerprint(body=b'{"amount":1250')

    assert SHA256_HEX.fullmatch(truncated)
    assert truncated == fingerprint(body=b'{"amount":1250')
    assert truncated != fingerprint(body=b'{"amount": 1250')


@pytest.mark.parametrize(
    "body",
    [
        pytest.param(b'{"n":NaN}', id="nan"),
        pytest.param(b"[" * 100_000 + b"]" * 100_000, id="100000-nested-lists"),
        pytest.param(b'{"a":' * 100_000 + b"1" + b"}" * 100_000, id="100000-nested-objects"),
        pytest.param(b"[" * 1000 + b"]" * 1000, id="1000-nested-lists"),
        pytest.param(b'"\xff\xfe"', id="invalid-utf8"),
    ],
)
def test_hostile_json_body_hashes_without_raising(body: bytes) -> None:
    digest = fingerprint(body=body)

    assert SHA256_HEX.fullmatch(digest)
    assert digest == fingerprint(body=body)
    assert digest != fingerprint(body=body + b" ")


def test_a_number_beyond_any_float_or_decimal_is_still_compared_by_its_exact_value() -> None:
    huge = b'{"n":1e999999999999999999999}'

    assert fingerprint(body=huge) == fingerprint(body=b'{ "n" : 10e999999999999999999998 }')
    assert fingerprint(body=huge) != fingerprint(body=b'{"n":1e999999999999999999998}')


@pytest.mark.parametrize(
    "content_type",
    [b"application/octet-stream", b"text/plain", b"application/x-www-form-urlencoded", None],
)
def test_non_json_bodies_are_compared_byte_for_byte(content_type: bytes | None) -> None:
    def of(body: bytes) -> str:
        return fingerprint(content_type=content_type, body=body)

    assert of(b"a=1&b=2") == of(b"a=1&b=2")
    assert of(b"a=1&b=2") != of(b"b=2&a=1")
    assert of(b'{"a":1,"b":2}') != of(b'{"b":2,"a":1}')
    assert of(b"payload") != of(b"payload\n")


@pytest.mark.parametrize(
    ("query", "same"),
    [
        (b"expand=customer&limit=10", b"limit=10&expand=customer"),
        (b"a=1&b=2&a=3", b"b=2&a=1&a=3"),
        (b"q=a+b&x=%41", b"x=A&q=a%20b"),
        (b"a=1&&b=2&", b"a=1&b=2"),
        (b"B=1&a=2", b"a=2&B=1"),
        # Compared as sent, so only a byte-identical retry matches.
        (b"x=1;a=2&a=3", b"x=1;a=2&a=3"),
        (b"q=%GG", b"q=%GG"),
    ],
)
def test_query_order_of_different_names_does_not_change_the_hash(query: bytes, same: bytes) -> None:
    assert fingerprint(query=query) == fingerprint(query=same)


@pytest.mark.parametrize(
    ("query", "other_query"),
    [
        pytest.param(b"limit=10", b"limit=11", id="value"),
        pytest.param(b"limit=10", b"", id="missing"),
        pytest.param(b"limit=", b"", id="blank-value"),
        pytest.param(b"a=1&b=2", b"a=2&b=1", id="values-swapped"),
        pytest.param(b"amount=1&amount=1000", b"amount=1000&amount=1", id="repeated-reordered"),
        pytest.param(b"a=1&b=2&a=3", b"a=3&b=2&a=1", id="repeated-around-another"),
        # One name to ASP.NET Core, which binds the first: 1 from one, 1000 from the other.
        pytest.param(
            b"amount=1&Amount=1000", b"Amount=1000&amount=1", id="repeated-in-another-case"
        ),
        pytest.param(b"flag", b"flag=", id="no-value-vs-empty-value"),
        pytest.param(b"a=%ff", b"a=%fe", id="non-utf8-octets"),
        # Frameworks that also split at ";" read a=2, a=3 from one and a=3, a=2 from the other.
        pytest.param(b"x=1;a=2&a=3", b"a=3&x=1;a=2", id="semicolon-separated"),
        pytest.param(b"x=1;a=2", b"x=1%3Ba=2", id="semicolon-vs-encoded"),
        # A malformed escape is kept, refused or dropped, depending on the upstream.
        pytest.param(b"q=%GG", b"q=%25GG", id="malformed-escape-vs-encoded-percent"),
        pytest.param(b"q=%", b"q=%25", id="lone-percent-vs-encoded"),
        pytest.param(b"q=%4", b"q=%254", id="short-escape-vs-encoded"),
    ],
)
def test_query_values_change_the_hash(query: bytes, other_query: bytes) -> None:
    assert fingerprint(query=query) != fingerprint(query=other_query)


@pytest.mark.parametrize(
    "difference",
    [
        pytest.param({"method": "PATCH"}, id="method"),
        pytest.param({"path": b"/v1/refunds"}, id="path"),
        pytest.param({"path": b"/v1/charges/"}, id="trailing-slash"),
        pytest.param({"content_type": b"application/x-www-form-urlencoded"}, id="content-type"),
        pytest.param({"content_type": None}, id="no-content-type"),
        pytest.param({"body": b""}, id="empty-body"),
        pytest.param({"headers": [(b"content-encoding", b"gzip")]}, id="content-encoding"),
        pytest.param({"headers": [(b"content-type", b"text/plain")]}, id="two-content-types"),
        pytest.param({"body": b'\xef\xbb\xbf{"amount":1250,"currency":"EUR"}'}, id="bom"),
        pytest.param({"body": '{"amount":1250,"currency":"EUR"}'.encode("utf-16")}, id="utf-16"),
    ],
)
def test_request_line_content_type_and_body_change_the_hash(difference: dict[str, object]) -> None:
    assert fingerprint(**difference) != fingerprint()  # type: ignore[arg-type]


def test_two_content_types_compare_the_body_as_bytes() -> None:
    # The upstream may obey the second type: {"a":1} and {"a":1.0} are then two texts.
    both = [(b"content-type", b"text/plain")]
    assert fingerprint(body=b'{"a":1}', headers=both) != fingerprint(
        body=b'{"a":1.0}', headers=both
    )
    assert fingerprint(body=b'{"a":1}') == fingerprint(body=b'{"a":1.0}')


def test_content_type_and_encoding_lists_never_run_together() -> None:
    assert fingerprint(
        content_type=None, headers=[(b"content-type", b"a"), (b"content-type", b"b")]
    ) != fingerprint(content_type=b"a", headers=[(b"content-encoding", b"b")])


def test_configured_extra_headers_change_the_hash() -> None:
    extra = (b"stripe-version",)

    def with_version(*values: bytes) -> str:
        headers = [(b"stripe-version", value) for value in values]
        return fingerprint(headers=headers, extra_headers=extra)

    assert with_version(b"2024-06-20") == with_version(b"2024-06-20")
    assert with_version(b"2024-06-20") != with_version(b"2023-10-16")
    assert with_version(b"2024-06-20") != with_version()
    assert with_version(b"a", b"b") != with_version(b"b", b"a")


def test_unconfigured_headers_do_not_change_the_hash() -> None:
    noisy = [
        (b"user-agent", b"curl/8"),
        (b"x-request-id", b"req-123"),
        (b"stripe-version", b"2024-06-20"),
        (b"idempotency-key", b"order-42"),
    ]

    assert fingerprint(headers=noisy) == fingerprint()


def field_by_field_cache_digest(key: RecordKey) -> str:
    """How earlier releases named a key's cache entry: entries they wrote must still be found."""
    digest = hashlib.sha256()
    for part in (key.tenant, key.operation, key.idempotency_key):
        encoded = part.encode()
        digest.update(len(encoded).to_bytes(4, "big") + encoded)
    return digest.hexdigest()


@given(tenant=st.text(max_size=70), operation=st.text(max_size=40), key=st.text(max_size=80))
def test_a_cache_entry_keeps_the_name_earlier_releases_gave_it(
    tenant: str, operation: str, key: str
) -> None:
    record_key = RecordKey(tenant, operation, key)
    digest = field_by_field_cache_digest(record_key)
    assert cache_key(record_key) == f"idgw:r:{{{digest}}}"
    assert cache_key(record_key, prefix="idgw:w:") == f"idgw:w:{{{digest}}}"


def test_a_cache_entrys_name_is_pinned() -> None:
    assert cache_key(RecordKey("tenant-a", "POST /v1/charges", "key-1")) == (
        "idgw:r:{e5bde7df9321830c5e09b525cf845157818c207f75f60b8620523c98dc09a10c}"
    )
