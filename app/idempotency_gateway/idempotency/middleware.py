"""``IdempotencyMiddleware``: a pure ASGI middleware that makes retried requests safe.

Per ``(tenant, operation, key)`` at most one execution commits; duplicates get the stored
answer replayed, a 409 while the first runs, or a 422 when the key is reused for a different
request. Requests a route does not cover go straight through with no store round trip.
This module turns an ASGI request into a ``KeyedRequest``; ``engine`` decides its fate.
"""

from __future__ import annotations

import asyncio
import functools
import logging

from idempotency_gateway.asgi import (
    ASGIApp,
    ClientDisconnected,
    Receive,
    Scope,
    Send,
    read_body,
    replay_receive,
)
from idempotency_gateway.config import (
    DEFAULT_IDEMPOTENCY_HEADER,
    DEFAULT_STORE_UNAVAILABLE,
    AnonymousPolicy,
    CacheConfig,
    KeyPolicy,
    LimitsConfig,
    ScopeConfig,
    StoreConfig,
    StoreUnavailablePolicy,
)
from idempotency_gateway.errors import (
    CredentialRequired,
    GatewayError,
    MissingIdempotencyKey,
    OperationTooLong,
    StoreUnavailable,
)
from idempotency_gateway.idempotency.endpoints import RouteMarkers
from idempotency_gateway.idempotency.engine import IdempotencyEngine, KeyedRequest
from idempotency_gateway.idempotency.fingerprint import fingerprint, request_hash
from idempotency_gateway.idempotency.keys import (
    ANONYMOUS_TENANT,
    parse_idempotency_key,
    tenant_of,
    with_bare_key,
)
from idempotency_gateway.idempotency.orphans import OrphanReleases
from idempotency_gateway.idempotency.policy import PolicySource, RoutePolicy, resolver_for
from idempotency_gateway.idempotency.prefer import requested_wait
from idempotency_gateway.idempotency.report import Report, Verdict
from idempotency_gateway.idempotency.report_log import note_report
from idempotency_gateway.problems import send_problem
from idempotency_gateway.replay.cache import InProcessCache, ReplayCache
from idempotency_gateway.replay.live_streams import LiveStreams
from idempotency_gateway.replay.wakeups import LocalWakeups, Wakeups
from idempotency_gateway.request_id import request_id_of
from idempotency_gateway.storage.base import RecordStore
from idempotency_gateway.storage.records import OPERATION_MAX_LENGTH, RecordKey
from idempotency_gateway.target import RequestTarget, known_target, target_or_refuse
from idempotency_gateway.telemetry.request_log import AccessLogMiddleware, request_log_of

log = logging.getLogger(__name__)

# The gateway's config sections with nothing set: a library user gets the gateway's defaults.
_SCOPE, _LIMITS, _STORE = ScopeConfig(), LimitsConfig(), StoreConfig()


