"""Configuration: the YAML file (``GatewayConfig``) and ``GATEWAY_*`` environment settings.

Every model forbids unknown fields, so a typo is an error that names the field instead of a
silently ignored setting. Durations are written ``250ms``, ``30s``, ``5m``, ``24h``; sizes
``512KiB``, ``1MiB``, ``10MB``; plain numbers mean seconds and bytes.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Collection, Iterable
from decimal import Decimal
from enum import StrEnum
from ipaddress import IPv4Network, IPv6Network, ip_network
from pathlib import Path
from typing import Annotated, Any, Final, Literal, get_args

import yaml
from pydantic import (
    AfterValidator,
    AnyHttpUrl,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    FilePath,
    PlainSerializer,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import ErrorDetails, PydanticCustomError
from pydantic_settings import BaseSettings, SettingsConfigDict

from idempotency_gateway.database_url import sqlalchemy_url

_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
}
_QUANTITY = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_duration(value: object) -> float:
    """Seconds from ``250ms`` / ``30s`` / ``24h`` or a bare number of seconds."""
    if isinstance(value, bool):
        raise ValueError("a duration such as 250ms, 30s or 24h")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and (match := _QUANTITY.match(value)):
        number, unit = match.groups()
        factor = _DURATION_UNITS.get(unit.lower() or "s")
        if factor is None:
            raise ValueError(f"unknown duration unit {unit!r} (use ms, s, m, h or d)")
        # Exact decimal arithmetic: "3300ms" is the same float as "3.3s", so what
        # check-config prints loads back equal.
        seconds = float(Decimal(number) * Decimal(str(factor)))
    else:
        raise ValueError("a duration such as 250ms, 30s or 24h")
    if seconds < 0:
        raise ValueError("a duration cannot be negative")
    return seconds


def parse_size(value: object) -> int:
    """Bytes from ``512KiB`` / ``1MiB`` / ``10MB`` or a bare number of bytes."""
    if isinstance(value, bool):
        raise ValueError("a size such as 512KiB or 10MiB")
    if isinstance(value, int):
        size = value
    elif isinstance(value, str) and (match := _QUANTITY.match(value)):
        number, unit = match.groups()
        factor = _SIZE_UNITS.get(unit.lower())
        if factor is None:
            raise ValueError(f"unknown size unit {unit!r} (use B, KiB, MiB, GiB, KB, MB, GB)")
        size = int(float(number) * factor)
    else:
        raise ValueError("a size such as 512KiB or 10MiB")
    if size < 0:
        raise ValueError("a size cannot be negative")
    return size


def _format_duration(seconds: float) -> str:
    for unit in ("d", "h", "m", "s"):
        factor = _DURATION_UNITS[unit]
        if seconds >= factor and seconds % factor == 0:
            return f"{int(seconds // factor)}{unit}"
    # repr is the shortest decimal that reads back as this float; "f" never uses an exponent.
    return f"{(Decimal(repr(seconds)) * 1000).normalize():f}ms"


Duration = Annotated[
    float, BeforeValidator(parse_duration), PlainSerializer(_format_duration, return_type=str)
]
ByteSize = Annotated[int, BeforeValidator(parse_size)]

# RFC 9110 section 5.1: a field name is a token; anything else (a space, a colon) can never
# match a header a client sends, so such a setting would silently do nothing.
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]+")


def _header_name(value: str) -> str:
    if not _TOKEN.fullmatch(value):
        raise ValueError(f"{value!r} is not a header field name (RFC 9110 section 5.1)")
    return value


HeaderName = Annotated[str, AfterValidator(_header_name)]
# Lower-case, as the ASGI scope carries names; defaults are written lower-case too, since
# defaults are not validated and a printed config must load back equal.
LowerHeaderName = Annotated[HeaderName, AfterValidator(str.lower)]

# The methods a route may record: the unsafe methods RFC 9110 and RFC 5789 define. A safe
# method (GET, HEAD, OPTIONS, TRACE) changes nothing, so there is nothing to deduplicate.
RECORDABLE_METHODS: Final = frozenset({"POST", "PUT", "PATCH", "DELETE"})


def _recordable_methods(value: frozenset[str]) -> frozenset[str]:
    unknown = sorted(value - RECORDABLE_METHODS)
    if unknown:
        allowed = ", ".join(sorted(RECORDABLE_METHODS))
        raise ValueError(f"cannot record {', '.join(unknown)}: methods must be among {allowed}")
    return value


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class KeyPolicy(StrEnum):
    REQUIRED = "required"
    OPTIONAL = "optional"
    OFF = "off"


class AnonymousPolicy(StrEnum):
    """Keyed requests with no credential in any scope header share one ``anonymous`` scope."""

    ALLOW = "allow"
    REFUSE = "refuse"


class OnAmbiguous(StrEnum):
    FAIL = "fail"
    RETRY = "retry"


class ErrorFormat(StrEnum):
    PROBLEM = "problem"
    STRIPE = "stripe"


class StoreUnavailablePolicy(StrEnum):
    FAIL_CLOSED = "fail_closed"
    PASS_THROUGH = "pass_through"


class TimeoutsConfig(_Model):
    connect: Duration = 1.0
    per_try: Duration = 10.0
    total: Duration = 30.0

    @model_validator(mode="after")
    def _positive_and_ordered(self) -> TimeoutsConfig:
        if min(self.connect, self.per_try, self.total) <= 0:
            raise ValueError("timeouts must be greater than zero")
        if self.per_try > self.total:
            raise ValueError("per_try cannot be longer than total")
        return self


class PoolConfig(_Model):
    max_connections: int = Field(100, ge=1, le=10_000)
    # How long an idle connection is kept: set it below the upstream's own keep-alive
    # timeout (5 s for Node.js and uvicorn, 2 s for gunicorn), so the gateway closes first.
    keepalive: Duration = 4.0


CONNECT_FAILURE: Final = "connect-failure"
# RFC 9110: a 4xx says the request was wrong; only these three say "not now, try again".
_RETRYABLE_4XX = frozenset({408, 425, 429})


class BudgetConfig(_Model):
    ratio: float = Field(0.2, ge=0, le=10)
    min_per_second: float = Field(5.0, ge=0)
    window: Duration = 10.0


class RetryConfig(_Model):
    max_attempts: int = Field(3, ge=1, le=10)
    base: Duration = 0.05
    cap: Duration = 2.0
    retry_on: frozenset[int | Literal["connect-failure"]] = frozenset({CONNECT_FAILURE, 429, 503})
    budget: BudgetConfig = BudgetConfig()

    @field_validator("retry_on")
    @classmethod
    def _never_plain_4xx(
        cls, value: frozenset[int | Literal["connect-failure"]]
    ) -> frozenset[int | Literal["connect-failure"]]:
        for status in value:
            if isinstance(status, int) and not (status in _RETRYABLE_4XX or 500 <= status <= 599):
                raise ValueError(
                    f"{status} cannot be retried: only 408, 425, 429 and 5xx say "
                    "the request was not processed"
                )
        return value

    @property
    def retry_statuses(self) -> frozenset[int]:
        return frozenset(status for status in self.retry_on if isinstance(status, int))


BreakerFailure = Literal["connect-failure", "timeout", "connection-lost", "5xx"] | int


class BreakerConfig(_Model):
    window: Duration = 30.0
    min_calls: int = Field(20, ge=1)
    failure_rate: float = Field(0.5, gt=0, le=1)
    slow_call: Duration = 5.0
    slow_call_rate: float = Field(0.8, gt=0, le=1)
    open_for: Duration = 15.0
    half_open_calls: int = Field(3, ge=1)
    failure_on: frozenset[BreakerFailure] = frozenset(
        {CONNECT_FAILURE, "timeout", "connection-lost", "5xx"}
    )


class BulkheadConfig(_Model):
    """A bulkhead, per worker process: at most ``max_concurrent`` requests at once, up to
    ``max_queued`` more waiting in arrival order for at most ``queue_timeout``; anything
    beyond is refused at once with a 503 ``capacity-exhausted`` problem."""

    max_concurrent: int = Field(ge=1, le=100_000)
    max_queued: int = Field(0, ge=0, le=100_000)
    queue_timeout: Duration = 0.1

    @model_validator(mode="after")
    def _queue_has_a_timeout(self) -> BulkheadConfig:
        if self.max_queued and self.queue_timeout <= 0:
            raise ValueError("queue_timeout must be above zero when max_queued is")
        return self


def _no_password() -> bytes:
    # Without a callback OpenSSL would prompt on the terminal, and serve would hang there.
    raise ValueError("client_key is encrypted; give the gateway an unencrypted key file")


class TlsConfig(_Model):
    """TLS toward an ``https`` upstream. The certificate is always verified; by default against
    the system's CAs and for the URL's host name, which is also sent in SNI."""

    # PEM: the CAs that may sign the upstream's certificate (a private CA, a mesh's root).
    ca_bundle: FilePath | None = None
    # PEM: the gateway's own certificate (chain) and its key, for upstreams that require mTLS.
    # The key may be in client_cert's file instead.
    client_cert: FilePath | None = None
    client_key: FilePath | None = None
    # The name sent in SNI and that the certificate must hold, when not the URL's host (an
    # upstream reached by IP address or through a tunnel).
    server_name: str | None = Field(None, min_length=1, max_length=253)
    # Off only for a certificate without the name (the chain is still verified).
    verify_hostname: bool = True

    def context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=self.ca_bundle)
        context.check_hostname = self.verify_hostname
        if self.client_cert is not None:
            context.load_cert_chain(self.client_cert, self.client_key, password=_no_password)
        return context

    @model_validator(mode="after")
    def _loads(self) -> TlsConfig:
        if self.client_key is not None and self.client_cert is None:
            raise ValueError("client_key needs client_cert")
        try:
            if self.ca_bundle is not None or self.client_cert is not None:
                self.context()
        except (ssl.SSLError, OSError, ValueError) as exc:
            # A file that is there but holds no usable PEM: refused now, not at the first call.
            raise ValueError(f"cannot load the TLS files: {exc}") from None
        return self


class UpstreamConfig(_Model):
    url: AnyHttpUrl
    timeouts: TimeoutsConfig = TimeoutsConfig()
    pool: PoolConfig = PoolConfig()
    retry: RetryConfig = RetryConfig()
    breaker: BreakerConfig = BreakerConfig()
    # Every request to this upstream, whatever its route, and every retry (``RetrySlot``).
    bulkhead: BulkheadConfig | None = None
    tls: TlsConfig = TlsConfig()

    @model_validator(mode="after")
    def _queue_shorter_than_deadline(self) -> UpstreamConfig:
        _refuse_queue_past_deadline(self.bulkhead, self.timeouts, "bulkhead")
        return self

    @model_validator(mode="after")
    def _tls_only_for_https(self) -> UpstreamConfig:
        if self.url.scheme != "https" and self.tls != TlsConfig():
            raise ValueError("tls settings need an https url")
        return self

    @property
    def base_url(self) -> str:
        return str(self.url).rstrip("/")


def _refuse_queue_past_deadline(
    bulkhead: BulkheadConfig | None, timeouts: TimeoutsConfig, where: str
) -> None:
    # A request that may wait in the queue for its whole deadline is refused at the deadline
    # instead of at once: exactly what a bulkhead is there to prevent.
    if bulkhead is not None and bulkhead.max_queued and bulkhead.queue_timeout >= timeouts.total:
        raise ValueError(
            f"{where}: queue_timeout ({bulkhead.queue_timeout}s) must be shorter than the "
            f"upstream's timeouts.total ({timeouts.total}s)"
        )


class OutcomeConfig(_Model):
    """Which upstream statuses say the request was not executed, or may have been."""

    not_executed: frozenset[int] = frozenset({408, 425, 429, 503})
    ambiguous: frozenset[int] = frozenset({502, 504})


class SignatureScheme(StrEnum):
    STANDARD_WEBHOOKS = "standard-webhooks"
    GITHUB = "github"
    STRIPE = "stripe"


# The replay windows the schemes themselves define. GitHub signs no timestamp, so a GitHub
# route has none: a captured delivery stays valid, and only the record (for its ttl) stops it
# from executing twice.
SCHEME_TOLERANCE: Final[dict[SignatureScheme, float]] = {
    SignatureScheme.STANDARD_WEBHOOKS: 300.0,
    SignatureScheme.STRIPE: 300.0,
}
# The standardwebhooks package refuses timestamps more than 5 minutes off itself, so a
# longer window could never be honoured; a shorter one can.
STANDARD_WEBHOOKS_MAX_TOLERANCE: Final = 300.0
STANDARD_WEBHOOKS_ID: Final = "webhook-id"

EnvironmentName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]


class SignatureConfig(_Model):
    """How a webhook route verifies its sender: the scheme, and the environment variables
    that hold its secrets (several while one is rotated out; the file never holds one)."""

    scheme: SignatureScheme
    secrets: tuple[EnvironmentName, ...] = Field(min_length=1)
    # Unset: the scheme's own window (SCHEME_TOLERANCE).
    tolerance: Duration | None = None

    @model_validator(mode="after")
    def _tolerance_the_scheme_has(self) -> SignatureConfig:
        if self.tolerance is None:
            return self
        if self.scheme is SignatureScheme.GITHUB:
            raise ValueError("GitHub signs no timestamp: a github signature has no tolerance")
        if self.tolerance <= 0:
            raise ValueError("tolerance must be greater than zero")
        if (
            self.scheme is SignatureScheme.STANDARD_WEBHOOKS
            and self.tolerance > STANDARD_WEBHOOKS_MAX_TOLERANCE
        ):
            raise ValueError("a standard-webhooks tolerance can be at most 5m (the scheme's own)")
        return self


# RFC 6901: "/" then reference tokens, where "~" only ever starts "~0" or "~1".
_JSON_POINTER = re.compile(r"(?:/(?:[^~/]|~[01])*)+")


def _json_pointer(value: str) -> str:
    if not value.startswith("/"):
        raise ValueError(
            f"{value!r} is not a JSON Pointer: it starts with '/', such as /id or /data/id"
        )
    if not _JSON_POINTER.fullmatch(value):
        raise ValueError(f"{value!r}: a '~' in a JSON Pointer is ~0 ('~') or ~1 ('/')")
    return value


JsonPointer = Annotated[str, AfterValidator(_json_pointer)]


def _exactly_one(model: BaseModel, *fields: str) -> None:
    given = [name for name in fields if getattr(model, name) is not None]
    if len(given) != 1:
        raise ValueError(f"give exactly one of {' or '.join(fields)}")


class DeliveryIdConfig(_Model):
    """Where a webhook's delivery id (its idempotency key) is: a header the sender sets
    (``webhook-id``, ``x-github-delivery``) or a JSON Pointer into the body (Stripe's ``/id``)."""

    header: LowerHeaderName | None = None
    json_pointer: JsonPointer | None = None

    @model_validator(mode="after")
    def _one_place(self) -> DeliveryIdConfig:
        _exactly_one(self, "header", "json_pointer")
        return self


class TenantConfig(_Model):
    """Whose delivery ids these are: a fixed name for the sender, or a header's value (one
    sender serving many accounts). The same id from two tenants is two records."""

    name: str | None = Field(None, pattern=r"^[A-Za-z0-9_.:-]{1,64}$")
    header: LowerHeaderName | None = None

    @model_validator(mode="after")
    def _one_source(self) -> TenantConfig:
        _exactly_one(self, "name", "header")
        return self


# Spelled out, so a config that turns verification off says what it gives away: anyone who
# guesses a delivery id can send a fake first, and the real delivery gets the fake's answer.
UnsignedOptOut = Literal["anyone-who-guesses-a-delivery-id-can-poison-it"]
UNSIGNED_OPT_OUT: Final[str] = get_args(UnsignedOptOut)[0]


class WebhookConfig(_Model):
    delivery_id: DeliveryIdConfig
    tenant: TenantConfig
    signature: SignatureConfig | None = None
    unsigned: UnsignedOptOut | None = None

    @model_validator(mode="after")
    def _signed_or_loudly_not(self) -> WebhookConfig:
        if self.signature is None and self.unsigned is None:
            raise ValueError(
                "a webhook route needs a signature (standard-webhooks, github or stripe): "
                "unsigned, anyone who guesses a delivery id poisons it; to accept that anyway "
                f"set unsigned: {UNSIGNED_OPT_OUT}"
            )
        if self.signature is not None and self.unsigned is not None:
            raise ValueError("give a signature or unsigned, not both")
        header = self.delivery_id.header
        if (
            self.signature is not None
            and self.signature.scheme is SignatureScheme.STANDARD_WEBHOOKS
            and header not in (None, STANDARD_WEBHOOKS_ID)
        ):
            # Only webhook-id is signed: any other header could be set to the next id.
            raise ValueError(
                f"a standard-webhooks signature covers {STANDARD_WEBHOOKS_ID}, not {header}: "
                f"take the delivery id from {STANDARD_WEBHOOKS_ID} or a JSON Pointer"
            )
        return self


# A canonical JSON form costs an object per value, so its size is bounded (docs/CONTRACT.md).
DEFAULT_MAX_CANONICAL_BODY: Final = 64 * 1024
MAX_CANONICAL_BODY: Final = 1024 * 1024


class StreamingConfig(_Model):
    """Event streams (``text/event-stream``) on a route: docs/CONTRACT.md, "Event streams
    that survive a dropped connection"."""

    # A duplicate of a request whose stream is still running gets what it produced so far
    # and follows it live, instead of a 409; a finished stream replays event by event.
    follow: bool = False
    # A live stream that sends no event for this long is cut for its followers (who retry
    # with Last-Event-ID and get the answer of record) and its Redis copy expires.
    idle: Duration = 60.0


class IdempotencyConfig(_Model):
    # The field that marks a replayed answer on this route; unset, the gateway-wide one.
    replay_header: HeaderName | None = None
    methods: frozenset[str] = frozenset({"POST", "PATCH"})
    key: KeyPolicy = KeyPolicy.OPTIONAL
    ttl: Duration = 24 * 3600.0
    lease: Duration = 30.0
    on_ambiguous: OnAmbiguous = OnAmbiguous.FAIL
    # Allowed by default: single-tenant and internal services send no credential at all.
    # Anyone who can guess an anonymous key and body shares its answer, so multi-tenant
    # routes should refuse (401).
    anonymous: AnonymousPolicy = AnonymousPolicy.ALLOW
    wait_max: Duration = 10.0
    max_stored_body: ByteSize = 1024 * 1024
    operation: str | None = Field(None, min_length=1, max_length=200)
    fingerprint_headers: tuple[LowerHeaderName, ...] = ()
    # JSON bodies up to this size are compared canonically (key order and whitespace aside);
    # larger ones byte for byte, a pass over the bytes instead of an object per value.
    max_canonical_body: ByteSize = Field(DEFAULT_MAX_CANONICAL_BODY, ge=0, le=MAX_CANONICAL_BODY)
    outcomes: OutcomeConfig = OutcomeConfig()
    # How the gateway's own errors look on this route: RFC 9457 problems, or the body
    # Stripe's SDKs parse (for routes in front of a Stripe-compatible API).
    error_format: ErrorFormat = ErrorFormat.PROBLEM
    streaming: StreamingConfig = StreamingConfig()
    # A webhook route: the key is the sender's delivery id, the scope its tenant, and the
    # sender's signature is verified before anything is recorded (idempotency/webhooks.py).
    webhook: WebhookConfig | None = None

    @field_validator("methods", mode="before")
    @classmethod
    def _upper_methods(cls, value: Any) -> Any:
        if isinstance(value, list | tuple | set | frozenset):
            return frozenset(str(method).upper() for method in value)
        return value

    @field_validator("methods")
    @classmethod
    def _known_methods(cls, value: frozenset[str]) -> frozenset[str]:
        return _recordable_methods(value)

    @model_validator(mode="after")
    def _sane_times(self) -> IdempotencyConfig:
        if self.lease <= 0 or self.ttl <= 0:
            raise ValueError("lease and ttl must be greater than zero")
        if self.lease > self.ttl:
            raise ValueError("lease cannot be longer than ttl")
        if self.webhook is not None and self.key is KeyPolicy.OFF:
            raise ValueError("a webhook route keys every delivery: key cannot be off")
        return self


class RouteMatch(_Model):
    path_prefix: str = Field(pattern=r"^/")
    # Most upstream frameworks (Express, ASP.NET Core, IIS, Spring's option) route /V1/Charges
    # to the /v1/charges handler: a policy matched by exact case would let it pass unprotected.
    case_sensitive: bool = False
    # Rails (and Spring's suffix pattern matching) route /v1/charges.json and /v1/charges. to
    # the /v1/charges handler: with this on, the path's last segment also matches without
    # everything from its first dot on.
    format_suffixes: bool = False


class RouteConfig(_Model):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    match: RouteMatch
    upstream: str
    idempotency: IdempotencyConfig = IdempotencyConfig()
    # The name of a tier in ``bulkheads``: every route naming it shares its capacity.
    bulkhead: str | None = None


class ScopeConfig(_Model):
    # At least one: a scope of no headers would put every client in one scope, where anyone
    # who guesses a key and body shares its answer.
    headers: tuple[LowerHeaderName, ...] = Field(("authorization",), min_length=1)


class LimitsConfig(_Model):
    """What one client may cost a worker. The head and connection limits are enforced by the
    HTTP server itself (``idempotency_gateway.server``), before any request reaches the app."""

    max_request_body: ByteSize = 10 * 1024 * 1024
    # The request line plus every header field, as sent.
    max_request_head: ByteSize = Field(32 * 1024, ge=1024)
    max_header_fields: int = Field(100, ge=1, le=10_000)
    # From the connection's first byte (or its opening) until the head is complete.
    request_head_timeout: Duration = 10.0
    # From the end of the head until the last byte of the body.
    request_body_timeout: Duration = 60.0
    # How long an idle client connection stays open for its next request. Longer than the idle
    # timeout of the balancers commonly in front (AWS ALB, nginx: 60 s) so that the balancer,
    # not the gateway, closes an idle connection: when the gateway closes first, a request the
    # balancer sends on that connection at the same moment is lost and answered with a 502.
    keepalive_timeout: Duration = 75.0
    # Per worker process, on the proxy listener; beyond it a connection gets a 503 problem
    # and is closed at once.
    max_connections: int = Field(1000, ge=1, le=1_000_000)
    # The admin listener's own budget, so that no number of proxy connections can fail
    # /healthz (and get a healthy worker killed by its liveness probe).
    max_admin_connections: int = Field(64, ge=1, le=100_000)

    @model_validator(mode="after")
    def _positive_timeouts(self) -> LimitsConfig:
        if min(self.request_head_timeout, self.request_body_timeout, self.keepalive_timeout) <= 0:
            raise ValueError(
                "request_head_timeout, request_body_timeout and keepalive_timeout must be above 0"
            )
        return self


class CacheConfig(_Model):
    """The replay cache: an in-process LRU of finished answers in each process, in front of
    Redis when ``GATEWAY_REDIS_URL`` is set (``replay.tiered_cache``)."""

    timeout: Duration = 0.05
    max_entry_size: ByteSize = 1024 * 1024
    # The in-process LRU's bounds, per process; with Redis, 0 entries keeps no copies.
    max_entries: int = Field(10_000, ge=0)
    max_bytes: ByteSize = 64 * 1024 * 1024


class SweeperConfig(_Model):
    """Deletes expired records in the background; ``interval: 0s`` turns it off."""

    interval: Duration = 60.0
    batch_size: int = Field(1000, ge=1, le=100_000)


class TracingConfig(_Model):
    """OpenTelemetry traces, exported by OTLP over HTTP (``docs/tracing.md``); needs the
    ``tracing`` extra. Off, the gateway imports nothing of OpenTelemetry. Where spans go is
    the standard ``OTEL_EXPORTER_OTLP_*`` variables' business; ``OTEL_RESOURCE_ATTRIBUTES``
    adds to the resource."""

    enabled: bool = False
    # ``None``: ``OTEL_SERVICE_NAME`` when set, else ``idempotency-gateway``.
    service_name: str | None = Field(None, min_length=1, max_length=200)
    # The share of new traces recorded; a request that arrives with a ``traceparent``
    # follows its caller's sampling decision.
    sample_ratio: float = Field(1.0, ge=0.0, le=1.0)


class StoreConfig(_Model):
    pool_size: int = Field(10, ge=1, le=1000)
    # Request-path connections opened at startup and kept (PostgreSQL): at the server's
    # connection limit the request path has them before any admin or background path.
    pool_min_size: int = Field(2, ge=0, le=1000)
    connect_timeout: Duration = 2.0
    statement_timeout: Duration = 2.0
    # The fewest tries at recording an outcome while the store does not answer; tries go on
    # until the owner's lease runs out.
    finalize_attempts: int = Field(3, ge=1, le=20)
    # Named prepared statements, each prepared once per connection: less parsing and planning
    # per request. Turn off behind PgBouncer in transaction mode, which cannot keep them.
    prepared_statements: bool = True
    # Group commit (PostgreSQL): the reserves, and the finalizes, that one worker meets in one
    # event-loop iteration go out as one statement each, one batch of a kind in flight at a
    # time. Nothing a client sees changes; fewer round trips and commits under load.
    group_commit: bool = True
    group_commit_max_batch: int = Field(64, ge=1, le=1000)


IpNetwork = Annotated[
    IPv4Network | IPv6Network,
    BeforeValidator(lambda value: ip_network(value, strict=False)),
    PlainSerializer(str, return_type=str),
]


class LifecycleConfig(_Model):
    # Load balancers need a few probe periods to see /readyz fail and stop sending; closing
    # the listeners sooner would refuse requests they still route to this gateway.
    drain_grace: Duration = 5.0


# Settings of the whole gateway that a library user of ``IdempotencyMiddleware`` meets too: its
# keyword defaults read these (and the section models' defaults), so each is written once.
DEFAULT_IDEMPOTENCY_HEADER: Final = "Idempotency-Key"
DEFAULT_REPLAY_HEADER: Final = "Idempotent-Replayed"
DEFAULT_STORE_UNAVAILABLE: Final = StoreUnavailablePolicy.FAIL_CLOSED


class GatewayConfig(_Model):
    upstreams: dict[str, UpstreamConfig] = Field(min_length=1)
    routes: tuple[RouteConfig, ...] = Field(min_length=1)
    scope: ScopeConfig = ScopeConfig()
    limits: LimitsConfig = LimitsConfig()
    store: StoreConfig = StoreConfig()
    cache: CacheConfig = CacheConfig()
    sweeper: SweeperConfig = SweeperConfig()
    tracing: TracingConfig = TracingConfig()
    lifecycle: LifecycleConfig = LifecycleConfig()
    store_unavailable: StoreUnavailablePolicy = DEFAULT_STORE_UNAVAILABLE
    idempotency_header: HeaderName = DEFAULT_IDEMPOTENCY_HEADER
    # Stripe's marker by default; ``Idempotency-Replayed`` for clients of the IETF draft.
    replay_header: HeaderName = DEFAULT_REPLAY_HEADER
    trusted_proxies: tuple[IpNetwork, ...] = ()
    # Route tiers (``critical``, ``optional``, ...): named bulkheads that routes opt into.
    bulkheads: dict[Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")], BulkheadConfig] = {}

    @model_validator(mode="after")
    def _routes_name_known_upstreams(self) -> GatewayConfig:
        errors = route_reference_errors(
            [(route.name, route.upstream) for route in self.routes], self.upstreams
        )
        if errors:
            raise PydanticCustomError(_ROUTE_REFERENCES, "; ".join(errors))
        return self

    @model_validator(mode="after")
    def _routes_name_known_bulkheads(self) -> GatewayConfig:
        known = ", ".join(sorted(self.bulkheads)) or "none"
        for route in self.routes:
            if route.bulkhead is None:
                continue
            if route.bulkhead not in self.bulkheads:
                raise ValueError(
                    f"route {route.name!r} names bulkhead {route.bulkhead!r}, "
                    f"which is not defined (defined: {known})"
                )
            _refuse_queue_past_deadline(
                self.bulkheads[route.bulkhead],
                self.upstreams[route.upstream].timeouts,
                f"route {route.name!r}, bulkhead {route.bulkhead!r}",
            )
        return self


# The error type of the route reference check, which validate_config runs on the raw data.
_ROUTE_REFERENCES = "route_references"


def route_reference_errors(
    routes: Iterable[tuple[object, object]], upstreams: Collection[object]
) -> list[str]:
    """What is wrong with the routes' names and the upstreams they name, given as
    ``(name, upstream)`` pairs: checked on raw data too, so one run of check-config reports
    these beside every field error instead of after they are fixed."""
    errors: list[str] = []
    seen: set[object] = set()
    known = ", ".join(sorted(str(name) for name in upstreams))
    for name, upstream in routes:
        if upstream not in upstreams:
            errors.append(
                f"route {name!r} names upstream {upstream!r}, "
                f"which is not defined (defined: {known})"
            )
        if name in seen:
            errors.append(f"route name {name!r} is used twice")
        seen.add(name)
    return errors


# The URL schemes each store accepts; anything else would start and then fail in every worker.
DATABASE_SCHEMES: Final = (
    "postgresql",
    "postgres",
    "postgresql+asyncpg",
    "sqlite",
    # Written by configurations of earlier releases; the store reads it as plain sqlite.
    "sqlite+aiosqlite",
)
REDIS_SCHEMES: Final = ("redis", "rediss", "unix", "redis+cluster", "rediss+cluster")


def _url_with_scheme(value: str | None, schemes: tuple[str, ...], what: str) -> str | None:
    if value is None:
        return None
    scheme, separator, rest = value.partition("://")
    if not separator or scheme.lower() not in schemes or not rest:
        known = ", ".join(f"{name}://" for name in schemes)
        raise ValueError(f"not {what} URL: it must start with one of {known}")
    return value


# With no database configured the records live in this SQLite file, migrated at startup: one
# gateway, nothing to set up.
EMBEDDED_DATABASE_URL: Final = "sqlite:///idempotency-gateway.db"


def database_url_or_default(url: str | None) -> str:
    return url or EMBEDDED_DATABASE_URL


class EnvSettings(BaseSettings):
    """Secrets and addresses that belong in the environment, not in the YAML file."""

    model_config = SettingsConfigDict(env_prefix="GATEWAY_", extra="ignore")

    database_url: str | None = None
    redis_url: str | None = None
    admin_token: SecretStr | None = None
    # Keys the HMAC of client scopes; see idempotency/scope_secret.py.
    scope_secret: SecretStr | None = None
    config: Path | None = None
    admin_port: int = Field(8081, ge=0, le=65535)

    @field_validator("database_url")
    @classmethod
    def _database_url(cls, value: str | None) -> str | None:
        checked = _url_with_scheme(value, DATABASE_SCHEMES, "a PostgreSQL or SQLite")
        if checked is not None:
            # A typo in a host list is an error naming the variable, not a store that fails
            # on every request.
            sqlalchemy_url(checked)
        return checked

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        return _url_with_scheme(value, REDIS_SCHEMES, "a Redis")


class ConfigError(Exception):
    """A configuration that cannot be used; ``errors`` name each bad field."""

    def __init__(self, source: str, errors: list[str]) -> None:
        super().__init__(f"{source}: " + "; ".join(errors))
        self.source = source
        self.errors = errors


def _message(error: ErrorDetails) -> str:
    # pydantic words a validator's ValueError as "Value error, <ours>"; ours says it all.
    return error["msg"].removeprefix("Value error, ")


ADMIN_TOKEN_ENV = "GATEWAY_ADMIN_TOKEN"
# A guessable admin token opens breaker overrides and drains to anyone on the admin network.
ADMIN_TOKEN_MIN_LENGTH = 16


def check_admin_token(token: SecretStr | None) -> None:
    """``ConfigError`` for a token that is set but empty or short: unset turns the operator
    API off, while an empty one would have let ``Authorization: Bearer`` (nothing after it)
    in."""
    if token is not None and len(token.get_secret_value()) < ADMIN_TOKEN_MIN_LENGTH:
        raise ConfigError(
            "the environment",
            [
                f"{ADMIN_TOKEN_ENV} is set but shorter than {ADMIN_TOKEN_MIN_LENGTH} characters "
                "(unset it to turn the admin API off, or use for example the output of "
                "`openssl rand -hex 32`)"
            ],
        )


def _field_path(location: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in location) or "(top level)"


def environment_settings() -> EnvSettings:
    """The ``GATEWAY_*`` settings, or a ``ConfigError`` naming every variable that is wrong:
    checked once, before anything starts, so a bad value is one clear error, not workers that
    crash in a loop."""
    try:
        return EnvSettings()
    except ValidationError as exc:
        prefix = EnvSettings.model_config.get("env_prefix", "")
        errors = [f"{prefix}{str(err['loc'][0]).upper()}: {_message(err)}" for err in exc.errors()]
        raise ConfigError("the environment", errors) from None


def validate_config(data: object, *, source: str) -> GatewayConfig:
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        errors = [
            f"{_field_path(err['loc'])}: {_message(err)}"
            for err in exc.errors()
            # Reported below from the raw data, with the field errors, in one round.
            if err["type"] != _ROUTE_REFERENCES
        ]
        errors.extend(_raw_route_reference_errors(data))
        raise ConfigError(source, errors) from None


def _raw_route_reference_errors(data: object) -> list[str]:
    if not isinstance(data, dict):
        return []
    routes, upstreams = data.get("routes"), data.get("upstreams")
    # No upstreams at all is its own error already; naming each route beside it adds nothing.
    if not isinstance(routes, list) or not isinstance(upstreams, dict) or not upstreams:
        return []
    pairs = [
        (route.get("name"), route.get("upstream")) for route in routes if isinstance(route, dict)
    ]
    return route_reference_errors(pairs, upstreams)


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, except that a key written twice in one mapping is an error: the
    plain loader keeps the last one silently, so half a route's settings would vanish."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[object] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} appears twice in one mapping", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(path: Path) -> GatewayConfig:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(str(path), [f"cannot read the file: {exc.strerror}"]) from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), [f"not valid YAML: {exc}"]) from None
    if not isinstance(data, dict):
        raise ConfigError(str(path), ["the file must hold a mapping with upstreams and routes"])
    return validate_config(data, source=str(path))


def single_upstream_config(url: str) -> GatewayConfig:
    """``serve --upstream URL``: one route, ``/``, with the default policies."""
    return validate_config(
        {
            "upstreams": {"default": {"url": url}},
            "routes": [{"name": "default", "match": {"path_prefix": "/"}, "upstream": "default"}],
        },
        source="--upstream",
    )


def dump_config(config: GatewayConfig) -> str:
    data = config.model_dump(mode="json")
    return yaml.safe_dump(data, sort_keys=False)
