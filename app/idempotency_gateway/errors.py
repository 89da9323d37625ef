"""The gateway's one error tree.

Every failure a client can see is a ``GatewayError``; each knows the RFC 9457 problem it
becomes. Low-level failures (sockets and HTTP parsing, asyncpg and sqlite3) are translated
into this tree in one place each: ``proxy`` (its client, connection and pool) and
``storage.errors``.

    GatewayError
    ├── RequestRejected                 the request itself is wrong (4xx)
    │   ├── MalformedRequest              400, not HTTP/1.1; the connection closes
    │   ├── InvalidIdempotencyKey         400
    │   ├── MissingIdempotencyKey         400
    │   ├── InvalidRequestTarget          400
    │   ├── CredentialRequired            401
    │   ├── WebhookSignatureInvalid       401, nothing recorded
    │   ├── WebhookDeliveryUnidentified   400, no delivery id or tenant to key it by
    │   ├── NoRouteMatched                404
    │   ├── RequestInFlight               409, Retry-After
    │   ├── RequestTimeout                408, then the connection closes
    │   ├── RequestBodyTooLarge           413
    │   ├── OperationTooLong              414
    │   ├── KeyReusedWithDifferentRequest 422
    │   ├── RequestHeadTooLarge           431, then the connection closes
    │   └── TunnelRefused                 400, CONNECT (authority-form): the gateway is no tunnel
    ├── UnexpectedError                 a bug in the gateway (500), never a plain-text page
    ├── TooManyConnections              the worker's connection cap is reached (503)
    ├── CapacityExhausted               a bulkhead is full: refused before anything ran (503)
    ├── TransferCodingNotImplemented    a request coding other than chunked (501)
    ├── StoreUnavailable                the durable record cannot be read or written (503)
    │   └── StoreReadOnly                 the database refuses writes (a standby)
    ├── LeaseNotConfirmed               the owner could not confirm its lease: nothing sent (503)
    ├── AdminError                      the admin API refuses (its own statuses)
    └── UpstreamError                   the upstream call failed
        ├── UpstreamNeverSent             the request never left, so the key may run again
        │   ├── UpstreamNotSent             safe to retry; itself: the upstream could not be
        │   │   │                             reached (502)
        │   │   ├── CircuitOpen               the upstream's breaker is open (503, Retry-After)
        │   │   └── DeadlineExhausted         too little time left to try (504)
        │   └── UpstreamRequestRefused      the gateway would not send it: a field would break
        │                                   the request's framing (500); no retry ends otherwise
        └── UpstreamAmbiguous             sent, but no complete answer came back
            ├── UpstreamTimeout             504
            ├── UpstreamConnectionLost      502
            └── UpstreamInvalidResponse     502, a status no client can be given
"""

from __future__ import annotations

import math

PROBLEM_TYPE_BASE = "urn:idempotency-gateway:problem:"


class GatewayError(Exception):
    status: int = 500
    slug: str = "internal-error"
    title: str = "Internal gateway error"
    retryable: bool = False
    retry_after: int | None = None

    def __init__(self, detail: str, *, retryable: bool | None = None) -> None:
        """``retryable``: whether a retry with the same key may end differently, where the
        class alone cannot say (an ambiguous failure on a route that runs it again)."""
        super().__init__(detail)
        self.detail = detail
        if retryable is not None:
            self.retryable = retryable

    @property
    def problem_type(self) -> str:
        return PROBLEM_TYPE_BASE + self.slug


class RequestRejected(GatewayError):
    status = 400
    slug = "bad-request"
    title = "Bad request"


class MalformedRequest(RequestRejected):
    slug = "malformed-request"
    title = "Not a valid HTTP request"


class InvalidIdempotencyKey(RequestRejected):
    slug = "idempotency-key-invalid"
    title = "Malformed Idempotency-Key"


class MissingIdempotencyKey(RequestRejected):
    slug = "idempotency-key-missing"
    title = "Idempotency-Key required"


class InvalidRequestTarget(RequestRejected):
    slug = "request-target-invalid"
    title = "Request target not accepted"


class CredentialRequired(RequestRejected):
    """A keyed request with no credential in any scope header, on a route that refuses the
    shared ``anonymous`` scope."""

    status = 401
    slug = "credential-required"
    title = "A credential is required for keyed requests"


class WebhookSignatureInvalid(RequestRejected):
    """A webhook whose sender's signature does not verify: refused before any record, cache
    or upstream sees it, so a forged delivery cannot take the real one's id."""

    status = 401
    slug = "webhook-signature-invalid"
    title = "The webhook's signature does not verify"


class WebhookDeliveryUnidentified(RequestRejected):
    slug = "webhook-delivery-unidentified"
    title = "The webhook carries no delivery id or tenant to key it by"


class NoRouteMatched(RequestRejected):
    status = 404
    slug = "no-route"
    title = "No route for this path"


class RequestInFlight(RequestRejected):
    status = 409
    slug = "request-in-flight"
    title = "A request with this Idempotency-Key is still being processed"
    retryable = True

    def __init__(self, detail: str, *, retry_after: int) -> None:
        super().__init__(detail)
        self.retry_after = retry_after


class RequestTimeout(RequestRejected):
    status = 408
    slug = "request-timeout"
    title = "Request not received in time"
    retryable = True


class RequestHeadTooLarge(RequestRejected):
    status = 431
    slug = "request-head-too-large"
    title = "Request header fields too large"


