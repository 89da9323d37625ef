"""The answer an app that raised would have sent: what a keyed request's retries see.

A keyed request whose handler raises gets the answer the app itself renders for a failure,
stored as final (as Stripe does: the first answer, a 500 included, is what every retry
sees). On Starlette and FastAPI that is the handler registered for ``500`` or ``Exception``
on ``scope["app"]`` (the one Starlette's ``ServerErrorMiddleware`` would call), else
Starlette's own plain ``Internal Server Error``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

from idempotency_gateway.asgi import Receive, Scope, Send


def _failure_handler(scope: Scope) -> Callable[..., Any] | None:
    handlers = getattr(scope.get("app"), "exception_handlers", None)
    if not isinstance(handlers, dict):
        return None
    handler = handlers.get(500) or handlers.get(Exception)
    return handler if callable(handler) else None


async def send_app_failure(scope: Scope, receive: Receive, send: Send, error: Exception) -> None:
    """Send the app's own answer to ``error``: its 500 handler's, else a plain 500."""
    handler = _failure_handler(scope)
    response: Response
    if handler is None:
        response = PlainTextResponse("Internal Server Error", status_code=500)
    else:
        rendered = handler(Request(scope, receive), error)
        response = await rendered if inspect.isawaitable(rendered) else rendered
    await response(scope, receive, send)
