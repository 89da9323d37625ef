"""RFC 9457 problem responses, sent over raw ASGI so any layer can answer with one."""

from __future__ import annotations

import orjson

from idempotency_gateway.asgi import Headers, Send
from idempotency_gateway.errors import GatewayError

PROBLEM_CONTENT_TYPE = b"application/problem+json"


def problem_body(error: GatewayError, *, request_id: str | None) -> bytes:
    document: dict[str, object] = {
        "type": error.problem_type,
        "title": error.title,
        "status": error.status,
        "detail": error.detail,
        "retryable": error.retryable,
    }
    if request_id is not None:
        document["request_id"] = request_id
    return orjson.dumps(document)


def problem_headers(error: GatewayError, body: bytes) -> Headers:
    headers: Headers = [
        (b"content-type", PROBLEM_CONTENT_TYPE),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
    ]
    if error.retry_after is not None:
        headers.append((b"retry-after", str(error.retry_after).encode()))
    return headers


async def send_problem(send: Send, error: GatewayError, *, request_id: str | None) -> None:
    body = problem_body(error, request_id=request_id)
    await send(
        {
            "type": "http.response.start",
            "status": error.status,
            "headers": problem_headers(error, body),
        }
    )
    await send({"type": "http.response.body", "body": body, "more_body": False})
