"""Keyed requests to a gateway, and the record key the gateway files them under.

    response = await send_keyed(gateway.client, key, behavior="gate=g1", prefer="wait=5")
    entry = await redis.get(cache_key(record_key(key)))

``keyed_gateway_config`` is a gateway config whose one route ``/`` requires a key and whose
upstream gets a single attempt per request, so every upstream execution is one the record
allowed (a retry is always the client's).
"""

from __future__ import annotations

from typing import Any

import httpx

from idempotency_gateway.config import GatewayConfig
from idempotency_gateway.idempotency.keys import tenant_of
from idempotency_gateway.storage.records import RecordKey
from tests.support.charges import CHARGE, CHARGES, keyed_headers
from tests.support.gateway import gateway_config, route
from tests.support.servers import TEST_SCOPE_SECRET
from tests.support.upstream import RecordingUpstream

AUTHORIZATION = "Bearer sk_test_keyed_requests"

REPLAYED = "idempotent-replayed"
PREFERENCE_APPLIED = "preference-applied"


def keyed_gateway_config(upstream_url: str, **overrides: Any) -> GatewayConfig:
    """``gateway_config`` with a key-required route ``/`` and one upstream attempt, unless
    ``routes`` or ``retry`` say otherwise."""
    overrides.setdefault("routes", [route("/", key="required")])
    overrides.setdefault("retry", {"max_attempts": 1})
    return gateway_config(upstream_url, **overrides)


def record_key(key: str, *, method: str = "POST", path: str = CHARGES) -> RecordKey:
    """The record key of a ``send_keyed`` request (default scope and operation)."""
    scope = tenant_of(
        [(b"authorization", AUTHORIZATION.encode())],
        (b"authorization",),
        secret=TEST_SCOPE_SECRET.encode(),
    )
    return RecordKey(scope, f"{method} {path}", key)


async def send_keyed(
    client: httpx.AsyncClient,
    key: str,
    *,
    path: str = CHARGES,
    json: Any = CHARGE,
    behavior: str | None = None,
    prefer: str | None = None,
) -> httpx.Response:
    """POST ``json`` to ``path`` with ``Idempotency-Key: key`` and the fixed credential."""
    headers = keyed_headers(key, behavior=behavior, headers={"Authorization": AUTHORIZATION})
    if prefer is not None:
        headers["Prefer"] = prefer
    return await client.post(path, json=json, headers=headers)


def is_replay(response: httpx.Response) -> bool:
    return bool(response.headers.get(REPLAYED) == "true")


async def assert_replays(
    client: httpx.AsyncClient, key: str, first: httpx.Response, upstream: RecordingUpstream
) -> None:
    """A duplicate through ``client`` gets ``first`` replayed, and ``key`` executed once."""
    replayed = await send_keyed(client, key)
    assert replayed.status_code == first.status_code, replayed.text
    assert is_replay(replayed)
    assert replayed.json() == first.json()
    assert upstream.count(key) == 1
