"""Webhook settings that cannot work are refused before anything starts.

check-config refuses nonsense (a pointer that is no JSON Pointer, a delivery id in two places,
a webhook route without a signature unless the opt-out is spelled out); ``serve`` exits 2
naming a secret variable that is unset or unusable, never printing a value. The JSON Pointer
resolver follows RFC 6901's own examples, and a signature's timestamp is held to the
tolerance to the second, on an injected clock.
"""

from __future__ import annotations

import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from idempotency_gateway.config import (
    UNSIGNED_OPT_OUT,
    ConfigError,
    dump_config,
    load_config,
    validate_config,
)
from idempotency_gateway.errors import WebhookSignatureInvalid
from idempotency_gateway.webhooks.github import GitHubSignature
from idempotency_gateway.webhooks.pointer import reference_tokens, resolve
from idempotency_gateway.webhooks.standard import StandardWebhooksSignature
from idempotency_gateway.webhooks.stripe import StripeSignature
from tests.support import write_config
from tests.support.clock import ManualClock
from tests.support.webhooks import (
    GITHUB_SECRET,
    STANDARD_SECRET,
    STRIPE_SECRET,
    stripe_signature,
    unix_now,
)

# A gateway per configuration: seconds. test_webhooks keeps the webhooks in the fast loop.
pytestmark = pytest.mark.slow

SIGNED = {"scheme": "github", "secrets": ["HOOK_SECRET"]}


def config_with(webhook: dict[str, Any], **idempotency: Any) -> dict[str, Any]:
    return {
        "upstreams": {"app": {"url": "http://127.0.0.1:9"}},
        "routes": [
            {
                "name": "hooks",
                "match": {"path_prefix": "/hooks"},
                "upstream": "app",
                "idempotency": {"webhook": webhook, **idempotency},
            }
        ],
    }


def webhook(**changes: Any) -> dict[str, Any]:
    return {
        "delivery_id": {"header": "webhook-id"},
        "tenant": {"name": "acme"},
        "signature": {"scheme": "standard-webhooks", "secrets": ["HOOK_SECRET"]},
        **changes,
    }


def refusal(data: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as refused:
        validate_config(data, source="test")
    return "; ".join(refused.value.errors)


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (webhook(delivery_id={"json_pointer": "id"}), "starts with '/'"),
        (webhook(delivery_id={"json_pointer": ""}), "starts with '/'"),
        (webhook(delivery_id={"json_pointer": "/a~2b"}), "~0 ('~') or ~1 ('/')"),
        (webhook(delivery_id={"json_pointer": "/a~"}), "~0 ('~') or ~1 ('/')"),
        (webhook(delivery_id={"header": "webhook-id", "json_pointer": "/id"}), "exactly one"),
        (webhook(delivery_id={}), "exactly one of header or json_pointer"),
        (webhook(delivery_id={"header": "webhook id"}), "not a header field name"),
        (webhook(tenant={"name": "acme", "header": "x-shop"}), "exactly one of name or header"),
        (webhook(tenant={}), "exactly one of name or header"),
        (webhook(signature=None), UNSIGNED_OPT_OUT),
        (webhook(signature=None, unsigned="yes"), UNSIGNED_OPT_OUT),
        (webhook(unsigned=UNSIGNED_OPT_OUT), "not both"),
        (webhook(signature={"scheme": "github", "secrets": []}), "at least 1"),
        (webhook(signature={"scheme": "hmac", "secrets": ["S"]}), "standard-webhooks"),
        (webhook(signature={"scheme": "github", "secrets": ["NOT A NAME"]}), "should match"),
        (webhook(signature={**SIGNED, "tolerance": "5m"}), "GitHub signs no timestamp"),
        (
            webhook(signature={"scheme": "standard-webhooks", "secrets": ["S"], "tolerance": "6m"}),
            "at most 5m",
        ),
        (webhook(signature={"scheme": "stripe", "secrets": ["S"], "tolerance": 0}), "zero"),
        (webhook(secret="inline"), "secret"),
        (webhook(delivery_id={"header": "X-Delivery"}), "covers webhook-id, not x-delivery"),
    ],
)
def test_check_config_refuses_webhook_nonsense(data: dict[str, Any], words: str) -> None:
    assert words in refusal(config_with(data))


