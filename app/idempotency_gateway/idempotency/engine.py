"""``IdempotencyEngine``: what happens to one keyed request.

replay cache hit  -> replay (or 422 for a different request): no SQL at all
reserve (1 statement) -> ours: execute, finalize (1 statement), cache, wake waiters
                      -> finished: replay and backfill the cache
                      -> in flight: 409, or wait for the owner under ``Prefer: wait``
                      -> retryable, expired or abandoned: take over (compare-and-set)
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import datetime

from idempotency_gateway.asgi import ASGIApp, Headers, Scope, Send, replay_receive
from idempotency_gateway.clock import monotonic
from idempotency_gateway.config import IdempotencyConfig, OnAmbiguous
from idempotency_gateway.errors import (
    GatewayError,
    KeyReusedWithDifferentRequest,
    OutcomeUnknown,
    RequestInFlight,
    StoreUnavailable,
)
from idempotency_gateway.execution import FENCING_TOKEN_HEADER, STATE_KEY, Execution, Outcome
from idempotency_gateway.idempotency.cache import CachedAnswer, ReplayCache, expiry_of
from idempotency_gateway.idempotency.machine import Action, classify, decide
from idempotency_gateway.idempotency.owner import OwnerRun, new_owner_id
from idempotency_gateway.idempotency.policy import RoutePolicy
from idempotency_gateway.idempotency.record import (
    REPLAYABLE,
    Record,
    RecordKey,
    Status,
    StoredResponse,
)
from idempotency_gateway.idempotency.responses import ResponseCapture, send_stored, stored_problem
from idempotency_gateway.idempotency.store import Claim, RecordStore
from idempotency_gateway.idempotency.wakeups import Wakeups
from idempotency_gateway.request_id import request_id_of
from idempotency_gateway.telemetry.metrics import TAKEOVERS
from idempotency_gateway.telemetry.request_log import (
    RequestOutcome,
    note_outcome,
    request_log_of,
)

log = logging.getLogger(__name__)

# Tells a client how soon to retry a duplicate that is still in flight: short, because most
# executions finish in well under a second and the retry then gets the replay.
IN_FLIGHT_RETRY_AFTER = 1
# A lost compare-and-set means another request changed the record; look again, a few times.
_MAX_DECISIONS = 3


@dataclass(frozen=True, slots=True)
class KeyedRequest:
    scope: Scope
    body: bytes
    send: Send
    policy: RoutePolicy
    key: RecordKey
    fingerprint: str
    wait: float  # seconds the client will wait for an in-flight owner (0: answer 409 at once)

    @property
    def config(self) -> IdempotencyConfig:
        return self.policy.config

    def problem(self, error: GatewayError) -> StoredResponse:
        """An answer the gateway makes itself for this request, in the form the store keeps."""
        return stored_problem(error, request_id_of(self.scope), self.config.error_format)


def _mismatch() -> KeyReusedWithDifferentRequest:
    return KeyReusedWithDifferentRequest(
        "this Idempotency-Key was first used with a different request "
        "(method, path, query, body or fingerprinted headers differ)"
    )


def _takeover_reason(action: Action, record: Record, now: datetime) -> str:
    if action is Action.ABANDONED:
        return "abandoned"
    return "expired" if record.is_expired(now) else "retryable"


class IdempotencyEngine:
    def __init__(
        self,
        app: ASGIApp,
        *,
        store: RecordStore,
        cache: ReplayCache,
        wakeups: Wakeups,
        finalize_attempts: int,
    ) -> None:
        self.app = app
        self.store = store
        self.cache = cache
        self.wakeups = wakeups
        self.finalize_attempts = finalize_attempts
        # Executions run as tasks of their own so a client disconnect cannot cancel them;
        # kept here so shutdown can wait for them and the loop cannot drop them.
        self.executions: set[asyncio.Task[None]] = set()

    async def handle(self, request: KeyedRequest) -> None:
        entry = request_log_of(request.scope)
        if entry is not None:
            entry.scope_hash = request.key.scope
        cached = await self.cache.get(request.key)
        if cached is not None:
            if cached.request_hash != request.fingerprint:
                note_outcome(request.scope, RequestOutcome.MISMATCH)
                raise _mismatch()
            note_outcome(request.scope, RequestOutcome.REPLAYED)
            await send_stored(request.send, cached.response, replayed=True)
            return
        await self._decide_and_act(request)

    async def _decide_and_act(self, request: KeyedRequest) -> None:
        config = request.config
        claim = Claim(request.fingerprint, new_owner_id(), config.lease, config.ttl)
        waited: Headers = []
        for _ in range(_MAX_DECISIONS):
            asked_at = monotonic()
            reservation = await self.store.reserve(request.key, claim)
            if reservation.reserved:
                await self._execute(request, reservation.record, asked_at)
                return
            record = reservation.record
            action = decide(record, request_hash=request.fingerprint, now=reservation.now)
            if action is Action.REPLAY:
                assert record.response is not None
                note_outcome(request.scope, RequestOutcome.REPLAYED)
                answer = CachedAnswer.of(record, now=reservation.now, asked_at=asked_at)
                if answer is not None:
                    await self.cache.put(answer)
                await send_stored(request.send, record.response, replayed=True, extra=waited)
                return
            if action is Action.MISMATCH:
                note_outcome(request.scope, RequestOutcome.MISMATCH)
                raise _mismatch()
            if action is Action.IN_FLIGHT:
                if request.wait > 0 and not waited:
                    # Parks on an event, holding no database connection; the re-reserve
                    # after it is the durable check, so a lost wake-up costs only time.
                    await self.wakeups.wait(request.key, request.wait)
                    waited = [(b"preference-applied", f"wait={request.wait:g}".encode())]
                    continue
                note_outcome(request.scope, RequestOutcome.CONFLICT_IN_FLIGHT)
                raise RequestInFlight(
                    "the first request with this Idempotency-Key is still running; "
                    "retry with the same key to get its answer",
                    retry_after=IN_FLIGHT_RETRY_AFTER,
                )
            asked_at = monotonic()
            taken = await self.store.take_over(record, claim)
            if taken is None:
                continue  # somebody else changed the record first: look again
            TAKEOVERS.labels(_takeover_reason(action, record, reservation.now)).inc()
            if action is Action.ABANDONED and config.on_ambiguous is OnAmbiguous.FAIL:
                await self._settle_abandoned(request, taken, asked_at)
                return
            await self._execute(request, taken, asked_at)
            return
        note_outcome(request.scope, RequestOutcome.CONFLICT_IN_FLIGHT)
        raise RequestInFlight(
            "the record for this Idempotency-Key is changing hands; retry shortly",
            retry_after=IN_FLIGHT_RETRY_AFTER,
        )

    def _owner_run(self, request: KeyedRequest, record: Record, granted_at: float) -> OwnerRun:
        config = request.config
        return OwnerRun(
            self.store, record, lease=config.lease, ttl=config.ttl, granted_at=granted_at
        )

    async def _settle_abandoned(
        self, request: KeyedRequest, record: Record, granted_at: float
    ) -> None:
        """An owner died mid-flight: record that the outcome is unknown, never execute twice."""
        note_outcome(request.scope, RequestOutcome.OUTCOME_UNKNOWN)
        log.warning(
            "took over an abandoned record; outcome unknown, not executing again",
            extra={"route": request.policy.name, "fencing_token": record.fencing_token},
        )
        answer = request.problem(
            OutcomeUnknown(
                "an earlier request with this Idempotency-Key was sent upstream but its "
                "answer was lost; it may or may not have been executed. Use a new key only "
                "after checking the resource's state."
            ),
        )
        run = self._owner_run(request, record, granted_at)
        recorded, published = await self._record(request, run, Status.FAILED_FINAL, answer)
        await send_stored(
            request.send,
            answer if recorded else self._not_of_record(request, run),
            replayed=False,
        )
        # Waiters re-read the store whatever happened; waking them never delays this answer.
        await self.wakeups.notify(request.key, published=published)

    async def _execute(self, request: KeyedRequest, record: Record, granted_at: float) -> None:
        note_outcome(request.scope, RequestOutcome.EXECUTED)
        task = asyncio.create_task(self._run_owner(request, record, granted_at))
        self.executions.add(task)
        task.add_done_callback(self.executions.discard)
        # shield: a disconnecting client cancels this await, never the execution itself.
        await asyncio.shield(task)

    async def _run_owner(self, request: KeyedRequest, record: Record, granted_at: float) -> None:
        execution = Execution(record.key.idempotency_key, record.fencing_token)
        inner_scope = dict(request.scope)
        inner_scope["headers"] = [
            *(pair for pair in request.scope["headers"] if pair[0] != FENCING_TOKEN_HEADER),
            (FENCING_TOKEN_HEADER, str(record.fencing_token).encode()),
        ]
        inner_scope["state"] = {**request.scope.get("state", {}), STATE_KEY: execution}
        run = self._owner_run(request, record, granted_at)
        capture = ResponseCapture(
            request.send,
            max_stored_body=request.config.max_stored_body,
            error_format=request.config.error_format,
        )
        async with run.heartbeat():
            try:
                await self.app(inner_scope, replay_receive(request.body), capture.send)
            except Exception:
                log.exception("the app failed while executing an idempotent request")
                execution.report(Outcome.AMBIGUOUS)
        if not capture.complete:
            # No full answer came back: the upstream may have acted on the request.
            execution.report(Outcome.AMBIGUOUS)
        status = classify(capture.status or 500, execution.outcome, request.config)
        answer = self._answer_to_store(request, capture, status)
        recorded, published = await self._record(request, run, status, answer)
        if recorded:
            # An app that raised before answering: the client gets what every retry will see.
            instead = answer or request.problem(OutcomeUnknown("the app failed"))
        else:
            # Fenced off, or the store is down: this answer is not the key's answer of record
            # (a newer owner's may be, or an "outcome unknown" later), so the client must not
            # take it as final. Its retry with the key gets the answer of record.
            log.warning(
                "the outcome was not recorded (%s); withholding this answer from the client",
                "fenced off" if run.fenced else "store unavailable",
                extra={"route": request.policy.name, "fencing_token": record.fencing_token},
            )
            instead = self._not_of_record(request, run)
        await capture.finish(recorded=recorded, instead=instead)
        # Waiters re-read the store whatever happened (even a fenced finalize is news); waking
        # them never delays this answer.
        await self.wakeups.notify(request.key, published=published)

    @staticmethod
    def _answer_to_store(
        request: KeyedRequest, capture: ResponseCapture, status: Status
    ) -> StoredResponse | None:
        if status not in REPLAYABLE:
            return None
        if capture.complete:
            return capture.stored_response()
        return request.problem(
            OutcomeUnknown("the answer to this request was cut off; its outcome is unknown")
        )

    @staticmethod
    def _not_of_record(request: KeyedRequest, run: OwnerRun) -> StoredResponse:
        """What a client gets instead of an answer whose outcome could not be recorded."""
        error: GatewayError
        if run.fenced:
            error = RequestInFlight(
                "another request took this Idempotency-Key over; retry with the same key "
                "to get its answer",
                retry_after=IN_FLIGHT_RETRY_AFTER,
            )
        else:
            error = StoreUnavailable(
                "the answer could not be recorded; retry with the same key to get the "
                "answer of record"
            )
        return request.problem(error)

    async def _record(
        self, request: KeyedRequest, run: OwnerRun, status: Status, answer: StoredResponse | None
    ) -> tuple[bool, bool]:
        """Finalize, then cache the recorded answer, both before the client has it: its
        immediate retry then finds the answer, and an operator deleting the record right
        after never races a late cache write. (recorded, published): whether the outcome was
        recorded, and whether caching it also woke waiters in other processes."""
        recorded = await run.finalize(status, answer, attempts=self.finalize_attempts)
        published = False
        if recorded and answer is not None and status in REPLAYABLE:
            published = await self.cache.put(
                CachedAnswer(
                    request.key,
                    request.fingerprint,
                    status,
                    answer,
                    # The statement that granted the record stamped it with the database's
                    # "now" (``updated_at``). A record that outlived its TTL gets a new one at
                    # the finalize; its answer then lives on in the store, not in the cache.
                    expiry_of(run.record, now=run.record.updated_at, asked_at=run.granted_at),
                )
            )
        return recorded, published
