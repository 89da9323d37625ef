"""The YAML configuration: contract section 10's example loads as written, every mistake is an error
that names the field it concerns, durations and sizes parse as documented, and
``check-config`` exits 2 listing every error, or prints YAML that loads back into the same config.
"""

from __future__ import annotations

import copy
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from idempotency_gateway.cli import main
from idempotency_gateway.config import (
    ConfigError,
    GatewayConfig,
    KeyPolicy,
    OnAmbiguous,
    StoreUnavailablePolicy,
    load_config,
    parse_duration,
    parse_size,
    single_upstream_config,
    validate_config,
)

# docs/CONTRACT.md section 10, verbatim.
CONTRACT_EXAMPLE = textwrap.dedent(
    """\
    upstreams:
      payments:
        url: http://127.0.0.1:9000
        timeouts: {connect: 1s, per_try: 10s, total: 30s}
        retry: {max_attempts: 3, base: 50ms, cap: 2s, retry_on: [connect-failure, 429, 503],
                budget: {ratio: 0.2, min_per_second: 5}}
        breaker: {window: 30s, min_calls: 20, failure_rate: 0.5, slow_call: 5s,
                  slow_call_rate: 0.8, open_for: 15s, half_open_calls: 3}
    routes:
      - name: charges
        match: {path_prefix: /v1/charges}
        upstream: payments
        idempotency:
          methods: [POST]
          key: required            # required | optional | off
          ttl: 24h
          lease: 30s
          on_ambiguous: fail       # fail | retry
          wait_max: 10s            # cap on Prefer: wait=N
          max_stored_body: 1MiB
      - name: default
        match: {path_prefix: /}
        upstream: payments
    scope: {headers: [Authorization]}
    limits: {max_request_body: 10MiB}
    store_unavailable: fail_closed # fail_closed | pass_through
    """
)

# Every other knob, with values that do not print back the way they were written.
UNUSUAL_EXAMPLE = textwrap.dedent(
    """\
    upstreams:
      orders-api:
        url: http://127.0.0.1:9001/base/
        timeouts: {connect: 250ms, per_try: 1.5s, total: 3.3s}
        pool: {max_connections: 7, keepalive: 90m}
        retry: {max_attempts: 2, base: 10ms, cap: 1.5s, retry_on: [connect-failure, 502],
                budget: {ratio: 0.1, min_per_second: 1, window: 5s}}
        breaker: {window: 1000.5s, min_calls: 5, failure_rate: 0.25, slow_call: 0.01ms,
                  slow_call_rate: 1, open_for: 2.5s, half_open_calls: 1,
                  failure_on: [timeout, 500]}
    routes:
      - name: orders
        match: {path_prefix: /v1/orders}
        upstream: orders-api
        idempotency:
          methods: [post, put]
          key: optional
          ttl: 1.5h
          lease: 2500ms
          on_ambiguous: retry
          max_stored_body: 1.5KiB
          operation: create-order
          fingerprint_headers: [Stripe-Version]
          outcomes: {not_executed: [429], ambiguous: [502, 504, 520]}
    scope: {headers: [Authorization, Stripe-Account]}
    limits: {max_request_body: 10MB}
    store: {pool_size: 5, connect_timeout: 500ms, statement_timeout: 0.75, finalize_attempts: 4}
    store_unavailable: pass_through
    idempotency_header: X-Idempotency-Key
    trusted_proxies: [10.0.0.0/8, "::1"]
    """
)


def spec_example() -> dict[str, Any]:
    return copy.deepcopy(yaml.safe_load(CONTRACT_EXAMPLE))


def valid_config() -> dict[str, Any]:
    """A small valid config that each error test breaks in exactly one place."""
    return {
        "upstreams": {
            "payments": {
                "url": "http://127.0.0.1:9000",
                "timeouts": {"connect": "1s", "per_try": "10s", "total": "30s"},
            }
        },
        "routes": [
            {
                "name": "charges",
                "match": {"path_prefix": "/v1/charges"},
                "upstream": "payments",
                "idempotency": {"methods": ["POST"], "key": "required", "ttl": "24h"},
            },
            {"name": "default", "match": {"path_prefix": "/"}, "upstream": "payments"},
        ],
    }


