"""Two JSON bodies whose values differ exactly never share a fingerprint; equal values do.

The oracle is independent of the canonical form: numbers become ``Fraction`` (exact), and
every value is tagged with its JSON type, so ``true`` never equals ``1``.
"""

from __future__ import annotations

import decimal
import json
from fractions import Fraction
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idempotency_gateway.idempotency.fingerprint import MAX_NUMBER_LITERAL, request_hash

numbers = st.one_of(
    st.integers(min_value=-(2**130), max_value=2**130),
    st.decimals(allow_nan=False, allow_infinity=False, places=None),
    st.sampled_from(
        [decimal.Decimal(text) for text in ("20", "19.999999999999999", "2e1", "1.0", "-0", "0e9")]
    ),
)
scalars = st.one_of(st.none(), st.booleans(), st.text(max_size=5), numbers)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=3), inner, max_size=3)
    ),
    max_leaves=8,
)


def exact(value: Any) -> Any:
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return (type(value).__name__, value)
    if isinstance(value, int | decimal.Decimal):
        return ("number", Fraction(value))
    if isinstance(value, list):
        return ("array", tuple(exact(item) for item in value))
    return ("object", frozenset((name, exact(item)) for name, item in value.items()))


def as_json(value: Any) -> bytes:
    if isinstance(value, decimal.Decimal):
        return str(value).encode()  # exact: 1E+3, 0.000001, -0
    if isinstance(value, list):
        return b"[" + b",".join(as_json(item) for item in value) + b"]"
    if isinstance(value, dict):
        members = (json.dumps(name).encode() + b":" + as_json(item) for name, item in value.items())
        return b"{" + b",".join(members) + b"}"
    return json.dumps(value).encode()


def fingerprint(body: bytes) -> str:
    return request_hash(
        method="POST",
        path=b"/v1/charges",
        query_string=b"",
        headers=[(b"content-type", b"application/json")],
        body=body,
    )


@settings(max_examples=300, deadline=None)
@given(first=values, second=values)
def test_fingerprints_are_equal_exactly_when_the_values_are(first: Any, second: Any) -> None:
    same = exact(first) == exact(second)

    assert (fingerprint(as_json(first)) == fingerprint(as_json(second))) is same


@pytest.mark.parametrize(
    ("body", "other"),
    [
        (b'{"amount": 20}', b'{"amount": 19.999999999999999}'),
        (b"18446744073709551616", b"18446744073709551617"),
        (b"1" + b"0" * 5000, b"1" + b"0" * 4999 + b"1"),
        (b'{"a": 2}', b'{"a": 1, "a": 2}'),
        (b'{"a": 1, "a": 2}', b'{"a": 2, "a": 1}'),
        (b'"\\ud800"', b'"\\ud801"'),
        (b"true", b"1"),
        # Over MAX_NUMBER_LITERAL characters a number is compared as bytes: stricter.
        (b"1" + b"0" * MAX_NUMBER_LITERAL, b"1E" + str(MAX_NUMBER_LITERAL).encode()),
    ],
)
def test_values_that_differ_exactly_are_different_requests(body: bytes, other: bytes) -> None:
    assert fingerprint(body) != fingerprint(other)


@pytest.mark.parametrize(
    ("body", "same"),
    [
        (b'{"amount": 20, "n": 1}', b'{"n":1.0,"amount":2e1}'),
        (b"[0]", b"[-0.000]"),
        (b"18446744073709551616", b"1.8446744073709551616e19"),
        (b"[1" + b"0" * 4000 + b"]", b"[1e4000]"),
        (b"[-25" + b"0" * 100 + b"]", b"[-2.5e101]"),
    ],
)
def test_the_same_exact_value_written_differently_is_one_request(body: bytes, same: bytes) -> None:
    assert fingerprint(body) == fingerprint(same)


def test_a_body_with_duplicate_keys_is_compared_as_bytes() -> None:
    duplicated = b'{"a": 1, "a": 2}'

    assert fingerprint(duplicated) == fingerprint(duplicated)
    assert fingerprint(duplicated) != fingerprint(b'{"a":1,"a":2}')  # whitespace now counts


_JSON = [(b"content-type", b"application/json")]


@pytest.mark.parametrize(
    ("request_fields", "pinned"),
    [
        (
            {"method": "POST", "path": b"/v1/charges", "query_string": b"", "headers": _JSON,
             "body": b'{"amount": 100, "currency": "eur"}'},
            "a439f40db4c96d95124590f12144b89152af2aaf86dff2c2ca1208e0101eeff6",
        ),
        (
            {"method": "POST", "path": b"/v1/charges", "query_string": b"b=2&a=1&flag",
             "headers": _JSON, "body": b'{"b":1,"a":[1.0,2e0]}'},
            "e8fbbbf57a85f1b8b1fd958177d99a7dd5e543745534d0929f727b27d06f3493",
        ),
        (
            {"method": "PATCH", "path": b"/v1/orders/7", "query_string": b"x=1;y=2",
             "headers": [(b"content-type", b"text/plain")], "body": b"plain bytes"},
            "082a1e0c9ad413eddea5afe49dcf448fb64799c25a8ff144f777bff3b5e16187",
        ),
        (
            {"method": "POST", "path": b"/v1/charges", "query_string": b"",
             "headers": [*_JSON, (b"x-tenant", b"t1")], "body": b"{}",
             "extra_headers": (b"x-tenant",)},
            "43a318cfa86d7bc78937dc5fe589d6a4cb9496f9b15fd4bc20851e81c0f8363b",
        ),
        (
            {"method": "POST", "path": b"/", "query_string": b"", "headers": [], "body": b""},
            "48a7ef42712552026eafc77579326cfa04eb195e38c39400be25c05f4b01e4b5",
        ),
    ],
)  # fmt: skip
def test_a_fingerprint_stays_what_earlier_versions_stored(
    request_fields: dict[str, Any], pinned: str
) -> None:
    """Records outlive upgrades: a retry that reaches a newer gateway must hash as the
    first attempt did under the older one, or it gets a false 422. Pinned values, computed
    before any change to how the fingerprint is worked out: empty and ordered queries, one
    compared as sent, canonical JSON, bytes, a chosen extra header, nothing at all."""
    assert request_hash(**request_fields) == pinned