class TunnelRefused(RequestRejected):
    """An authority-form target (``CONNECT host:port``): like every target that is not a path,
    a 400, so no form of request line can make the gateway open a connection of its choice."""

    slug = "tunnel-refused"
    title = "CONNECT is not supported"


class RequestBodyTooLarge(RequestRejected):
    status = 413
    slug = "request-body-too-large"
    title = "Request body too large"


class OperationTooLong(RequestRejected):
    status = 414
    slug = "operation-too-long"
    title = "Request path too long to protect"


class KeyReusedWithDifferentRequest(RequestRejected):
    status = 422
    slug = "idempotency-key-reused"
    title = "Idempotency-Key reused with a different request"


class UnexpectedError(GatewayError):
    """What the client gets when the gateway itself fails: a problem like any other."""

    status = 500
    slug = "internal-error"
    title = "Internal gateway error"


class TooManyConnections(GatewayError):
    status = 503
    slug = "too-many-connections"
    title = "Too many open connections"
    retryable = True
    retry_after = 1


class CapacityExhausted(GatewayError):
    """A route tier's or an upstream's bulkhead had no slot and no room (or time) in its
    queue. Refused before the record is reserved and before anything is sent, so a retry
    with the same key is as safe as the first try."""

    status = 503
    slug = "capacity-exhausted"
    title = "Gateway capacity for this request is exhausted"
    retryable = True
    retry_after = 1


class TransferCodingNotImplemented(GatewayError):
    """A request ``Transfer-Encoding`` other than a lone ``chunked`` (RFC 9112 section 6.1:
    a server that does not understand a coding answers 501). Decoding only the chunks
    would hand the upstream gzip bytes, say, as a plain body."""

    status = 501
    slug = "transfer-coding-not-implemented"
    title = "Transfer coding not implemented"


class StoreUnavailable(GatewayError):
    status = 503
    slug = "store-unavailable"
    title = "Idempotency store unavailable"
    retryable = True
    retry_after = 1


class StoreReadOnly(StoreUnavailable):
    """The database answers but refuses writes: a standby after a failover, or a database
    set read-only."""

    title = "Idempotency store is read-only"


class LeaseNotConfirmed(GatewayError):
    """The execution's owner could not confirm with the database that it still holds the
    record's lease (fenced by a newer owner, or the store did not answer in time), so the
    attempt it was about to make was not sent."""

    status = 503
    slug = "lease-not-confirmed"
    title = "Lease not confirmed; the request was not sent"
    retryable = True
    retry_after = 1

    def __init__(self, detail: str, *, fenced: bool) -> None:
        super().__init__(detail)
        self.fenced = fenced


class AdminError(GatewayError):
    def __init__(self, detail: str, *, status: int, slug: str, title: str) -> None:
        super().__init__(detail)
        self.status = status
        self.slug = slug
        self.title = title


class UpstreamError(GatewayError):
    status = 502
    slug = "upstream-error"
    title = "Upstream error"


class UpstreamNeverSent(UpstreamError):
    """Nothing of the request left the gateway, so the upstream cannot have acted on it and
    its key may run again. Whether a retry could end otherwise is for each subclass to say."""


class UpstreamNotSent(UpstreamNeverSent):
    """Never sent, for a reason a later attempt may not meet: the upstream could not be
    reached (itself), its breaker is open, or too little time was left. Safe to retry."""

    slug = "upstream-unreachable"
    title = "Upstream unreachable"
    retryable = True


class CircuitOpen(UpstreamNotSent):
    status = 503
    slug = "circuit-open"
    title = "Upstream circuit open"

    def __init__(self, upstream: str, *, retry_after: float) -> None:
        super().__init__(
            f"upstream {upstream!r} is failing; the gateway is not sending it requests for now"
        )
        self.retry_after = max(1, math.ceil(retry_after))


class DeadlineExhausted(UpstreamNotSent):
    status = 504
    slug = "deadline-exhausted"
    title = "Request deadline exhausted"


class UpstreamRequestRefused(UpstreamNeverSent):
    """A field the gateway was about to send upstream holds CR, LF or NUL: sending it could
    smuggle a field or a request past the upstream's framing. Nothing was sent; the server
    never lets such bytes in, so this is a gateway bug, and no retry would end differently."""

    status = 500
    slug = "upstream-request-refused"
    title = "Request refused before reaching the upstream"
    retryable = False


class UpstreamAmbiguous(UpstreamError):
    """The request may have been processed: only the upstream knows."""


class UpstreamTimeout(UpstreamAmbiguous):
    status = 504
    slug = "upstream-timeout"
    title = "Upstream timed out"


class UpstreamConnectionLost(UpstreamAmbiguous):
    slug = "upstream-connection-lost"
    title = "Upstream connection lost before a complete answer"


class UpstreamInvalidResponse(UpstreamAmbiguous):
    """The upstream answered, so it may have acted, but not with an answer the gateway can
    pass on whole: a status that is not a final HTTP answer (outside 200-599), or a body in a
    transfer coding other than chunked. Passing it on or storing it would break every replay."""

    slug = "upstream-invalid-response"
    title = "Upstream answered with an invalid response"


def is_final_status(status: object) -> bool:
    """A status a client can be given as the answer: 1xx are interim, others are not HTTP."""
    return isinstance(status, int) and 200 <= status <= 599


class OutcomeUnknown(UpstreamAmbiguous):
    """Stored for a key whose first execution was sent but never answered."""

    status = 504
    slug = "outcome-unknown"
    title = "Outcome of the original request is unknown"