def set_at(data: dict[str, Any], path: str, value: object) -> dict[str, Any]:
    """Set ``data[a][b][0]...`` from a dotted path (numbers index lists); returns ``data``."""
    *parents, last = path.split(".")
    node: Any = data
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node.setdefault(part, {})
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return data


def errors_of(data: object) -> list[str]:
    with pytest.raises(ConfigError) as raised:
        validate_config(data, source="test.yaml")
    assert raised.value.source == "test.yaml"
    assert raised.value.errors
    return raised.value.errors


def file_errors(path: Path) -> list[str]:
    with pytest.raises(ConfigError) as raised:
        load_config(path)
    assert raised.value.source == str(path)
    return raised.value.errors


@pytest.fixture
def write(tmp_path: Path) -> Callable[[str], Path]:
    def write_text(text: str) -> Path:
        path = tmp_path / "gateway.yaml"
        path.write_text(text, encoding="utf-8")
        return path

    return write_text


# ------------------------------------------------------------------------- the contract's example


def test_spec_example_loads_as_written(write: Callable[[str], Path]) -> None:
    config = load_config(write(CONTRACT_EXAMPLE))

    payments = config.upstreams["payments"]
    assert payments.base_url == "http://127.0.0.1:9000"
    assert (payments.timeouts.connect, payments.timeouts.per_try, payments.timeouts.total) == (
        1.0,
        10.0,
        30.0,
    )
    charges, default = config.routes
    assert charges.name == "charges"
    assert charges.match.path_prefix == "/v1/charges"
    assert charges.upstream == "payments"
    policy = charges.idempotency
    assert policy.methods == frozenset({"POST"})
    assert policy.key is KeyPolicy.REQUIRED
    assert policy.ttl == 24 * 3600
    assert policy.lease == 30
    assert policy.on_ambiguous is OnAmbiguous.FAIL
    assert policy.max_stored_body == 1024 * 1024
    assert default.name == "default"
    assert default.match.path_prefix == "/"
    assert default.idempotency.key is KeyPolicy.OPTIONAL
    assert default.idempotency.methods == frozenset({"POST", "PATCH"})
    assert config.scope.headers == ("authorization",)
    assert config.limits.max_request_body == 10 * 1024 * 1024
    assert config.store_unavailable is StoreUnavailablePolicy.FAIL_CLOSED


def test_spec_example_retry_and_breaker_settings_are_read() -> None:
    data = valid_config() | {"upstreams": spec_example()["upstreams"]}

    payments = validate_config(data, source="spec").upstreams["payments"]

    retry = payments.retry
    assert (retry.max_attempts, retry.base, retry.cap) == (3, 0.05, 2.0)
    assert retry.retry_on == frozenset({"connect-failure", 429, 503})
    assert (retry.budget.ratio, retry.budget.min_per_second) == (0.2, 5.0)
    breaker = payments.breaker
    assert (breaker.window, breaker.min_calls, breaker.failure_rate) == (30.0, 20, 0.5)
    assert (breaker.slow_call, breaker.slow_call_rate) == (5.0, 0.8)
    assert (breaker.open_for, breaker.half_open_calls) == (15.0, 3)


# ------------------------------------------------------------------------- field errors


@pytest.mark.parametrize(
    "field",
    [
        "upstreams.payments.retyr",
        "upstreams.payments.timeouts.conect",
        "routes.0.idempotency.tll",
        "routes.1.match.path",
        "scopes",
    ],
)
def test_unknown_field_is_an_error_naming_its_path(field: str) -> None:
    errors = errors_of(set_at(valid_config(), field, "x"))

    assert [error for error in errors if error.startswith(f"{field}: ")] == errors


