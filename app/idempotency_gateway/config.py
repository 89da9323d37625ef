"""Configuration: the YAML file (``GatewayConfig``) and ``GATEWAY_*`` environment settings.

Every model forbids unknown fields, so a typo is an error that names the field instead of a
silently ignored setting. Durations are written ``250ms``, ``30s``, ``5m``, ``24h``; sizes
``512KiB``, ``1MiB``, ``10MB``; plain numbers mean seconds and bytes.
"""

from __future__ import annotations

import re
from decimal import Decimal
from enum import StrEnum
from ipaddress import IPv4Network, IPv6Network, ip_network
from pathlib import Path
from typing import Annotated, Any, Final, Literal

import yaml
from pydantic import (
    AnyHttpUrl,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

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


class UpstreamConfig(_Model):
    url: AnyHttpUrl
    timeouts: TimeoutsConfig = TimeoutsConfig()
    pool: PoolConfig = PoolConfig()
    retry: RetryConfig = RetryConfig()
    breaker: BreakerConfig = BreakerConfig()

    @property
    def base_url(self) -> str:
        return str(self.url).rstrip("/")


class OutcomeConfig(_Model):
    """Which upstream statuses say the request was not executed, or may have been."""

    not_executed: frozenset[int] = frozenset({408, 425, 429, 503})
    ambiguous: frozenset[int] = frozenset({502, 504})


class IdempotencyConfig(_Model):
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
    fingerprint_headers: tuple[str, ...] = ()
    outcomes: OutcomeConfig = OutcomeConfig()
    # How the gateway's own errors look on this route: RFC 9457 problems, or the body
    # Stripe's SDKs parse (for routes in front of a Stripe-compatible API).
    error_format: ErrorFormat = ErrorFormat.PROBLEM

    @field_validator("methods", mode="before")
    @classmethod
    def _upper_methods(cls, value: Any) -> Any:
        if isinstance(value, list | tuple | set | frozenset):
            return frozenset(str(method).upper() for method in value)
        return value

    @field_validator("fingerprint_headers")
    @classmethod
    def _lower_headers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(name.lower() for name in value)

    @model_validator(mode="after")
    def _sane_times(self) -> IdempotencyConfig:
        if self.lease <= 0 or self.ttl <= 0:
            raise ValueError("lease and ttl must be greater than zero")
        if self.lease > self.ttl:
            raise ValueError("lease cannot be longer than ttl")
        return self


class RouteMatch(_Model):
    path_prefix: str = Field(pattern=r"^/")


class RouteConfig(_Model):
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    match: RouteMatch
    upstream: str
    idempotency: IdempotencyConfig = IdempotencyConfig()


class ScopeConfig(_Model):
    # Lower-case like the validator's output: defaults are not validated, and a printed
    # config must load back equal.
    headers: tuple[str, ...] = ("authorization",)

    @field_validator("headers")
    @classmethod
    def _lower_headers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(name.lower() for name in value)


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
    # Per worker process, on the proxy listener; beyond it a connection gets a 503 problem
    # and is closed at once.
    max_connections: int = Field(1000, ge=1, le=1_000_000)
    # The admin listener's own budget, so that no number of proxy connections can fail
    # /healthz (and get a healthy worker killed by its liveness probe).
    max_admin_connections: int = Field(64, ge=1, le=100_000)

    @model_validator(mode="after")
    def _positive_timeouts(self) -> LimitsConfig:
        if min(self.request_head_timeout, self.request_body_timeout) <= 0:
            raise ValueError("request_head_timeout and request_body_timeout must be above zero")
        return self


class CacheConfig(_Model):
    """The replay cache: Redis when ``GATEWAY_REDIS_URL`` is set, else an in-process LRU."""

    timeout: Duration = 0.05
    max_entry_size: ByteSize = 1024 * 1024
    max_entries: int = Field(10_000, ge=0)
    max_bytes: ByteSize = 64 * 1024 * 1024


class SweeperConfig(_Model):
    """Deletes expired records in the background; ``interval: 0s`` turns it off."""

    interval: Duration = 60.0
    batch_size: int = Field(1000, ge=1, le=100_000)


class StoreConfig(_Model):
    pool_size: int = Field(10, ge=1, le=1000)
    connect_timeout: Duration = 2.0
    statement_timeout: Duration = 2.0
    finalize_attempts: int = Field(3, ge=1, le=20)
    # Named prepared statements, each prepared once per connection: less parsing and planning
    # per request. Turn off behind PgBouncer in transaction mode, which cannot keep them.
    prepared_statements: bool = True


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
DEFAULT_STORE_UNAVAILABLE: Final = StoreUnavailablePolicy.FAIL_CLOSED


class GatewayConfig(_Model):
    upstreams: dict[str, UpstreamConfig] = Field(min_length=1)
    routes: tuple[RouteConfig, ...] = Field(min_length=1)
    scope: ScopeConfig = ScopeConfig()
    limits: LimitsConfig = LimitsConfig()
    store: StoreConfig = StoreConfig()
    cache: CacheConfig = CacheConfig()
    sweeper: SweeperConfig = SweeperConfig()
    lifecycle: LifecycleConfig = LifecycleConfig()
    store_unavailable: StoreUnavailablePolicy = DEFAULT_STORE_UNAVAILABLE
    idempotency_header: str = DEFAULT_IDEMPOTENCY_HEADER
    trusted_proxies: tuple[IpNetwork, ...] = ()

    @model_validator(mode="after")
    def _routes_name_known_upstreams(self) -> GatewayConfig:
        names: set[str] = set()
        for route in self.routes:
            if route.upstream not in self.upstreams:
                known = ", ".join(sorted(self.upstreams))
                raise ValueError(
                    f"route {route.name!r} names upstream {route.upstream!r}, "
                    f"which is not defined (defined: {known})"
                )
            if route.name in names:
                raise ValueError(f"route name {route.name!r} is used twice")
            names.add(route.name)
        return self


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


class ConfigError(Exception):
    """A configuration that cannot be used; ``errors`` name each bad field."""

    def __init__(self, source: str, errors: list[str]) -> None:
        super().__init__(f"{source}: " + "; ".join(errors))
        self.source = source
        self.errors = errors


ADMIN_TOKEN_ENV = "GATEWAY_ADMIN_TOKEN"
# A guessable admin token opens breaker overrides and drains to anyone on the admin network.
ADMIN_TOKEN_MIN_LENGTH = 16


def check_admin_token(token: SecretStr | None) -> None:
    """``ConfigError`` for a token that is set but empty or short: unset turns the operator
    API off, while an empty one would have let ``Authorization: Bearer`` (nothing after it)
    in."""
    if token is not None and len(token.get_secret_value()) < ADMIN_TOKEN_MIN_LENGTH:
        raise ConfigError(
            "environment",
            [
                f"{ADMIN_TOKEN_ENV} is set but shorter than {ADMIN_TOKEN_MIN_LENGTH} characters "
                "(unset it to turn the admin API off, or use for example the output of "
                "`openssl rand -hex 32`)"
            ],
        )


def _field_path(location: tuple[int | str, ...]) -> str:
    return ".".join(str(part) for part in location) or "(top level)"


def validate_config(data: object, *, source: str) -> GatewayConfig:
    try:
        return GatewayConfig.model_validate(data)
    except ValidationError as exc:
        errors = [f"{_field_path(err['loc'])}: {err['msg']}" for err in exc.errors()]
        raise ConfigError(source, errors) from None


def load_config(path: Path) -> GatewayConfig:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(str(path), [f"cannot read the file: {exc.strerror}"]) from None
    try:
        data = yaml.safe_load(text)
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
