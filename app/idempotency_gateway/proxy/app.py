"""``ProxyApp``: a pure ASGI reverse proxy to named upstreams.

Responses stream to the client as they arrive. Upstream failures become 502/504 problems,
and the idempotency layer is told whether the request left (``NOT_EXECUTED``) or may have
been acted on (``AMBIGUOUS``), which is what decides whether a key may run again.
Requests arrive routed (``routing.RouteRequests``): the canonical target and its route are in
the scope.
"""

from __future__ import annotations

from collections.abc import Mapping

from idempotency_gateway.asgi import (
    ClientDisconnected,
    Receive,
    Scope,
    Send,
    cancel_on_disconnect,
    read_body,
)
from idempotency_gateway.config import ErrorFormat, GatewayConfig, OnAmbiguous, RouteConfig
from idempotency_gateway.errors import (
    GatewayError,
    NoRouteMatched,
    UpstreamAmbiguous,
    UpstreamError,
    UpstreamNeverSent,
)
from idempotency_gateway.execution import Outcome, execution_of
from idempotency_gateway.problems import send_problem
from idempotency_gateway.proxy.deadline import Deadline
from idempotency_gateway.proxy.headers import client_response_headers, upstream_request_headers
from idempotency_gateway.proxy.resilient import (
    IDEMPOTENT_METHODS,
    SAFE_METHODS,
    ResilientUpstream,
    RetryPlan,
)
from idempotency_gateway.proxy.upstream_client import UpstreamRequest, UpstreamResponse
from idempotency_gateway.request_id import request_id_of
from idempotency_gateway.target import RequestTarget, target_of
from idempotency_gateway.telemetry.request_log import RequestOutcome, note_outcome, request_log_of


class ResponseCutShort(Exception):
    """The upstream's answer broke off mid-body; the server closes the client's connection."""


def upstream_target(base_path: bytes, target: RequestTarget) -> bytes:
    """The request line's target: the base URL's own path, the client's canonical path and
    its query.

    Scheme and authority come from the config alone (the client connects there and writes
    ``Host``); the canonical path starts with ``/`` and holds only path characters, and the
    query follows it as a query.
    """
    path = base_path + target.path
    return path + b"?" + target.query if target.query else path


def _key_runs_again_after_ambiguity(route: RouteConfig | None, keyed: bool) -> bool:
    """Whether a keyed execution that may have reached the upstream leaves its record
    retryable (``on_ambiguous: retry``): the one decision behind both the proxy's own retry
    of an ambiguous failure and the ``retryable`` the client is told."""
    return keyed and route is not None and route.idempotency.on_ambiguous is OnAmbiguous.RETRY


class ProxyApp:
    def __init__(self, config: GatewayConfig, upstreams: Mapping[str, ResilientUpstream]) -> None:
        self.config = config
        self.upstreams = upstreams
        self.key_header = config.idempotency_header.lower().encode("ascii")
        # Parsed once: a request never gets to take part in parsing where it goes.
        self.base_paths = {name: upstream.client.base_path for name, upstream in upstreams.items()}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1003})
            return
        try:
            await self._forward(scope, receive, send)
        except ClientDisconnected:
            return
        except UpstreamError as error:
            self._report(scope, error)
            await self._send_error(scope, send, self._answer_for(scope, error))
        except GatewayError as error:
            await self._send_error(scope, send, error)

    async def _send_error(self, scope: Scope, send: Send, error: GatewayError) -> None:
        route = target_of(scope).route
        error_format = route.idempotency.error_format if route else ErrorFormat.PROBLEM
        await send_problem(send, error, request_id=request_id_of(scope), error_format=error_format)

    def _report(self, scope: Scope, error: UpstreamError) -> None:
        """Tell the idempotency layer whether the request left."""
        not_sent = isinstance(error, UpstreamNeverSent)
        if not_sent:
            note_outcome(scope, RequestOutcome.NOT_EXECUTED)
        execution = execution_of(scope)
        if execution is not None:
            execution.report(Outcome.NOT_EXECUTED if not_sent else Outcome.AMBIGUOUS)

    def _answer_for(self, scope: Scope, error: UpstreamError) -> UpstreamError:
        """The error the client gets: it says whether a retry with its key will run again."""
        if isinstance(error, UpstreamAmbiguous) and _key_runs_again_after_ambiguity(
            target_of(scope).route, execution_of(scope) is not None
        ):
            # The record stays retryable: the client's retry with the key runs again.
            return type(error)(error.detail, retryable=True)
        return error

    async def _forward(self, scope: Scope, receive: Receive, send: Send) -> None:
        target = target_of(scope)
        route = target.route
        if route is None:
            raise NoRouteMatched(f"no route matches {target.path_text}")
        upstream = self.upstreams[route.upstream]
        entry = request_log_of(scope)
        if entry is not None:
            entry.route, entry.upstream = route.name, upstream.name
        headers = scope["headers"]
        body = await read_body(receive, headers, limit=self.config.limits.max_request_body)
        request_target = upstream_target(self.base_paths[route.upstream], target)

        def make_request(head_within: float) -> UpstreamRequest:
            return UpstreamRequest(
                method=scope["method"],
                target=request_target,
                headers=upstream_request_headers(
                    scope,
                    key_header=self.key_header,
                    trusted_proxies=self.config.trusted_proxies,
                    timeout_seconds=head_within,
                ),
                body=body,
            )

        deadline = Deadline.for_request(headers, upstream.client.config.timeouts.total)
        execution = execution_of(scope)
        response = await cancel_on_disconnect(
            scope,
            receive,
            upstream.open(
                make_request,
                deadline=deadline,
                plan=self._retry_plan(route, scope["method"], keyed=execution is not None),
                request_log=entry,
                execution=execution,
            ),
        )
        try:
            await self._stream_back(scope, response, send)
        except UpstreamError as error:
            self._report(scope, error)
            # The head already went out: a broken connection is the only honest signal left.
            raise ResponseCutShort(str(error)) from error
        finally:
            response.release()

    @staticmethod
    def _retry_plan(route: RouteConfig, method: str, *, keyed: bool) -> RetryPlan:
        # A key forwarded upstream makes any method safe to resend: the record and the
        # upstream both dedupe on it.
        return RetryPlan(
            idempotent=keyed or method in IDEMPOTENT_METHODS,
            retry_ambiguous=method in SAFE_METHODS or _key_runs_again_after_ambiguity(route, keyed),
            ambiguous_statuses=route.idempotency.outcomes.ambiguous,
        )

    @staticmethod
    async def _stream_back(scope: Scope, response: UpstreamResponse, send: Send) -> None:
        headers = client_response_headers(
            response.headers, scope.get("http_version", "1.1"), status=response.status
        )
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        last = False
        async for chunk, last in response.chunks():
            # The last chunk ends the answer itself: no empty message after it to pass
            # through every layer.
            await send({"type": "http.response.body", "body": chunk, "more_body": not last})
        if not last:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