@pytest.mark.parametrize(
    ("field", "value", "error_path", "says"),
    [
        pytest.param(
            "upstreams.payments.timeouts.connect",
            "10 parsecs",
            "upstreams.payments.timeouts.connect",
            "parsecs",
            id="unknown-duration-unit",
        ),
        pytest.param(
            "routes.0.idempotency.ttl",
            -5,
            "routes.0.idempotency.ttl",
            "negative",
            id="negative-duration-number",
        ),
        pytest.param(
            "routes.0.idempotency.lease",
            "-1s",
            "routes.0.idempotency.lease",
            "duration",
            id="negative-duration-text",
        ),
        pytest.param(
            "upstreams.payments.timeouts.connect",
            "0s",
            "upstreams.payments.timeouts",
            "greater than zero",
            id="zero-timeout",
        ),
        pytest.param(
            "upstreams.payments.timeouts.per_try",
            "40s",
            "upstreams.payments.timeouts",
            "per_try cannot be longer than total",
            id="per-try-over-total",
        ),
        pytest.param(
            "routes.0.idempotency.lease",
            "25h",
            "routes.0.idempotency",
            "lease cannot be longer than ttl",
            id="lease-over-ttl",
        ),
        pytest.param(
            "routes.0.idempotency.key",
            "sometimes",
            "routes.0.idempotency.key",
            "'required', 'optional' or 'off'",
            id="unknown-key-policy",
        ),
        pytest.param(
            "routes.0.idempotency.on_ambiguous",
            "maybe",
            "routes.0.idempotency.on_ambiguous",
            "'fail' or 'retry'",
            id="unknown-on-ambiguous",
        ),
        pytest.param(
            "store_unavailable",
            "open",
            "store_unavailable",
            "'fail_closed' or 'pass_through'",
            id="unknown-store-unavailable-policy",
        ),
        pytest.param(
            "limits.max_request_body",
            "10 parsecs",
            "limits.max_request_body",
            "unknown size unit",
            id="unknown-size-unit",
        ),
        pytest.param(
            "upstreams.payments.url",
            "not a url",
            "upstreams.payments.url",
            "URL",
            id="bad-url",
        ),
        pytest.param(
            "routes.1.match.path_prefix",
            "v1",
            "routes.1.match.path_prefix",
            "pattern",
            id="path-prefix-without-slash",
        ),
    ],
)
def test_bad_value_is_an_error_naming_its_field(
    field: str, value: object, error_path: str, says: str
) -> None:
    errors = errors_of(set_at(valid_config(), field, value))

    assert len(errors) == 1
    assert errors[0].startswith(f"{error_path}: ")
    assert says in errors[0]


def test_route_naming_an_undefined_upstream_names_both() -> None:
    errors = errors_of(set_at(valid_config(), "routes.1.upstream", "billing"))

    assert len(errors) == 1
    assert "'default'" in errors[0]
    assert "'billing'" in errors[0]
    assert "payments" in errors[0]


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        pytest.param(
            "routes.0.idempotency.fingerprint_headers", ["X Tenant"], "not a header", id="space"
        ),
        pytest.param(
            "scope.headers", ["authorization", "stripe-account:"], "not a header", id="colon"
        ),
        pytest.param("idempotency_header", "Idempotency Key", "not a header", id="key-header"),
        pytest.param("scope.headers", [], "at least 1", id="empty-scope"),
        pytest.param("routes.0.idempotency.methods", ["GET", "FOO"], "FOO, GET", id="methods"),
        pytest.param("routes.0.idempotency.methods", ["post", "HEAD"], "HEAD", id="safe-method"),
    ],
)
def test_a_setting_that_cannot_work_is_an_error(field: str, value: object, says: str) -> None:
    errors = errors_of(set_at(valid_config(), field, value))

    assert len(errors) == 1
    assert errors[0].startswith(f"{field}")
    assert says in errors[0]


def test_a_key_written_twice_is_an_error_naming_its_line(write: Callable[[str], Path]) -> None:
    text = yaml.safe_dump(valid_config(), sort_keys=False)
    doubled = text.replace("upstreams:\n", "upstreams:\n  payments:\n    url: http://x:1\n", 1)
    path = write(doubled)

    with pytest.raises(ConfigError) as raised:
        load_config(path)

    assert "'payments' appears twice" in raised.value.errors[0]
    assert "line 4" in raised.value.errors[0]  # where the second one is


