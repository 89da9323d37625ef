"""The direct Redis path packs its commands with hiredis, byte for byte as redis-py would.

Against the real Redis: binary values (CRLF, NUL, every byte), non-ASCII names and integer
arguments go out and come back unchanged, with hiredis's packer and with redis-py's own (the
path a redis-py without hiredis takes); and for any such command the two packers write the
same bytes.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from hypothesis import given
from hypothesis import strategies as st
from redis.asyncio import Redis
from redis.asyncio.connection import Connection

from idempotency_gateway.replay import redis_direct
from idempotency_gateway.replay.redis_direct import DirectCommands

EVERY_BYTE = bytes(range(256))
names = st.text(min_size=1, max_size=40).filter(lambda text: " " not in text)
arguments = st.one_of(st.binary(max_size=300), names, st.integers(0, 2**62))


@given(name=names, rest=st.lists(arguments, max_size=4), pipelined=st.lists(names, max_size=3))
def test_hiredis_writes_what_redis_py_would(
    name: str, rest: list[bytes | str | int], pipelined: list[str]
) -> None:
    connection = Connection()
    commands = [("SET", name, *rest), *(("GET", other) for other in pipelined)]

    packed = redis_direct._pack(connection, commands)

    assert packed == b"".join(connection.pack_commands(commands))


@pytest.fixture(params=["hiredis", "redis-py"])
async def direct(
    request: pytest.FixtureRequest, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[DirectCommands]:
    if request.param == "redis-py":
        monkeypatch.setattr(redis_direct, "_HIREDIS_PACK", None)
    client = Redis.from_url(redis_url)
    commands = DirectCommands(client)
    yield commands
    await commands.close()
    await client.aclose()


async def test_binary_values_and_names_come_back_unchanged(direct: DirectCommands) -> None:
    name = f"packing-{uuid.uuid4().hex}-ключ"
    value = b"\r\n" + EVERY_BYTE + b"\r\n$3\r\n"

    replies = await direct.run_batched(
        ("SET", name, value, "PX", 60_000), ("GET", name), ("PTTL", name)
    )

    assert replies[0] == b"OK"
    assert replies[1] == value
    assert 0 < replies[2] <= 60_000
    assert await direct.run(("DEL", name)) == [1]
