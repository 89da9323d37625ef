"""The charge most tests send: one path and one body, so a change to either is made once.

``/v1/charges`` is the route the configs mark ``key: required`` (and ``on_ambiguous: fail``
where a test says so): the one whose second execution would charge a card twice.
"""

from __future__ import annotations

import json
from typing import Any

CHARGES = "/v1/charges"
CHARGE: dict[str, Any] = {"amount": 1000, "currency": "usd"}
CHARGE_BODY = json.dumps(CHARGE).encode()
"""``CHARGE`` as bytes on the wire, for raw-socket requests."""