def test_field_errors_and_route_references_are_reported_in_one_round() -> None:
    data = valid_config()
    set_at(data, "routes.0.idempotency.key", "sometimes")
    set_at(data, "routes.1.upstream", "billing")
    set_at(data, "routes.1.name", "charges")

    errors = errors_of(data)

    assert len(errors) == 3
    assert errors[0].startswith("routes.0.idempotency.key: ")
    assert any("'billing'" in error for error in errors)
    assert any("used twice" in error for error in errors)


def test_duplicate_route_names_are_an_error() -> None:
    errors = errors_of(set_at(valid_config(), "routes.1.name", "charges"))

    assert len(errors) == 1
    assert "'charges'" in errors[0]
    assert "twice" in errors[0]


@pytest.mark.parametrize("section", ["routes", "upstreams"])
def test_missing_section_is_an_error(section: str) -> None:
    data = valid_config()
    del data[section]

    assert errors_of(data) == [f"{section}: Field required"]


@pytest.mark.parametrize("section", ["routes", "upstreams"])
def test_empty_section_is_an_error(section: str) -> None:
    errors = errors_of(set_at(valid_config(), section, [] if section == "routes" else {}))

    assert [error for error in errors if error.startswith(f"{section}: ")] == errors


def test_every_bad_field_is_reported_at_once() -> None:
    data = valid_config()
    set_at(data, "upstreams.payments.timeouts.connect", "10 parsecs")
    set_at(data, "routes.0.idempotency.key", "sometimes")
    set_at(data, "upstreams.payments.retyr", 3)

    errors = errors_of(data)

    assert sorted(error.split(":")[0] for error in errors) == [
        "routes.0.idempotency.key",
        "upstreams.payments.retyr",
        "upstreams.payments.timeouts.connect",
    ]


# ------------------------------------------------------------------------- file errors


@pytest.mark.parametrize(
    ("text", "says"),
    [
        pytest.param("upstreams: [unclosed\n", "not valid YAML", id="unclosed-flow-sequence"),
        pytest.param("routes:\n  - name: a\n bad: indent\n", "not valid YAML", id="bad-indent"),
        pytest.param("- upstreams\n- routes\n", "mapping", id="list"),
        pytest.param("just a string\n", "mapping", id="scalar"),
        pytest.param("", "mapping", id="empty-file"),
    ],
)
def test_unusable_file_content_is_an_error(
    write: Callable[[str], Path], text: str, says: str
) -> None:
    errors = file_errors(write(text))

    assert len(errors) == 1
    assert says in errors[0]


@pytest.mark.parametrize("name", ["missing.yaml", "."])
def test_unreadable_path_is_an_error(tmp_path: Path, name: str) -> None:
    errors = file_errors(tmp_path / name)

    assert len(errors) == 1
    assert "cannot read the file" in errors[0]


# ----------------------------------------------------------------------- check-config


def test_check_config_lists_every_error_on_stderr_and_exits_2(
    write: Callable[[str], Path], capsys: pytest.CaptureFixture[str]
) -> None:
    data = valid_config()
    set_at(data, "upstreams.payments.timeouts.connect", "10 parsecs")
    set_at(data, "routes.0.idempotency.key", "sometimes")
    set_at(data, "upstreams.payments.retyr", 3)
    path = write(yaml.safe_dump(data))

    code = main(["check-config", str(path)])

    assert code == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert str(path) in err.splitlines()[0]
    listed = [line for line in err.splitlines() if line.startswith("  - ")]
    assert sorted(line[4:].split(":")[0] for line in listed) == [
        "routes.0.idempotency.key",
        "upstreams.payments.retyr",
        "upstreams.payments.timeouts.connect",
    ]


@pytest.mark.parametrize(
    ("text", "says"),
    [
        pytest.param("upstreams: [unclosed\n", "not valid YAML", id="invalid-yaml"),
        pytest.param(None, "cannot read the file", id="missing-file"),
    ],
)
def test_check_config_reports_an_unusable_file(
    tmp_path: Path,
    write: Callable[[str], Path],
    capsys: pytest.CaptureFixture[str],
    text: str | None,
    says: str,
) -> None:
    path = write(text) if text is not None else tmp_path / "missing.yaml"

    assert main(["check-config", str(path)]) == 2

    out, err = capsys.readouterr()
    assert out == ""
    assert says in err


