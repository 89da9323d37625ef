"""The built-in upstream: a raw asyncio HTTP/1.1 server with fixed answers (used without nginx).

    python -m benchmarks.upstream --port 9000

``/small`` answers a tiny JSON document to any method, ``/upload`` reads and discards any
request body then answers the same document, ``/large`` answers 1 MiB. Keep-alive, pipelining
and Content-Length or chunked request bodies are handled by httptools' parser (the one uvicorn
uses); the answers are prebuilt bytes, so the server spends its time in the event loop only.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import cast

import httptools

from benchmarks.runloop import run_fast

SMALL_BODY = b'{"ok":true}'
LARGE_BODY_BYTES = 1024 * 1024


def _response(status: bytes, content_type: bytes, body: bytes) -> bytes:
    head = (
        b"HTTP/1.1 " + status + b"\r\nContent-Type: " + content_type
        + b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n"
    )  # fmt: skip
    return head + body


SMALL = _response(b"200 OK", b"application/json", SMALL_BODY)
RESPONSES: dict[bytes, bytes] = {
    b"/small": SMALL,
    b"/upload": SMALL,
    b"/large": _response(b"200 OK", b"application/octet-stream", b"x" * LARGE_BODY_BYTES),
}
NOT_FOUND = _response(b"404 Not Found", b"application/json", b'{"error":"not found"}')


class _Connection(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self.transport is not None:
                self.transport.close()

    # httptools callbacks
    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_message_complete(self) -> None:
        path = self.url.split(b"?", 1)[0]
        self.url = b""
        if self.transport is None:
            return
        self.transport.write(RESPONSES.get(path, NOT_FOUND))
        if not self.parser.should_keep_alive():
            self.transport.close()


async def serve(host: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Connection, host, port, backlog=4096, reuse_address=True)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    async with server:
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    run_fast(serve(args.host, args.port))


if __name__ == "__main__":
    main()