def test_a_webhook_route_cannot_turn_its_key_off() -> None:
    assert "key cannot be off" in refusal(config_with(webhook(), key="off"))


@pytest.mark.parametrize(
    "data",
    [
        webhook(),
        webhook(
            delivery_id={"json_pointer": "/data/0/a~1b~0c"},
            tenant={"header": "X-Shop-Domain"},
            signature={"scheme": "stripe", "secrets": ["NEW", "OLD"], "tolerance": "90s"},
        ),
        webhook(signature=None, unsigned=UNSIGNED_OPT_OUT),
    ],
)
def test_check_config_prints_a_webhook_route_that_loads_back_equal(
    data: dict[str, Any], tmp_path: Path
) -> None:
    config = validate_config(config_with(data), source="test")
    printed = tmp_path / "printed.yaml"
    printed.write_text(dump_config(config))
    assert load_config(printed) == config


def run_cli(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    clean = {name: value for name, value in os.environ.items() if not name.startswith("GATEWAY_")}
    return subprocess.run(
        [sys.executable, "-m", "idempotency_gateway.cli", *args],
        env={**clean, **env},
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_check_config_exits_2_on_an_unsigned_webhook_route(tmp_path: Path) -> None:
    path = write_config(tmp_path, config_with(webhook(signature=None)))
    finished = run_cli("check-config", str(path), env={}, cwd=tmp_path)
    assert finished.returncode == 2
    assert "routes.0.idempotency.webhook" in finished.stderr
    assert UNSIGNED_OPT_OUT in finished.stderr


@pytest.mark.parametrize(
    ("environment", "named", "hidden"),
    [
        ({}, "HOOK_SECRET is not set", None),
        # An empty HMAC key is one anyone can sign with.
        ({"HOOK_SECRET": ""}, "HOOK_SECRET is not set", None),
        # Not base64 after whsec_: named, and its value never printed.
        (
            {"HOOK_SECRET": "whsec_Zm9vYmFyx"},
            "HOOK_SECRET: a Standard Webhooks secret",
            "Zm9vYmFyx",
        ),
    ],
)
def test_serve_exits_2_naming_a_webhook_secret_it_cannot_use(
    tmp_path: Path, environment: dict[str, str], named: str, hidden: str | None
) -> None:
    path = write_config(tmp_path, config_with(webhook()))
    finished = run_cli("serve", "--config", str(path), env=environment, cwd=tmp_path)

    assert finished.returncode == 2, finished.stderr
    assert named in finished.stderr
    assert "'hooks'" in finished.stderr
    assert "Traceback" not in finished.stderr
    if hidden is not None:
        assert hidden not in finished.stdout + finished.stderr
    # Refused before anything started: no embedded database was created.
    assert list(tmp_path.glob("*.db")) == []


# RFC 6901 section 5, the document and every pointer of its table.
RFC_DOCUMENT = {
    "foo": ["bar", "baz"],
    "": 0,
    "a/b": 1,
    "c%d": 2,
    "e^f": 3,
    "g|h": 4,
    "i\\j": 5,
    'k"l': 6,
    " ": 7,
    "m~n": 8,
}


@pytest.mark.parametrize(
    ("pointer", "value"),
    [
        ("/foo", ["bar", "baz"]),
        ("/foo/0", "bar"),
        ("/", 0),
        ("/a~1b", 1),
        ("/c%d", 2),
        ("/e^f", 3),
        ("/g|h", 4),
        ("/i\\j", 5),
        ('/k"l', 6),
        ("/ ", 7),
        ("/m~0n", 8),
    ],
)
def test_json_pointers_resolve_as_rfc_6901_shows(pointer: str, value: object) -> None:
    assert resolve(RFC_DOCUMENT, reference_tokens(pointer)) == value


def test_tilde_one_is_unescaped_before_tilde_zero() -> None:
    # "~01" is "~1" (a tilde, then a one), never "/".
    assert reference_tokens("/~01") == ("~1",)


@pytest.mark.parametrize("pointer", ["/foo/2", "/foo/-", "/foo/01", "/foo/+1", "/missing", "/ /x"])
def test_json_pointers_to_nothing_are_lookup_errors(pointer: str) -> None:
    with pytest.raises(LookupError):
        resolve(RFC_DOCUMENT, reference_tokens(pointer))


@pytest.mark.parametrize(
    ("age", "accepted"), [(300, True), (301, False), (-300, True), (-301, False)]
)
def test_a_stripe_timestamp_is_held_to_the_tolerance_to_the_second(
    age: int, accepted: bool
) -> None:
    clock = ManualClock()
    verifier = StripeSignature([STRIPE_SECRET], tolerance=300.0, clock=clock.utc)
    body = b'{"id": "evt_1"}'
    signed_at = int((clock.now - timedelta(seconds=age)).timestamp())
    headers = [(b"stripe-signature", stripe_signature(STRIPE_SECRET, body, at=signed_at).encode())]
    if accepted:
        verifier.verify(headers, body)
    else:
        with pytest.raises(WebhookSignatureInvalid):
            verifier.verify(headers, body)
    # The same signature over other bytes never verifies: the body is signed as sent.
    with pytest.raises(WebhookSignatureInvalid):
        verifier.verify(headers, body + b" ")


VERIFIERS = (
    StandardWebhooksSignature([STANDARD_SECRET], tolerance=300.0),
    GitHubSignature([GITHUB_SECRET]),
    StripeSignature([STRIPE_SECRET], tolerance=300.0),
)
# Shaped like real fields often enough to get past the parsing into each scheme's comparison
# (the package's verify included): a timestamp of now, "v1,<base64>" lists, "t=...,v1=..."
# items, "sha256=<hex>"; or any bytes at all.
now = st.builds(lambda: str(unix_now()).encode())
anything = st.binary(max_size=80)
FIELDS = {
    b"webhook-id": st.one_of(st.from_regex(rb"\A[!-~]{1,40}\Z"), anything),
    b"webhook-timestamp": st.one_of(now, anything),
    b"webhook-signature": st.one_of(
        st.lists(st.from_regex(rb"\Av1,[A-Za-z0-9+/=]{0,48}\Z"), max_size=3).map(b" ".join),
        anything,
    ),
    b"x-hub-signature-256": st.one_of(st.from_regex(rb"\Asha256=[0-9a-fA-F]{0,64}\Z"), anything),
    b"stripe-signature": st.one_of(
        st.tuples(now, st.lists(st.from_regex(rb"\A(v1|v0|t)=[0-9a-f]{0,64}\Z"), max_size=3)).map(
            lambda parts: b",".join([b"t=" + parts[0], *parts[1]])
        ),
        anything,
    ),
}
every_field_once = st.fixed_dictionaries(FIELDS).map(lambda fields: list(fields.items()))
any_fields = st.lists(
    st.sampled_from(list(FIELDS)).flatmap(lambda name: st.tuples(st.just(name), FIELDS[name])),
    max_size=6,
)


@settings(max_examples=300, deadline=None)
@given(
    fields=st.one_of(every_field_once, any_fields),
    body=st.binary(max_size=120),
)
def test_any_signature_fields_are_refused_cleanly_never_crash_or_verify(
    fields: list[tuple[bytes, bytes]], body: bytes
) -> None:
    """Whatever a forger sends (no secret), every scheme refuses it with its 401, never an
    exception of its own (a 500): the package's too, on bytes that are not UTF-8."""
    for verifier in VERIFIERS:
        with pytest.raises(WebhookSignatureInvalid):
            verifier.verify(fields, body)
