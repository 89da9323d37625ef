"""Raw-socket clients of a real ``idempotency-gateway serve`` process for the edge suites.

Every request is written byte for byte and every answer parsed from the wire, because an
ordinary HTTP client would normalize the attacks these suites send.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.charges import CHARGES
from tests.support.gateway import gateway_config, route
from tests.support.problems import PROBLEM_JSON, slug_of
from tests.support.servers import GatewayProcess, write_config

READ_BOUND = 15.0


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]
    """Lower-cased names; the last value when a name repeats."""
    head: bytes
    body: bytes

    @property
    def problem_slug(self) -> str:
        assert self.headers.get("content-type") == PROBLEM_JSON, self.head
        return slug_of(json.loads(self.body)["type"])


def assert_closing_problem(reply: Reply, status: int, slug: str) -> None:
    assert (reply.status, reply.problem_slug) == (status, slug)
    assert reply.headers["connection"] == "close"


def parse_reply(data: bytes) -> Reply:
    head, separator, body = data.partition(b"\r\n\r\n")
    assert separator, f"no complete response head in {data[:200]!r}"
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return Reply(int(status_line.split(" ")[1]), headers, head, body)


async def exchange(port: int, *writes: bytes) -> bytes:
    """Writes each chunk separately, then reads until the gateway closes the connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for chunk in writes:
            writer.write(chunk)
            await writer.drain()
        return await asyncio.wait_for(reader.read(), READ_BOUND)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


def request(
    method: str, path: str, fields: Sequence[tuple[str, str]] = (), body: bytes = b""
) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: edge.test", *(f"{n}: {v}" for n, v in fields)]
    if body:
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def new_key() -> str:
    return f"edge-{uuid.uuid4()}"


@contextlib.asynccontextmanager
async def edge_gateway(
    tmp_path: Path,
    postgres_url: str,
    upstream_url: str,
    *,
    on_ambiguous: str = "retry",
    anonymous: str = "allow",
    **settings: Any,
) -> AsyncIterator[GatewayProcess]:
    config = gateway_config(
        upstream_url,
        routes=[
            route(CHARGES, key="required", on_ambiguous=on_ambiguous, anonymous=anonymous),
            route("/", name="default"),
        ],
        retry={"max_attempts": 1},
        **settings,
    )
    gateway = GatewayProcess(
        write_config(tmp_path, config.model_dump(mode="json")),
        env={"GATEWAY_DATABASE_URL": postgres_url},
        log_dir=tmp_path,
        # A worker is a fresh interpreter importing the whole gateway: on a machine busy
        # with other suites that alone has taken over 20 seconds.
        startup_timeout=60.0,
    )
    async with gateway:
        yield gateway
