"""The upstream HTTP client: one pooled aiohttp session per upstream, behind a small API.

aiohttp's client is the hot path (several times httpx's throughput as a proxy on the same
machine). Everything aiohttp-specific lives here, including the one place where its
exceptions become the gateway's ``UpstreamError`` tree, so the client can be swapped.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
from yarl import URL

from idempotency_gateway.asgi import Headers
from idempotency_gateway.config import UpstreamConfig
from idempotency_gateway.errors import (
    UpstreamConnectionLost,
    UpstreamError,
    UpstreamInvalidResponse,
    UpstreamNotSent,
    UpstreamTimeout,
    is_final_status,
)

_CHUNK = 64 * 1024


@dataclass(frozen=True, slots=True)
class UpstreamRequest:
    method: str
    url: str
    headers: list[tuple[str, str]]
    body: bytes


def translate_error(exc: BaseException, upstream: str) -> UpstreamError:
    """aiohttp's failures, sorted by the one thing that matters: did the request leave?"""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):
        return UpstreamNotSent(f"connecting to upstream {upstream!r} timed out")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return UpstreamNotSent(f"cannot connect to upstream {upstream!r}: {exc.os_error}")
    if isinstance(exc, TimeoutError):
        return UpstreamTimeout(
            f"upstream {upstream!r} did not answer in time; the request may or may not "
            "have been processed"
        )
    return UpstreamConnectionLost(
        f"the connection to upstream {upstream!r} broke before a complete answer "
        f"({type(exc).__name__}); the request may or may not have been processed"
    )


class UpstreamResponse:
    def __init__(self, response: aiohttp.ClientResponse, upstream: str) -> None:
        self._response = response
        self._upstream = upstream
        self.status = response.status
        self.headers: Headers = [(name.lower(), value) for name, value in response.raw_headers]

    def header(self, name: str) -> str | None:
        return self._response.headers.get(name)

    def release(self) -> None:
        self._response.release()

    async def chunks(self) -> AsyncIterator[tuple[bytes, bool]]:
        """The body as it arrives, each chunk with whether it is the last (the whole body
        was received and nothing is left to read); a broken stream raises an
        ``UpstreamError``."""
        content = self._response.content
        try:
            async for chunk in content.iter_chunked(_CHUNK):
                yield chunk, content.is_eof()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise translate_error(exc, self._upstream) from exc


class UpstreamClient:
    def __init__(self, name: str, config: UpstreamConfig) -> None:
        self.name = name
        self.config = config
        self._session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        timeouts = self.config.timeouts
        connector = aiohttp.TCPConnector(
            limit=self.config.pool.max_connections,
            limit_per_host=0,
            keepalive_timeout=self.config.pool.keepalive,
        )
        self._session = aiohttp.ClientSession(
            connector=connector,
            # Clients must never share cookies through the gateway.
            cookie_jar=aiohttp.DummyCookieJar(),
            # Bodies pass through byte for byte, Content-Encoding and all.
            auto_decompress=False,
            # connect covers waiting for a pooled connection too; sock_read bounds every
            # silence, between body chunks as well as before the status line.
            timeout=aiohttp.ClientTimeout(
                total=None, connect=timeouts.connect, sock_read=timeouts.per_try
            ),
            skip_auto_headers=("User-Agent", "Accept", "Accept-Encoding", "Content-Type"),
        )
        # aiohttp silently resends GET/PUT/DELETE once when a pooled connection breaks. A
        # PUT the upstream may already have executed must not go out twice behind the
        # gateway's back: whether to try again is the gateway's decision, made explicitly.
        self._session._retry_connection = False

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def open(self, request: UpstreamRequest, *, head_within: float) -> UpstreamResponse:
        """One attempt: ``head_within`` seconds bound the wait for the response head.
        The caller must ``release()`` the response."""
        assert self._session is not None, "UpstreamClient.start() was not called"
        try:
            async with asyncio.timeout(head_within):
                response = await self._session.request(
                    request.method,
                    # Already encoded: the upstream must see the client's path byte for byte.
                    URL(request.url, encoded=True),
                    headers=request.headers,
                    data=request.body or None,
                    allow_redirects=False,
                )
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise translate_error(exc, self.name) from exc
        if not is_final_status(response.status):
            response.release()
            raise UpstreamInvalidResponse(
                f"upstream {self.name!r} answered with status {response.status}, which is "
                "not a final HTTP status; the request may or may not have been processed"
            )
        return UpstreamResponse(response, self.name)
