"""A fake LLM upstream: each POST answers ``text/event-stream``, one event per token.

The test sets the pace: a token goes out only when the test has released it
(``release(key, n)``), unless the request asks for all of them at once. The request's JSON
body says how many tokens, whether events carry ``id:`` lines and how many bytes of padding
each carries; calls are counted per ``Idempotency-Key``.

    async with TokenUpstream() as upstream:
        body = chat(tokens=8, ids=True)
        ...
        upstream.release(key, 3)
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

from aiohttp import web

from tests.support.lifecycle import StartedInContext


def chat(tokens: int, *, ids: bool = False, padding: int = 0, paced: bool = True) -> bytes:
    """A request body for the fake LLM."""
    return json.dumps({"tokens": tokens, "ids": ids, "padding": padding, "paced": paced}).encode()


def token_event(index: int, *, ids: bool, padding: int = 0) -> bytes:
    event_id = b"id: %d\n" % index if ids else b""
    return event_id + b"data: token-%d%s\n\n" % (index, b" " + b"x" * padding if padding else b"")


def whole_output(tokens: int, *, ids: bool = False, padding: int = 0) -> list[bytes]:
    """The events of one execution, in order."""
    return [token_event(index, ids=ids, padding=padding) for index in range(tokens)]


class TokenUpstream(StartedInContext):
    def __init__(self) -> None:
        self.calls: Counter[str] = Counter()
        self._gates: dict[str, asyncio.Semaphore] = {}
        self._runner: web.AppRunner | None = None
        self.url = ""

    def _gate(self, key: str) -> asyncio.Semaphore:
        return self._gates.setdefault(key, asyncio.Semaphore(0))

    def release(self, key: str, tokens: int) -> None:
        """Let ``tokens`` more tokens of the stream for ``key`` go out."""
        gate = self._gate(key)
        for _ in range(tokens):
            gate.release()

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._chat)
        runner = web.AppRunner(app, handle_signals=False, handler_cancellation=True)
        await runner.setup()
        self._runner = runner
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{runner.addresses[0][1]}"

    async def close(self) -> None:
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        key = request.headers.get("Idempotency-Key", "")
        self.calls[key] += 1
        spec: dict[str, Any] = await request.json()
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        for index in range(spec["tokens"]):
            if spec["paced"]:
                await self._gate(key).acquire()
            await response.write(token_event(index, ids=spec["ids"], padding=spec["padding"]))
        await response.write_eof()
        return response