class IdempotencyMiddleware:
    """Pure ASGI middleware: a keyed request on a covered route executes at most once per
    ``(tenant, operation, key)``; its duplicates get the recorded answer (marked
    ``Idempotent-Replayed: true``), a 409 while the first runs, or a 422 when the key comes
    with a different request. Everything else goes straight to ``app``.

    The wrapped app finds the execution's key and fencing token in
    ``scope["state"]["idempotency"]`` (``request.state.idempotency`` in Starlette/FastAPI) and
    may report an ``Outcome`` there. Defaults match the gateway's config file defaults.

    Arguments:
        app: the ASGI app to protect.
        store: where records live (``open_store``); shared by every process that
            serves the same keys.
        policy: which requests are covered, and how: one ``IdempotencyConfig`` for every path,
            a ``{path_prefix: IdempotencyConfig}`` mapping, or a function of the canonical
            path returning a ``RoutePolicy`` or ``None`` (``PolicySource``). An endpoint
            marked ``Depends(idempotent(...))`` (``idempotency.endpoints``) is covered by
            its marker's config whatever ``policy`` says; ``None``: markers only.
        cache: the replay fast path; ``None`` is an in-process LRU sized like the gateway's
            ``cache`` section (pass a ``RedisCache`` to share it across processes).
        wakeups: how ``Prefer: wait`` duplicates learn their owner finished; ``None`` wakes
            waiters in this process only.
        scope_secret: the key of the HMAC that turns credentials into tenants; the same
            in every process sharing the store, so the same client maps to the same tenant.
        scope_headers: the request headers whose values identify the client (its tenant).
        header_name: the request header that carries the idempotency key.
        max_request_body: keyed request bodies are read whole (to fingerprint them); larger
            ones are refused with 413 before any store access.
        store_unavailable: with the store down, refuse keyed requests (``FAIL_CLOSED``, a 503)
            or pass them through unprotected (``PASS_THROUGH``).
        finalize_attempts: the fewest tries at recording an outcome while the store does
            not answer; tries go on until the owner's lease runs out. An answer that could
            not be recorded is withheld from the client (its retry gets the answer of record).
        live_streams: where duplicates follow an event stream still in flight, on routes
            with ``streaming: {follow: true}``; ``None`` follows within this process
            (``live_streams_for(redis_url)`` follows across processes).
        request_log: give each request an ``X-Request-Id``, an access log line and the
            gateway's request metrics (labelled by route), as the gateway does; a request
            that already carries them (inside the gateway) is left as it is.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        store: RecordStore,
        policy: PolicySource | None = None,
        cache: ReplayCache | None = None,
        wakeups: Wakeups | None = None,
        scope_secret: bytes | str,
        scope_headers: tuple[str, ...] = _SCOPE.headers,
        header_name: str = DEFAULT_IDEMPOTENCY_HEADER,
        max_request_body: int = _LIMITS.max_request_body,
        store_unavailable: StoreUnavailablePolicy = DEFAULT_STORE_UNAVAILABLE,
        finalize_attempts: int = _STORE.finalize_attempts,
        live_streams: LiveStreams | None = None,
        request_log: bool = True,
    ) -> None:
        self.app = app
        self.policy_for = resolver_for(policy) if policy is not None else None
        self.route_markers = RouteMarkers()
        # Library mode's access log: failures are the app's to answer (it re-raises them).
        self.access_log = AccessLogMiddleware(self._dispatch, render_failures=False)
        self.request_log = request_log
        self.scope_secret = scope_secret.encode() if isinstance(scope_secret, str) else scope_secret
        self.scope_headers = tuple(name.lower().encode("ascii") for name in scope_headers)
        self.header_display_name = header_name
        self.header_name = header_name.lower().encode("ascii")
        self.max_request_body = max_request_body
        self.store_unavailable = store_unavailable
        self.engine = IdempotencyEngine(
            app,
            store=store,
            # ``is None``, not ``or``: an empty InProcessCache is falsy (it has a length), and
            # the gateway's own cache (the one the admin API clears) must be the one used.
            cache=cache if cache is not None else InProcessCache.sized_by(CacheConfig()),
            wakeups=wakeups if wakeups is not None else LocalWakeups(),
            finalize_attempts=finalize_attempts,
            # Passed through, a request whose claim failed may have executed after all.
            orphans=(
                OrphanReleases(store)
                if store_unavailable is StoreUnavailablePolicy.FAIL_CLOSED
                else None
            ),
            live_streams=live_streams,
        )

    @property
    def executions(self) -> set[asyncio.Task[None]]:
        """Executions in flight: shutdown waits for them to finalize."""
        return self.engine.executions

    async def close(self) -> None:
        """Stop releasing orphaned claims (``idempotency.orphans``) and end the live streams
        still open for followers; call at shutdown."""
        if self.engine.orphans is not None:
            await self.engine.orphans.close()
        await self.engine.live_streams.close()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.request_log and request_log_of(scope) is None:
            await self.access_log(scope, receive, send)
            return
        target = known_target(scope)
        if target is None:
            await self._dispatch(scope, receive, send)
            return
        policy = self._covering_policy(scope, target)
        if policy is None:
            # Most traffic: a route or method this layer does not protect, its target already
            # checked outside. Straight through, with nothing to report.
            await self.app(scope, receive, send)
            return
        await self._dispatch(scope, receive, send, (target, policy))

    def _covering_policy(self, scope: Scope, target: RequestTarget) -> RoutePolicy | None:
        """The policy that protects this request; ``None``: it passes through untouched."""
        policy = self._policy(scope, target)
        return policy if policy is not None and policy.covers(scope["method"]) else None

    def _policy(self, scope: Scope, target: RequestTarget) -> RoutePolicy | None:
        marked = self.route_markers(scope)
        if marked is not None or self.policy_for is None:
            return marked
        return self.policy_for(target)

    async def _dispatch(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        covered: tuple[RequestTarget, RoutePolicy] | None = None,
    ) -> None:
        """As an ASGI app (inside ``access_log``), or with the target and covering policy
        ``__call__`` found."""
        report = Report()
        try:
            unprotected = await self._guard(scope, receive, send, report, covered)
        finally:
            note_report(scope, report)
        if unprotected is not None:
            # After the report: what the app then notes (an upstream never reached) stands.
            await self.app(scope, replay_receive(unprotected), send)

    async def _guard(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        report: Report,
        covered: tuple[RequestTarget, RoutePolicy] | None,
    ) -> bytes | None:
        """Answer the request, or return its body to pass it through unprotected (the store
        is down and the route fails open)."""
        if covered is None:
            target = await target_or_refuse(scope, send)
            if target is None:
                report.verdict = Verdict.REJECTED
                return None
            policy = self._covering_policy(scope, target)
            if policy is None:
                await self.app(scope, receive, send)
                return None
        else:
            target, policy = covered
        report.route = policy.name
        try:
            return await self._protect(scope, receive, send, policy, target, report)
        except ClientDisconnected:
            return None
        except GatewayError as error:
            report.refused(error)
            await send_problem(
                send,
                error,
                request_id=request_id_of(scope),
                error_format=policy.config.error_format,
            )
            return None

    def _client_key(self, scope: Scope, policy: RoutePolicy) -> tuple[str, str] | None:
        """The key and tenant of a client's keyed request; ``None``: no key, none required."""
        headers = scope["headers"]
        key = parse_idempotency_key(headers, self.header_name)
        if key is None:
            if policy.config.key is KeyPolicy.REQUIRED:
                raise MissingIdempotencyKey(
                    f"{self.header_display_name} is required for {scope['method']} on this route"
                )
            return None
        scope["headers"] = headers = with_bare_key(headers, self.header_name, key)
        tenant = tenant_of(headers, self.scope_headers, secret=self.scope_secret)
        if tenant == ANONYMOUS_TENANT and policy.config.anonymous is AnonymousPolicy.REFUSE:
            raise CredentialRequired(
                "keyed requests on this route must carry a credential in "
                + ", ".join(name.decode() for name in self.scope_headers)
            )
        return key, tenant

    async def _protect(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        policy: RoutePolicy,
        target: RequestTarget,
        report: Report,
    ) -> bytes | None:
        body: bytes | None = None
        if policy.webhook is not None:
            # Verified on the bytes as sent, before anything is recorded or cached.
            body = await read_body(receive, scope["headers"], limit=self.max_request_body)
            key, tenant = policy.webhook.identify(
                scope["headers"], body, scope_secret=self.scope_secret
            )
        else:
            keyed = self._client_key(scope, policy)
            if keyed is None:
                await self.app(scope, receive, send)
                return None
            key, tenant = keyed
        headers = scope["headers"]
        operation = policy.operation(scope["method"], target)
        if len(operation) > OPERATION_MAX_LENGTH:
            # The record could not hold it: refused before any store access, like a 413.
            raise OperationTooLong(
                f"the operation ({scope['method']} and the path) is longer than "
                f"{OPERATION_MAX_LENGTH} characters; keyed requests need a shorter path"
            )
        if body is None:
            body = await read_body(receive, headers, limit=self.max_request_body)
        request = KeyedRequest(
            scope=scope,
            body=body,
            send=send,
            policy=policy,
            key=RecordKey(tenant, operation, key),
            fingerprint=await fingerprint(
                functools.partial(
                    request_hash,
                    method=scope["method"],
                    path=target.path,
                    query_string=target.query,
                    headers=headers,
                    body=body,
                    extra_headers=policy.fingerprint_headers,
                    max_canonical_body=policy.config.max_canonical_body,
                ),
                body_size=len(body),
            ),
            wait=min(requested_wait(headers) or 0, policy.config.wait_max),
            report=report,
        )
        report.key = request.key
        try:
            await self.engine.handle(request)
        except StoreUnavailable:
            if self.store_unavailable is StoreUnavailablePolicy.FAIL_CLOSED:
                raise
            log.warning("store unavailable: proxying without idempotency protection")
            report.verdict = Verdict.PASSED_THROUGH
            return body
        return None
