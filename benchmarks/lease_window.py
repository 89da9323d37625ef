"""The remaining window of the execution fence: ``python -m benchmarks.lease_window``.

    .venv/bin/python -m benchmarks.lease_window --url postgresql://postgres@127.0.0.1:5432/db

How long before an attempt reaches the upstream did the database last confirm its owner's
lease? A real gateway process on PostgreSQL forwards keyed requests to an upstream (in this
process) that answers each key's first attempt ``503`` with ``Retry-After: 1`` and its retry
``201``. On every arrival the upstream notes the time, then reads the record's
``lease_expires_at``: the database wrote it as its own ``now()`` plus the lease when it
granted or last renewed the lease, so ``arrival - (lease_expires_at - lease)`` is the window
from the last confirmation to the send, on one machine's clock (the database's ``now()`` is a
little later than the gateway's send, so this reads a little short of the owner's own
reckoning, by one statement's trip). The lease is long (30 s), so no heartbeat renewal falls
between an arrival and that read.

Two rows: the first attempt (confirmed by the reserve itself) and the retry (confirmed afresh
after the pause), each as p50, p99 and max over ``--keys`` keys.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path

import asyncpg

from benchmarks.processes import (
    clean_environment,
    free_port,
    spawn,
    venv_tool,
    wait_until_answers,
)
from idempotency_gateway.database_url import asyncpg_dsn_of
from idempotency_gateway.idempotency.lease import MARGIN_FRACTION
from idempotency_gateway.migrate import upgrade_to_head

LEASE = 30.0
_BUSY = b"HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Length: 0\r\n\r\n"
_CREATED = b"HTTP/1.1 201 Created\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"
_LEASE_GRANTED = """
SELECT extract(epoch FROM lease_expires_at) FROM idempotency_records WHERE idempotency_key = $1
"""


class Upstream:
    """Answers each key's first attempt 503, later ones 201; records every window."""

    def __init__(self, db: asyncpg.Pool) -> None:
        self.db = db
        self.windows: dict[int, list[float]] = defaultdict(list)
        self._attempts: dict[str, int] = defaultdict(int)
        self._reads: set[asyncio.Task[None]] = set()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                head = await reader.readuntil(b"\r\n\r\n")
            except (asyncio.IncompleteReadError, ConnectionError):
                writer.close()
                return
            arrived = time.time()
            fields = dict(line.split(b": ", 1) for line in head.split(b"\r\n")[1:] if b": " in line)
            fields = {name.lower(): value for name, value in fields.items()}
            await reader.readexactly(int(fields.get(b"content-length", b"0")))
            key = fields[b"idempotency-key"].decode()
            self._attempts[key] += 1
            attempt = self._attempts[key]
            read = asyncio.create_task(self._note(key, attempt, arrived))
            self._reads.add(read)
            read.add_done_callback(self._reads.discard)
            writer.write(_BUSY if attempt == 1 else _CREATED)
            await writer.drain()

    async def _note(self, key: str, attempt: int, arrived: float) -> None:
        lease_ends = await self.db.fetchval(_LEASE_GRANTED, key)
        self.windows[attempt].append(arrived - (float(lease_ends) - LEASE))

    async def settled(self) -> None:
        await asyncio.gather(*self._reads)


def _config(directory: Path, upstream_port: int) -> Path:
    path = directory / "gateway.yaml"
    path.write_text(f"""# written by benchmarks/lease_window.py
upstreams:
  primary:
    url: http://127.0.0.1:{upstream_port}
    retry: {{max_attempts: 2, cap: 5s}}
    # Every first attempt is a 503 on purpose: the breaker must not count them.
    breaker: {{min_calls: 10000}}
routes:
  - name: charges
    match: {{path_prefix: /}}
    upstream: primary
    idempotency: {{key: required, lease: {LEASE:g}s}}
lifecycle: {{drain_grace: 0s}}
""")
    return path


async def _send(port: int, key: str) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/charges HTTP/1.1\r\nHost: bench\r\nContent-Length: 2\r\n"
        b"Idempotency-Key: " + key.encode() + b"\r\nConnection: close\r\n\r\n{}"
    )
    await writer.drain()
    answer = await reader.read()
    writer.close()
    if not answer.startswith(b"HTTP/1.1 201"):
        raise RuntimeError(f"unexpected answer: {answer[:80]!r}")


async def measure(url: str, keys: int) -> dict[int, list[float]]:
    db = await asyncpg.create_pool(asyncpg_dsn_of(url), min_size=1, max_size=4)
    upstream = Upstream(db)
    server = await asyncio.start_server(upstream.serve, "127.0.0.1", 0)
    upstream_port = server.sockets[0].getsockname()[1]
    directory = Path(tempfile.mkdtemp(prefix="lease-window-"))
    port, admin_port = free_port(), free_port()
    argv = [
        venv_tool("idempotency-gateway"), "serve",
        "--config", str(_config(directory, upstream_port)),
        "--port", str(port), "--admin-port", str(admin_port), "--workers", "1",
    ]  # fmt: skip
    variables = {"GATEWAY_DATABASE_URL": url, "GATEWAY_SCOPE_SECRET": "benchmark-scope-secret"}
    gateway = spawn("gateway", argv, log_dir=directory, env=clean_environment(variables))
    try:
        await asyncio.to_thread(wait_until_answers, gateway, admin_port, "/readyz")
        run = uuid.uuid4().hex[:12]
        for index in range(keys):
            await _send(port, f"lease-window-{run}-{index}")
        await upstream.settled()
        return upstream.windows
    finally:
        gateway.stop()
        server.close()
        await db.close()


def _row(name: str, seconds: list[float]) -> str:
    ms = sorted(value * 1000 for value in seconds)
    p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
    return (
        f"| {name} | {len(ms)} | {statistics.median(ms):.2f} ms | {p99:.2f} ms | {ms[-1]:.2f} ms |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default=os.environ.get("GATEWAY_DATABASE_URL"), required=False)
    parser.add_argument("--keys", type=int, default=30)
    args = parser.parse_args()
    if not args.url or not args.url.startswith("postgres"):
        parser.error("--url (or GATEWAY_DATABASE_URL): a PostgreSQL database")
    upgrade_to_head(args.url)
    windows = asyncio.run(measure(args.url, args.keys))
    trusted = LEASE * (1 - MARGIN_FRACTION)
    print(f"lease {LEASE:g} s, trusted without a round trip for {trusted:g} s")
    print("| attempt | n | p50 | p99 | max |")
    print("|---|---|---|---|---|")
    print(_row("first (after the reserve)", windows[1]))
    print(_row("retry (after a 1 s pause)", windows[2]))


if __name__ == "__main__":
    main()
