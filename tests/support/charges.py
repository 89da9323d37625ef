"""The charge most tests send: one path and one body, so a change to either is made once.

``/v1/charges`` is the route the configs mark ``key: required`` (and ``on_ambiguous: fail``
where a test says so): the one whose second execution would charge a card twice.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tests.support.upstream import BEHAVIOR_HEADER, KEY_HEADER

CHARGES = "/v1/charges"
CHARGE: dict[str, Any] = {"amount": 1000, "currency": "usd"}
CHARGE_BODY = json.dumps(CHARGE).encode()
"""``CHARGE`` as bytes on the wire, for raw-socket requests."""


def keyed_headers(
    key: str | None, *, behavior: str | None = None, headers: Mapping[str, str] | None = None
) -> dict[str, str]:
    """``headers`` plus ``Idempotency-Key: key`` when there is a key, and the recording
    upstream's behaviour script when there is one."""
    sent = dict(headers or {})
    if key is not None:
        sent[KEY_HEADER] = key
    if behavior is not None:
        sent[BEHAVIOR_HEADER] = behavior
    return sent
