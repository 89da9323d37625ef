"""A worker's memory under slow and oversized clients (the numbers in README "Limits").

    python -m benchmarks.edge_memory --port 8080 --pid WORKER_PID

Opens ``--slow`` connections that trickle a request head one field at a time, and
``--big`` connections that each send ``--big-mib`` MiB of header field, then reports the
worker's peak VmRSS (read from /proc) against its idle RSS, and how many of each kind the
gateway had closed by the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from pathlib import Path

_CHUNK = b"X-Padding: " + b"a" * (64 * 1024 - 13) + b"\r\n"


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


async def _closed_by_peer(reader: asyncio.StreamReader) -> bool:
    with contextlib.suppress(ConnectionError):
        await reader.read()
    return True


async def slow_client(port: int, seconds: float) -> bool:
    """Sends one short field per second; True when the gateway closed the connection first."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    closed = asyncio.ensure_future(_closed_by_peer(reader))
    try:
        writer.write(b"POST /v1/charges HTTP/1.1\r\nHost: bench\r\n")
        for _ in range(int(seconds)):
            if closed.done():
                return True
            writer.write(b"X-Slow: 1\r\n")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(closed), 1.0)
        return closed.done()
    except ConnectionError:
        return True
    finally:
        closed.cancel()
        writer.close()


async def big_client(port: int, mib: int) -> bool:
    """Sends ``mib`` MiB of header field; True when the gateway refused before the end."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"POST /v1/charges HTTP/1.1\r\nHost: bench\r\n")
        for _ in range(mib * 16):
            writer.write(_CHUNK)
            await writer.drain()
        return False
    except ConnectionError:
        return True
    finally:
        writer.close()


async def measure(port: int, pid: int, slow: int, big: int, big_mib: int, seconds: float) -> None:
    idle = rss_kib(pid)
    peak = idle
    work = asyncio.gather(
        *(slow_client(port, seconds) for _ in range(slow)),
        *(big_client(port, big_mib) for _ in range(big)),
    )
    while not work.done():
        peak = max(peak, rss_kib(pid))
        await asyncio.sleep(0.1)
    results = work.result()
    print(f"idle RSS {idle / 1024:.1f} MiB, peak {peak / 1024:.1f} MiB")
    print(f"slow connections closed by the gateway: {sum(results[:slow])}/{slow}")
    print(f"oversized heads refused: {sum(results[slow:])}/{big}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.edge_memory")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--pid", type=int, required=True, help="the worker process")
    parser.add_argument("--slow", type=int, default=300)
    parser.add_argument("--big", type=int, default=4)
    parser.add_argument("--big-mib", type=int, default=50)
    parser.add_argument("--seconds", type=float, default=40.0)
    args = parser.parse_args()
    asyncio.run(measure(args.port, args.pid, args.slow, args.big, args.big_mib, args.seconds))


if __name__ == "__main__":
    main()
