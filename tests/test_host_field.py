"""The Host field's check: a verdict remembered per value, never for a value too long to be
a host, whatever the order the values come in."""

from __future__ import annotations

import pytest

from idempotency_gateway.errors import MalformedRequest
from idempotency_gateway.server import message
from idempotency_gateway.server.message import check_request_head

NAME_AT_LIMIT = b"h" * 253 + b":65535"


@pytest.mark.parametrize("repeat", [1, 2])
@pytest.mark.parametrize(
    ("host", "valid"),
    [
        (b"api.example", True),
        (b"api.example:65535", True),
        (b"api.example:65536", False),
        (b"[::1]:8080", True),
        (b"a,b", False),
        (NAME_AT_LIMIT, True),
        (b"h" + NAME_AT_LIMIT, False),
    ],
)
def test_a_host_has_the_same_verdict_every_time(host: bytes, valid: bool, repeat: int) -> None:
    for _ in range(repeat):
        if valid:
            check_request_head("1.1", [(b"host", host)])
        else:
            with pytest.raises(MalformedRequest):
                check_request_head("1.1", [(b"host", host)])


def test_a_value_too_long_to_be_a_host_takes_no_room_among_the_remembered() -> None:
    message._is_authority.cache_clear()
    for length in range(300, 310):
        with pytest.raises(MalformedRequest):
            check_request_head("1.1", [(b"host", b"h" * length)])

    assert message._is_authority.cache_info().currsize == 0