@pytest.mark.parametrize(
    "text", [yaml.safe_dump(valid_config()), UNUSUAL_EXAMPLE], ids=["small", "unusual"]
)
def test_check_config_prints_yaml_that_loads_back_equal(
    write: Callable[[str], Path], capsys: pytest.CaptureFixture[str], text: str
) -> None:
    path = write(text)

    assert main(["check-config", str(path)]) == 0

    out, err = capsys.readouterr()
    assert err == ""
    printed = validate_config(yaml.safe_load(out), source="printed")
    assert printed == load_config(path)


def test_unusual_example_values_are_read() -> None:
    config = validate_config(yaml.safe_load(UNUSUAL_EXAMPLE), source="unusual")

    upstream = config.upstreams["orders-api"]
    assert (upstream.timeouts.connect, upstream.timeouts.per_try) == (0.25, 1.5)
    assert upstream.pool.keepalive == 90 * 60
    assert (upstream.breaker.window, upstream.breaker.slow_call) == (1000.5, 0.00001)
    policy = config.routes[0].idempotency
    assert policy.methods == frozenset({"POST", "PUT"})
    assert (policy.ttl, policy.lease) == (1.5 * 3600, 2.5)
    assert policy.max_stored_body == 1536
    assert policy.fingerprint_headers == ("stripe-version",)
    assert policy.outcomes.ambiguous == frozenset({502, 504, 520})
    assert config.scope.headers == ("authorization", "stripe-account")
    assert config.limits.max_request_body == 10_000_000
    assert config.store.statement_timeout == 0.75
    assert [str(network) for network in config.trusted_proxies] == ["10.0.0.0/8", "::1/128"]


# ------------------------------------------------------------------ durations and sizes


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("250ms", 0.25),
        ("30s", 30.0),
        ("5m", 300.0),
        ("24h", 86400.0),
        ("1d", 86400.0),
        ("1.5s", 1.5),
        ("3.3s", 3.3),
        ("3300ms", 3.3),
        (" 30s ", 30.0),
        ("30S", 30.0),
        ("15", 15.0),
        (15, 15.0),
        (2.5, 2.5),
        (0, 0.0),
    ],
)
def test_parse_duration(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@pytest.mark.parametrize(
    "text", ["10 parsecs", "-1s", -1, -0.5, True, "", "s", "1.5.2s", "1,5s", None, [1]]
)
def test_parse_duration_rejects(text: object) -> None:
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("text", "size"),
    [
        ("1MiB", 1024**2),
        ("10MB", 10_000_000),
        ("512KiB", 512 * 1024),
        ("1GiB", 1024**3),
        ("100B", 100),
        ("1.5KiB", 1536),
        ("2048", 2048),
        (2048, 2048),
        (0, 0),
    ],
)
def test_parse_size(text: object, size: int) -> None:
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["10 parsecs", "10XB", "-1KiB", -1, True, 1.5, "", None])
def test_parse_size_rejects(text: object) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_size(text)


# ----------------------------------------------------------------------- --upstream URL


def test_single_upstream_config_is_one_route_with_default_policies() -> None:
    config = single_upstream_config("http://127.0.0.1:9000")

    assert isinstance(config, GatewayConfig)
    assert list(config.upstreams) == ["default"]
    assert config.upstreams["default"].base_url == "http://127.0.0.1:9000"
    (route,) = config.routes
    assert route.match.path_prefix == "/"
    assert route.upstream == "default"
    assert (
        route.idempotency
        == validate_config(
            {
                "upstreams": {"u": {"url": "http://x"}},
                "routes": [{"name": "r", "match": {"path_prefix": "/"}, "upstream": "u"}],
            },
            source="defaults",
        )
        .routes[0]
        .idempotency
    )


def test_single_upstream_config_rejects_a_bad_url() -> None:
    with pytest.raises(ConfigError) as raised:
        single_upstream_config("not a url")

    assert raised.value.source == "--upstream"
    assert [error.split(":")[0] for error in raised.value.errors] == ["upstreams.default.url"]
