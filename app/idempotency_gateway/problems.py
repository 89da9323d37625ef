"""The gateway's own error answers, sent over raw ASGI so any layer can answer with one.

RFC 9457 problem documents by default. A route with ``idempotency.error_format: stripe``
answers in the body Stripe's API uses (``{"error": {"type", "code", "message"}}``) instead:
Stripe's SDKs read only that shape, and report anything else as an unparseable response.
"""

from __future__ import annotations

import orjson

from idempotency_gateway.asgi import Headers, Send
from idempotency_gateway.config import ErrorFormat
from idempotency_gateway.errors import GatewayError, KeyReusedWithDifferentRequest

PROBLEM_CONTENT_TYPE = b"application/problem+json"
# RFC 9110 section 11.6.1: every 401 carries a challenge. Bearer is the scheme of the admin
# token and of the API keys most upstreams behind the gateway take.
CHALLENGE = b"Bearer"
JSON_CONTENT_TYPE = b"application/json"
# Stripe's names for the situations it shares with the gateway; other errors use our slug.
STRIPE_CODES = {
    "request-in-flight": "idempotency_key_in_use",
    "idempotency-key-reused": "idempotency_key_reused",
}


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


def stripe_status(error: GatewayError) -> int:
    # Stripe answers a reused key with 400, and its SDKs raise IdempotencyError only for a
    # 400 or 404: a 422 would surface as a generic APIError.
    return 400 if isinstance(error, KeyReusedWithDifferentRequest) else error.status


def stripe_error_type(error: GatewayError) -> str:
    if error.status >= 500:
        return "api_error"
    if error.status in (409, 422):
        return "idempotency_error"
    return "invalid_request_error"


def stripe_body(error: GatewayError, *, request_id: str | None) -> bytes:
    document: dict[str, object] = {
        "type": stripe_error_type(error),
        "code": STRIPE_CODES.get(error.slug, error.slug.replace("-", "_")),
        "message": error.detail,
    }
    if request_id is not None:
        document["request_id"] = request_id
    return orjson.dumps({"error": document})


def problem_headers(
    error: GatewayError, body: bytes, *, content_type: bytes = PROBLEM_CONTENT_TYPE
) -> Headers:
    headers: Headers = [
        (b"content-type", content_type),
        (b"content-length", str(len(body)).encode()),
        (b"cache-control", b"no-store"),
    ]
    if error.retry_after is not None:
        headers.append((b"retry-after", str(error.retry_after).encode()))
    if error.status == 401:
        headers.append((b"www-authenticate", CHALLENGE))
    return headers


def error_answer(
    error: GatewayError, *, request_id: str | None, error_format: ErrorFormat
) -> tuple[int, Headers, bytes]:
    """Status, headers and body of the answer to ``error`` in ``error_format``."""
    if error_format is ErrorFormat.STRIPE:
        body = stripe_body(error, request_id=request_id)
        headers = problem_headers(error, body, content_type=JSON_CONTENT_TYPE)
        return stripe_status(error), headers, body
    body = problem_body(error, request_id=request_id)
    return error.status, problem_headers(error, body), body


async def send_problem(
    send: Send,
    error: GatewayError,
    *,
    request_id: str | None,
    error_format: ErrorFormat = ErrorFormat.PROBLEM,
) -> None:
    status, headers, body = error_answer(error, request_id=request_id, error_format=error_format)
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
