"""A library user's app on the base install (no extras), run by tests/test_package.py.

``IdempotencyMiddleware`` on the embedded SQLite store around a Starlette app, called the way
a server calls it, over raw ASGI: the base install has neither a server nor an HTTP client.
A keyed charge and its retry go through; one JSON line says what each got and how many times
the endpoint ran. Usage: ``python base_install_app.py DATABASE_FILE``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from idempotency_gateway import (
    IdempotencyConfig,
    IdempotencyMiddleware,
    StoreConfig,
    open_store,
    upgrade_to_head,
)

executions = 0


async def create_charge(request: Request) -> JSONResponse:
    global executions
    executions += 1
    return JSONResponse({"id": f"ch_{executions}", "body": (await request.json())}, 201)


async def post_charge(app: IdempotencyMiddleware, key: str) -> dict[str, Any]:
    """One keyed POST as a server hands it over; the answer's status, marker and body."""
    messages = [{"type": "http.request", "body": b'{"amount": 1000}', "more_body": False}]
    sent: list[MutableMapping[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: MutableMapping[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/charges",
        "raw_path": b"/v1/charges",
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"payments.internal"),
            (b"content-type", b"application/json"),
            (b"idempotency-key", key.encode()),
        ],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 80),
    }
    await app(scope, receive, send)
    start = sent[0]
    headers = {name.decode(): value.decode() for name, value in start["headers"]}
    body = b"".join(message.get("body", b"") for message in sent[1:])
    return {
        "status": start["status"],
        "replayed": headers.get("idempotent-replayed"),
        "body": body.decode(),
    }


async def main(database: Path) -> dict[str, Any]:
    url = f"sqlite:///{database}"
    upgrade_to_head(url)
    store = open_store(url, StoreConfig())
    app = IdempotencyMiddleware(
        Starlette(routes=[Route("/v1/charges", create_charge, methods=["POST"])]),
        store=store,
        policy=IdempotencyConfig(key="required"),
        scope_secret="the base install",
    )
    await store.start()
    try:
        answers = [await post_charge(app, "base-install-1") for _ in range(2)]
    finally:
        await app.close()
        await store.close()
    return {"answers": answers, "executions": executions}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(Path(sys.argv[1])))))
