"""``IdempotencyMiddleware``: a pure ASGI middleware that makes retried requests safe.

Per ``(scope, operation, key)`` at most one execution commits; duplicates get the stored
answer replayed, a 409 while the first runs, or a 422 when the key is reused for a different
request. Requests a route does not cover go straight through with no store round trip.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

from app.asgi import (
    ASGIApp,
    ClientDisconnected,
    Receive,
    Scope,
    Send,
    read_body,
    replay_receive,
)
from app.config import KeyPolicy, OnAmbiguous, StoreUnavailablePolicy
from app.errors import (
    GatewayError,
    KeyReusedWithDifferentRequest,
    MissingIdempotencyKey,
    OutcomeUnknown,
    RequestInFlight,
    StoreUnavailable,
)
from app.idempotency.execution import STATE_KEY, Execution
from app.idempotency.fingerprint import request_hash
from app.idempotency.keys import parse_idempotency_key, scope_of
from app.idempotency.machine import Action, Outcome, classify, decide
from app.idempotency.owner import OwnerRun
from app.idempotency.policy import PolicySource, RoutePolicy, resolver_for
from app.idempotency.record import REPLAYABLE, Record, RecordKey, Status, StoredResponse
from app.idempotency.responses import ResponseCapture, send_stored
from app.idempotency.store import RecordStore
from app.problems import problem_body, problem_headers, send_problem
from app.request_id import request_id_of

log = logging.getLogger(__name__)

FENCING_TOKEN_HEADER = b"idempotency-fencing-token"
# Tells a client how soon to retry a duplicate that is still in flight: short, because most
# executions finish in well under a second and the retry then gets the replay.
IN_FLIGHT_RETRY_AFTER = 1
# A lost compare-and-set means another request changed the record; look again, a few times.
_MAX_DECISIONS = 3


def _stored_problem(error: GatewayError, request_id: str | None) -> StoredResponse:
    body = problem_body(error, request_id=request_id)
    headers = [
        (name.decode(), value.decode())
        for name, value in problem_headers(error, body)
        if name != b"content-length"
    ]
    return StoredResponse(error.status, headers, body)


class IdempotencyMiddleware:
    def __init__(
        self,
        app: ASGIApp,
        *,
        store: RecordStore,
        policy: PolicySource,
        scope_headers: tuple[str, ...] = ("authorization",),
        header_name: str = "Idempotency-Key",
        max_request_body: int = 10 * 1024 * 1024,
        store_unavailable: StoreUnavailablePolicy = StoreUnavailablePolicy.FAIL_CLOSED,
        finalize_attempts: int = 3,
    ) -> None:
        self.app = app
        self.store = store
        self.policy_for = resolver_for(policy)
        self.scope_headers = tuple(name.lower().encode("ascii") for name in scope_headers)
        self.header_display_name = header_name
        self.header_name = header_name.lower().encode("ascii")
        self.max_request_body = max_request_body
        self.store_unavailable = store_unavailable
        self.finalize_attempts = finalize_attempts
        # Executions run as tasks of their own so a client disconnect cannot cancel them;
        # kept here so shutdown can wait for them and the loop cannot drop them.
        self.executions: set[asyncio.Task[None]] = set()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        policy = self.policy_for(scope["path"])
        if policy is None or not policy.covers(scope["method"]):
            await self.app(scope, receive, send)
            return
        request_id = request_id_of(scope)
        try:
            await self._protect(scope, receive, send, policy)
        except ClientDisconnected:
            return
        except GatewayError as error:
            await send_problem(send, error, request_id=request_id)

    async def _protect(
        self, scope: Scope, receive: Receive, send: Send, policy: RoutePolicy
    ) -> None:
        headers = scope["headers"]
        key = parse_idempotency_key(headers, self.header_name)
        if key is None:
            if policy.config.key is KeyPolicy.REQUIRED:
                raise MissingIdempotencyKey(
                    f"{self.header_display_name} is required for {scope['method']} on this route"
                )
            await self.app(scope, receive, send)
            return
        body = await read_body(receive, headers, limit=self.max_request_body)
        record_key = RecordKey(
            scope_of(headers, self.scope_headers),
            policy.operation(scope["method"], scope["path"]),
            key,
        )
        fingerprint = request_hash(
            method=scope["method"],
            path=scope["path"],
            query_string=scope.get("query_string", b""),
            headers=headers,
            body=body,
            extra_headers=policy.fingerprint_headers,
        )
        try:
            await self._decide_and_act(scope, body, send, policy, record_key, fingerprint)
        except StoreUnavailable:
            if self.store_unavailable is StoreUnavailablePolicy.FAIL_CLOSED:
                raise
            log.warning("store unavailable: proxying without idempotency protection")
            await self.app(scope, replay_receive(body), send)

    async def _decide_and_act(
        self,
        scope: Scope,
        body: bytes,
        send: Send,
        policy: RoutePolicy,
        record_key: RecordKey,
        fingerprint: str,
    ) -> None:
        config = policy.config
        owner_id = uuid.uuid4().hex
        claim = {"request_hash": fingerprint, "owner_id": owner_id, "lease": config.lease}
        for _ in range(_MAX_DECISIONS):
            reservation = await self.store.reserve(record_key, ttl=config.ttl, **claim)  # type: ignore[arg-type]
            if reservation.reserved:
                await self._execute(scope, body, send, policy, reservation.record)
                return
            record = reservation.record
            action = decide(record, request_hash=fingerprint, now=self.store.clock())
            if action is Action.REPLAY:
                assert record.response is not None
                await send_stored(send, record.response, replayed=True)
                return
            if action is Action.MISMATCH:
                raise KeyReusedWithDifferentRequest(
                    "this Idempotency-Key was first used with a different request "
                    "(method, path, query, body or fingerprinted headers differ)"
                )
            if action is Action.IN_FLIGHT:
                raise RequestInFlight(
                    "the first request with this Idempotency-Key is still running; "
                    "retry with the same key to get its answer",
                    retry_after=IN_FLIGHT_RETRY_AFTER,
                )
            taken = await self.store.take_over(record, ttl=config.ttl, **claim)  # type: ignore[arg-type]
            if taken is None:
                continue  # somebody else changed the record first: look again
            if action is Action.ABANDONED and config.on_ambiguous is OnAmbiguous.FAIL:
                await self._settle_abandoned(scope, send, policy, taken)
                return
            await self._execute(scope, body, send, policy, taken)
            return
        raise RequestInFlight(
            "the record for this Idempotency-Key is changing hands; retry shortly",
            retry_after=IN_FLIGHT_RETRY_AFTER,
        )

    async def _settle_abandoned(
        self, scope: Scope, send: Send, policy: RoutePolicy, record: Record
    ) -> None:
        """An owner died mid-flight: record that the outcome is unknown, never execute twice."""
        log.warning(
            "took over an abandoned record; outcome unknown, not executing again",
            extra={"route": policy.name, "fencing_token": record.fencing_token},
        )
        answer = _stored_problem(
            OutcomeUnknown(
                "an earlier request with this Idempotency-Key was sent upstream but its "
                "answer was lost; it may or may not have been executed. Use a new key only "
                "after checking the resource's state."
            ),
            request_id_of(scope),
        )
        run = OwnerRun(self.store, record, lease=policy.config.lease)
        await run.finalize(Status.FAILED_FINAL, answer, attempts=self.finalize_attempts)
        await send_stored(send, answer, replayed=False)

    async def _execute(
        self, scope: Scope, body: bytes, send: Send, policy: RoutePolicy, record: Record
    ) -> None:
        task = asyncio.create_task(self._run_owner(scope, body, send, policy, record))
        self.executions.add(task)
        task.add_done_callback(self.executions.discard)
        # shield: a disconnecting client cancels this await, never the execution itself.
        await asyncio.shield(task)

    async def _run_owner(
        self, scope: Scope, body: bytes, send: Send, policy: RoutePolicy, record: Record
    ) -> None:
        execution = Execution(record.key.idempotency_key, record.fencing_token)
        inner_scope = dict(scope)
        inner_scope["headers"] = [
            *(pair for pair in scope["headers"] if pair[0] != FENCING_TOKEN_HEADER),
            (FENCING_TOKEN_HEADER, str(record.fencing_token).encode()),
        ]
        inner_scope["state"] = {**scope.get("state", {}), STATE_KEY: execution}
        run = OwnerRun(self.store, record, lease=policy.config.lease)
        capture = ResponseCapture(send, max_stored_body=policy.config.max_stored_body)
        async with run.heartbeat():
            try:
                await self.app(inner_scope, replay_receive(body), capture.send)
            except Exception:
                log.exception("the app failed while executing an idempotent request")
                execution.report(Outcome.AMBIGUOUS)
        if not capture.complete:
            # No full answer came back: the upstream may have acted on the request.
            execution.report(Outcome.AMBIGUOUS)
        status = classify(capture.status or 500, execution.outcome, policy.config)
        if status in REPLAYABLE and capture.complete:
            answer = capture.stored_response()
        elif status in REPLAYABLE:
            answer = _stored_problem(
                OutcomeUnknown("the answer to this request was cut off; its outcome is unknown"),
                request_id_of(scope),
            )
        else:
            answer = None
        await run.finalize(status, answer, attempts=self.finalize_attempts)
        if not capture.started:
            # The app raised before answering: give the client what every retry will see.
            await send_stored(
                capture.send,
                answer or _stored_problem(OutcomeUnknown("the app failed"), request_id_of(scope)),
                replayed=False,
            )
