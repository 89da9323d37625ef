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
from idempotency_gateway.clock import lease_clock
from idempotency_gateway.config import IdempotencyConfig, OnAmbiguous
from idempotency_gateway.errors import (
    GatewayError,
    KeyReusedWithDifferentRequest,
    LeaseNotConfirmed,
    OutcomeUnknown,
    RequestInFlight,
    StoreReadOnly,
    StoreUnavailable,
)
from idempotency_gateway.execution import FENCING_TOKEN_HEADER, STATE_KEY, Execution, Outcome
from idempotency_gateway.idempotency.app_failure import send_app_failure
from idempotency_gateway.idempotency.machine import Action, classify, decide
from idempotency_gateway.idempotency.orphans import OrphanReleases
from idempotency_gateway.idempotency.owner import OwnerRun, new_owner_id
from idempotency_gateway.idempotency.policy import RoutePolicy
from idempotency_gateway.idempotency.report import Report, Verdict
from idempotency_gateway.idempotency.responses import ResponseCapture, send_stored, stored_problem
from idempotency_gateway.idempotency.streams import StreamTee, follow_live, send_replay
from idempotency_gateway.replay.cache import CachedAnswer, ReplayCache, expiry_of
from idempotency_gateway.replay.live_streams import LiveStreams, LocalLiveStreams
from idempotency_gateway.replay.wakeups import Wakeups
from idempotency_gateway.request_id import request_id_of
from idempotency_gateway.storage.base import Claim, RecordStore
from idempotency_gateway.storage.records import (
    REPLAYABLE,
    Record,
    RecordKey,
    Status,
    StoredResponse,
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
    report: Report  # what the engine did with it, for the middleware to log and count

    @property
    def config(self) -> IdempotencyConfig:
        return self.policy.config

    def marker(self, replayed: bool) -> tuple[bytes, bytes] | None:
        """The route's replay marker field for an answer that is a replay, else none."""
        return self.policy.replayed if replayed else None

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
        orphans: OrphanReleases | None,
        live_streams: LiveStreams | None = None,
    ) -> None:
        """``orphans``: where a claim whose outcome the store never reported goes to be
        released (``None``: left to its lease, for a caller that may still send the request
        without the store). ``live_streams``: where streams in flight are followed (``None``:
        in this process)."""
        self.app = app
        self.store = store
        self.cache = cache
        self.wakeups = wakeups
        self.finalize_attempts = finalize_attempts
        self.orphans = orphans
        self.live_streams = live_streams if live_streams is not None else LocalLiveStreams()
        # Executions run as tasks of their own so a client disconnect cannot cancel them;
        # kept here so shutdown can wait for them and the loop cannot drop them.
        self.executions: set[asyncio.Task[None]] = set()

    async def handle(self, request: KeyedRequest) -> None:
        cached = await self.cache.get(request.key)
        if cached is not None:
            if cached.request_hash != request.fingerprint:
                raise _mismatch()
            request.report.verdict = Verdict.REPLAYED
            await self._replay(request, cached.response)
            return
        await self._decide_and_act(request)

    async def _decide_and_act(self, request: KeyedRequest) -> None:
        config = request.config
        claim = Claim(request.fingerprint, new_owner_id(), config.lease, config.ttl)
        waited: Headers = []
        for _ in range(_MAX_DECISIONS):
            # Read before each statement that may grant a lease: the lease is trusted from
            # the moment the grant was sent (``lease.Lease``).
            sent_at = lease_clock()
            try:
                reservation = await self.store.reserve(request.key, claim)
            except StoreUnavailable as error:
                self._orphaned(request, claim, error)
                raise
            if reservation.reserved:
                await self._execute(request, reservation.record, sent_at)
                return
            record = reservation.record
            action = decide(record, request_hash=request.fingerprint, now=reservation.now)
            if action is Action.REPLAY:
                assert record.response is not None
                request.report.verdict = Verdict.REPLAYED
                answer = CachedAnswer.of(record, now=reservation.now, asked_at=sent_at)
                if answer is not None:
                    await self.cache.put(answer)
                await self._replay(request, record.response, extra=waited)
                return
            if action is Action.MISMATCH:
                raise _mismatch()
            if action is Action.IN_FLIGHT:
                if request.config.streaming.follow and await self._follow(request):
                    return
                if request.wait > 0 and not waited:
                    # Parks on an event, holding no database connection; the re-reserve
                    # after it is the durable check, so a lost wake-up costs only time.
                    await self.wakeups.wait(request.key, request.wait)
                    waited = [(b"preference-applied", f"wait={request.wait:g}".encode())]
                    continue
                raise RequestInFlight(
                    "the first request with this Idempotency-Key is still running; "
                    "retry with the same key to get its answer",
                    retry_after=IN_FLIGHT_RETRY_AFTER,
                )
            sent_at = lease_clock()
            try:
                taken = await self.store.take_over(record, claim)
            except StoreUnavailable as error:
                # An abandoned record is left to its lease: released, it would no longer
                # say that its earlier owner may have executed.
                if action is not Action.ABANDONED:
                    self._orphaned(request, claim, error)
                raise
            if taken is None:
                continue  # somebody else changed the record first: look again
            request.report.takeover = _takeover_reason(action, record, reservation.now)
            if action is Action.ABANDONED and config.on_ambiguous is OnAmbiguous.FAIL:
                await self._settle_abandoned(request, taken, sent_at)
                return
            await self._execute(request, taken, sent_at)
            return
        raise RequestInFlight(
            "the record for this Idempotency-Key is changing hands; retry shortly",
            retry_after=IN_FLIGHT_RETRY_AFTER,
        )

    async def _replay(
        self, request: KeyedRequest, response: StoredResponse, extra: Headers | None = None
    ) -> None:
        await send_replay(
            request.send,
            response,
            scope=request.scope,
            config=request.config,
            replayed=request.policy.replayed,
            extra=extra or (),
        )

    async def _follow(self, request: KeyedRequest) -> bool:
        """A duplicate of a stream in flight follows it: docs/CONTRACT.md, "Event streams
        that survive a dropped connection"."""
        followed = await follow_live(
            self.live_streams,
            request.send,
            key=request.key,
            request_hash=request.fingerprint,
            scope=request.scope,
            config=request.config,
            marker=request.policy.replayed,
        )
        if followed:
            request.report.verdict = Verdict.REPLAYED
        return followed

    def _orphaned(self, request: KeyedRequest, claim: Claim, error: StoreUnavailable) -> None:
        """A claim that failed on the gateway may still commit: its owner, which will never
        send the request, has it released once the store answers again. A read-only
        database refused the write, so nothing is left to release."""
        if self.orphans is not None and not isinstance(error, StoreReadOnly):
            self.orphans.add(request.key, claim.owner_id, ttl=claim.ttl)

    async def _settle_abandoned(
        self, request: KeyedRequest, record: Record, sent_at: float
    ) -> None:
        """An owner died mid-flight: record that the outcome is unknown, never execute twice."""
        request.report.verdict = Verdict.OUTCOME_UNKNOWN
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
        run = self._owner_run(request, record, sent_at)
        recorded, published = await self._record(request, run, Status.FAILED_FINAL, answer)
        if recorded:
            await send_stored(request.send, answer, replayed=None)
        else:
            instead, replayed = self._not_of_record(request, run)
            await send_stored(request.send, instead, replayed=request.marker(replayed))
        # Waiters re-read the store whatever happened; waking them never delays this answer.
        await self.wakeups.notify(request.key, published=published)

    async def _execute(self, request: KeyedRequest, record: Record, sent_at: float) -> None:
        request.report.verdict = Verdict.EXECUTED
        task = asyncio.create_task(
            self._run_owner(request, self._owner_run(request, record, sent_at))
        )
        self.executions.add(task)
        task.add_done_callback(self.executions.discard)
        # shield: a disconnecting client cancels this await, never the execution itself.
        await asyncio.shield(task)

    def _owner_run(self, request: KeyedRequest, record: Record, sent_at: float) -> OwnerRun:
        config = request.config
        return OwnerRun(self.store, record, lease=config.lease, ttl=config.ttl, sent_at=sent_at)

    async def _run_owner(self, request: KeyedRequest, run: OwnerRun) -> None:
        record = run.record
        execution = Execution(record.key.idempotency_key, record.fencing_token, run.lease)
        inner_scope = dict(request.scope)
        inner_scope["headers"] = [
            *(pair for pair in request.scope["headers"] if pair[0] != FENCING_TOKEN_HEADER),
            (FENCING_TOKEN_HEADER, str(record.fencing_token).encode()),
        ]
        inner_scope["state"] = {**request.scope.get("state", {}), STATE_KEY: execution}
        capture = ResponseCapture(
            request.send,
            max_stored_body=request.config.max_stored_body,
            error_format=request.config.error_format,
            replay_marker=request.policy.replayed[0],
        )
        tee = StreamTee(
            capture,
            self.live_streams,
            key=request.key,
            request_hash=request.fingerprint,
            config=request.config,
        )
        failure: GatewayError = OutcomeUnknown("the app failed")
        raised: Exception | None = None
        rendered = False  # the app's failure answer, made here: final whatever its status
        receive = replay_receive(request.body)
        async with run.heartbeat():
            try:
                await self.app(inner_scope, receive, tee.send)
            except LeaseNotConfirmed as refusal:
                # A library app that stopped before its side effect, as it should: the
                # execution has already reported whether anything had left.
                failure = refusal
            except Exception as error:
                raised = error
                if not capture.started:
                    # The app's own failure answer, as it sends it without a key, is the
                    # answer of record (contract: a handler that raises).
                    try:
                        await send_app_failure(inner_scope, receive, capture.send, error)
                        rendered = True
                    except Exception:
                        # No answer at all: settled below as any answer that never came.
                        log.exception("the app's error handler failed as well")
        if not capture.complete:
            # No full answer came back: the upstream may have acted on the request.
            execution.report(Outcome.AMBIGUOUS)
        if execution.outcome is Outcome.NOT_EXECUTED:
            # Nothing reached the upstream: the gateway's own 5xx, not an executed request's.
            request.report.verdict = Verdict.NOT_EXECUTED
        status = (
            Status.FAILED_FINAL
            if rendered and capture.complete
            else classify(capture.status or 500, execution.outcome, request.config)
        )
        answer = self._answer_to_store(request, capture, status)
        recorded, published = await self._record(request, run, status, answer)
        tee.end(recorded=recorded and capture.complete)
        replayed = False
        if recorded:
            # An app that raised before answering: the client gets what every retry will see.
            instead = answer or request.problem(failure)
        else:
            # Fenced off, or the store is down: this answer is not the key's answer of record
            # (a newer owner's may be, or an "outcome unknown" later), so the client must not
            # take it as final. Its retry with the key gets the answer of record.
            log.warning(
                "the outcome was not recorded (%s); withholding this answer from the client",
                "fenced off" if run.fenced else "store unavailable",
                extra={"route": request.policy.name, "fencing_token": record.fencing_token},
            )
            instead, replayed = self._not_of_record(request, run)
        await capture.finish(recorded=recorded, instead=instead, replayed=request.marker(replayed))
        # Waiters re-read the store whatever happened (even a fenced finalize is news); waking
        # them never delays this answer.
        await self.wakeups.notify(request.key, published=published)
        if raised is not None:
            raise raised  # the server logs it, as it does for a request without a key

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
    def _not_of_record(request: KeyedRequest, run: OwnerRun) -> tuple[StoredResponse, bool]:
        """What a client gets instead of an answer whose outcome could not be recorded, and
        whether it is a replay: the answer of record when the owner that fenced this one off
        has finished, else a problem that sends the client back with the same key."""
        current = run.of_record
        if (
            current is not None
            and current.status in REPLAYABLE
            and current.response is not None
            and current.request_hash == request.fingerprint
        ):
            return current.response, True
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
        return request.problem(error), False

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
                    expiry_of(run.record, now=run.record.updated_at, asked_at=run.sent_at),
                )
            )
        return recorded, published
