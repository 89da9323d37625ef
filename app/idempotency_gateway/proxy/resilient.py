"""``ResilientUpstream``: every attempt asks the breaker; retries only when they are safe.

A retry is safe when the request never left (connect failure), or when the answer says it was
not processed (``retry_on`` statuses, 429 and 503 by default) and the request is idempotent: a
safe or idempotent method, or protected by an idempotency key that is forwarded upstream.
Ambiguous failures (timeouts, lost connections, 502/504) are retried only where the route
says ``on_ambiguous: retry`` (the upstream dedupes on the key) or the method is safe.
Every attempt and every pause stays inside the request's deadline, and retries spend the
upstream's retry budget and need a free slot of its bulkhead. Each decision is logged with
its reason. A keyed execution's lease is confirmed afresh (one round trip) after every pause,
and before each attempt by the client: ``LeaseNotConfirmed`` ends the loop at once, is never
retried, and tells the breaker nothing.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from idempotency_gateway.clock import Monotonic, monotonic
from idempotency_gateway.config import CONNECT_FAILURE, UpstreamConfig
from idempotency_gateway.errors import (
    CircuitOpen,
    DeadlineExhausted,
    UpstreamConnectionLost,
    UpstreamError,
    UpstreamNotSent,
    UpstreamRequestRefused,
    UpstreamTimeout,
)
from idempotency_gateway.execution import Execution
from idempotency_gateway.proxy.deadline import Deadline
from idempotency_gateway.proxy.upstream_client import (
    UpstreamClient,
    UpstreamRequest,
    UpstreamResponse,
)
from idempotency_gateway.resilience.backoff import parse_retry_after, pause_before_retry
from idempotency_gateway.resilience.breaker import CircuitBreaker, TransitionListener
from idempotency_gateway.resilience.budget import RetryBudget
from idempotency_gateway.resilience.bulkhead import Bulkhead, BulkheadKind, RetrySlot
from idempotency_gateway.telemetry import tracing
from idempotency_gateway.telemetry.iteration_metrics import counts, observations
from idempotency_gateway.telemetry.metrics import (
    RETRY_BUDGET_EXHAUSTED,
    UPSTREAM_ATTEMPT_DURATION,
    UPSTREAM_ATTEMPTS,
    UPSTREAM_RETRIES,
)
from idempotency_gateway.telemetry.request_log import RequestLog

log = logging.getLogger(__name__)

# An attempt with less time than this cannot get an answer; failing fast is kinder.
MIN_ATTEMPT_TIME = 0.005

_ERROR_RESULTS: dict[type[UpstreamError], str] = {
    UpstreamNotSent: "connect_error",
    UpstreamTimeout: "timeout",
    UpstreamConnectionLost: "connection_lost",
}

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "TRACE"})
IDEMPOTENT_METHODS = SAFE_METHODS | {"PUT", "DELETE"}


@dataclass(frozen=True, slots=True)
class RetryPlan:
    """What the request itself allows: decided by the proxy from method and key."""

    idempotent: bool
    retry_ambiguous: bool
    ambiguous_statuses: frozenset[int]


RequestFactory = Callable[[float], UpstreamRequest]
Sleep = Callable[[float], Awaitable[None]]


class ResilientUpstream:
    """One upstream behind its retry loop, circuit breaker and retry budget.

    ``open(make_request, deadline=..., plan=...)`` runs attempts until one answers with
    something to give the client, or raises the ``GatewayError`` that says why not
    (``CircuitOpen``, ``DeadlineExhausted``, the last attempt's failure). Each attempt asks
    the breaker first and reports its verdict to it; a retry happens only when ``plan`` says
    the request allows it, the budget has room, and the pause fits in the deadline.

    Arguments:
        client: the upstream's HTTP client; its ``config`` supplies retry, breaker and
            budget settings.
        clock: monotonic seconds for the breaker and the budget (tests move it by hand).
        sleep: how the loop pauses between attempts (tests skip the wait).
        uniform: the jitter source of the backoff (tests make it deterministic).
        on_breaker_transition: called with (upstream, old state, new state) on every change
            of the breaker, for logs and metrics.
    """

    def __init__(
        self,
        client: UpstreamClient,
        *,
        clock: Monotonic = monotonic,
        sleep: Sleep = asyncio.sleep,
        uniform: Callable[[float, float], float] = random.uniform,
        on_breaker_transition: TransitionListener | None = None,
    ) -> None:
        self.client = client
        self.name = client.name
        config: UpstreamConfig = client.config
        self.retry = config.retry
        # Asked after every answer; the property builds a new set each time.
        self.retry_statuses = config.retry.retry_statuses
        self.breaker_failures = config.breaker.failure_on
        self.breaker = CircuitBreaker(
            client.name, config.breaker, clock=clock, on_transition=on_breaker_transition
        )
        # Taken by the bulkhead layer for each request; here only by retries (``RetrySlot``).
        self.bulkhead = (
            Bulkhead(BulkheadKind.UPSTREAM, client.name, config.bulkhead)
            if config.bulkhead is not None
            else None
        )
        self.budget = RetryBudget(
            ratio=config.retry.budget.ratio,
            min_per_second=config.retry.budget.min_per_second,
            window=config.retry.budget.window,
            clock=clock,
        )
        self._sleep = sleep
        self._uniform = uniform
        self.per_try = config.timeouts.per_try
        # Bound once: the name is fixed and the results are a handful of words.
        self._attempt_duration = observations(UPSTREAM_ATTEMPT_DURATION)(self.name)
        self._attempts = counts(UPSTREAM_ATTEMPTS)

    async def open(
        self,
        make_request: RequestFactory,
        *,
        deadline: Deadline,
        plan: RetryPlan,
        request_log: RequestLog | None = None,
        execution: Execution | None = None,
    ) -> UpstreamResponse:
        """The response to stream back (the caller releases it), or the last failure.
        ``execution``: the keyed execution whose lease every attempt must hold."""
        self.budget.record_request()
        retry_slot = RetrySlot(self.bulkhead)
        try:
            attempt = 0
            while True:
                attempt += 1
                span = tracing.attempt_span(self.name, attempt)
                try:
                    response = await self._attempt(
                        attempt,
                        make_request,
                        deadline,
                        plan,
                        request_log,
                        retry_slot,
                        execution,
                        span,
                    )
                except Exception as error:
                    if span is not None:
                        span.fail(error)
                    raise
                finally:
                    if span is not None:
                        span.end()
                if response is not None:
                    return response
        finally:
            retry_slot.give_back()

    async def _attempt(
        self,
        attempt: int,
        make_request: RequestFactory,
        deadline: Deadline,
        plan: RetryPlan,
        request_log: RequestLog | None,
        retry_slot: RetrySlot,
        execution: Execution | None,
        span: tracing.Span | None,
    ) -> UpstreamResponse | None:
        """One attempt and the decision after it: the answer to give, ``None`` to try again
        (after the pause), or the failure that ends the loop. ``span``: the attempt's span
        (tracing on), which lasts until the next attempt starts: the pause is part of it."""
        time_left = deadline.remaining()
        if time_left < MIN_ATTEMPT_TIME:
            raise DeadlineExhausted(
                f"the request's deadline ran out before attempt {attempt} to {self.name!r}"
            )
        try:
            trial = self.breaker.trial()
        except CircuitOpen:
            self._attempts(self.name, "circuit_open").inc()
            if span is not None:
                span.event("breaker.open", {"gateway.attempt": attempt})
            raise
        if request_log is not None:
            request_log.attempts = attempt
        head_within = min(self.per_try, time_left)
        request = make_request(head_within)
        if span is not None:
            span.set("http.request.method", request.method)
            span.inject(request.headers)
        started = time.perf_counter()
        # Any exit without a verdict (cancellation above all) hands the permit back.
        with trial:
            try:
                response = await self.client.open(
                    request, head_within=head_within, execution=execution
                )
            except UpstreamError as error:
                failure = self._error_is_failure(error)
                trial.settle(failure=failure)
                self._measure(started, _ERROR_RESULTS.get(type(error), "error"))
                if span is not None:
                    span.set("error.type", type(error).__name__)
                    span.event("breaker.verdict", {"gateway.failure": failure})
                reason = self._why_not_retry_error(error, plan)
                if reason is None:
                    reason = await self._pause_before_retry(
                        attempt, None, deadline, retry_slot, str(error), span, execution=execution
                    )
                if reason is not None:
                    self._log_final(attempt, type(error).__name__, reason, span)
                    raise
                return None
            failure = self._status_is_failure(response.status)
            trial.settle(failure=failure)
        self._measure(started, f"{response.status // 100}xx")
        if span is not None:
            span.set("http.response.status_code", response.status)
            span.event("breaker.verdict", {"gateway.failure": failure})
        reason = self._why_not_retry_status(response.status, plan)
        if reason is None:
            retry_after = parse_retry_after(response.header("retry-after"))
            reason = await self._pause_before_retry(
                attempt,
                retry_after,
                deadline,
                retry_slot,
                f"status {response.status}",
                span,
                response,
                execution=execution,
            )
        if reason is None:
            return None
        # Plain answers (2xx, 404) need no explanation; a retryable status that was not
        # retried (429 past the deadline, budget spent) does.
        status = response.status
        if attempt > 1 or status >= 500 or status in self.retry_statuses:
            self._log_final(attempt, f"status {status}", reason, span)
        return response

    def _why_not_retry_error(self, error: UpstreamError, plan: RetryPlan) -> str | None:
        if isinstance(error, UpstreamRequestRefused):
            return "the gateway refused to send it; another attempt would be refused too"
        if isinstance(error, UpstreamNotSent):
            if CONNECT_FAILURE in self.retry.retry_on:
                return None
            return "connect-failure is not in retry_on"
        if plan.retry_ambiguous:
            return None
        return "the request was sent and may have been processed (ambiguous)"

    def _why_not_retry_status(self, status: int, plan: RetryPlan) -> str | None:
        if status < 400:
            return "success"
        if status in plan.ambiguous_statuses and status not in self.retry_statuses:
            if plan.retry_ambiguous:
                return None
            return f"{status} is ambiguous and the route does not retry ambiguous failures"
        if status not in self.retry_statuses:
            return f"{status} is not in retry_on"
        if not plan.idempotent:
            return "the request is not idempotent (no idempotency key, unsafe method)"
        return None

    async def _pause_before_retry(
        self,
        attempt: int,
        retry_after: float | None,
        deadline: Deadline,
        retry_slot: RetrySlot,
        cause: str,
        span: tracing.Span | None,
        response: UpstreamResponse | None = None,
        *,
        execution: Execution | None,
    ) -> str | None:
        """Sleep before the next attempt; or say why there will be none. After the pause the
        execution's lease is confirmed with a round trip, whatever the clock says: the owner
        may have stalled, or been fenced, while it waited."""
        if attempt >= self.retry.max_attempts:
            return f"max_attempts ({self.retry.max_attempts}) reached"
        delay = pause_before_retry(
            attempt,
            retry_after=retry_after,
            base=self.retry.base,
            cap=self.retry.cap,
            uniform=self._uniform,
        )
        if delay + MIN_ATTEMPT_TIME >= deadline.remaining():
            return f"a pause of {delay:.3f}s would not leave time for another attempt"
        if not retry_slot.take():
            return "the upstream's bulkhead has no free slot for a retry"
        if not self.budget.try_withdraw():
            RETRY_BUDGET_EXHAUSTED.labels(self.name).inc()
            return "the retry budget is exhausted"
        UPSTREAM_RETRIES.labels(self.name).inc()
        if response is not None:
            response.release()
        log.info(
            "retrying upstream %s after %s: attempt %d of %d in %.3fs",
            self.name,
            cause,
            attempt + 1,
            self.retry.max_attempts,
            delay,
        )
        if span is not None:
            span.event("retry", {"gateway.cause": cause, "gateway.delay": round(delay, 6)})
        await self._sleep(delay)
        if execution is not None:
            await execution.confirm(fresh=True)
        return None

    def _measure(self, started: float, result: str) -> None:
        self._attempt_duration.observe(time.perf_counter() - started)
        self._attempts(self.name, result).inc()

    def _log_final(
        self, attempts: int, outcome: str, reason: str, span: tracing.Span | None
    ) -> None:
        if span is not None:
            span.event("retry.declined", {"gateway.reason": reason})
        log.info(
            "not retrying upstream %s after %s (%d attempts): %s",
            self.name,
            outcome,
            attempts,
            reason,
        )

    def _error_is_failure(self, error: UpstreamError) -> bool:
        if isinstance(error, UpstreamRequestRefused):
            return False  # says nothing about the upstream's health
        if isinstance(error, UpstreamNotSent):
            return CONNECT_FAILURE in self.breaker_failures
        if isinstance(error, UpstreamTimeout):
            return "timeout" in self.breaker_failures
        if isinstance(error, UpstreamConnectionLost):
            return "connection-lost" in self.breaker_failures
        return True

    def _status_is_failure(self, status: int) -> bool:
        return status in self.breaker_failures or (status >= 500 and "5xx" in self.breaker_failures)
