"""Operator actions through the admin API: what was done, to what, and from which address."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("idempotency_gateway.audit")


def log_admin_action(action: str, *, client: tuple[str, int] | None, **target: Any) -> None:
    """``client`` is the connection's peer (host, port), ``None`` when the server did not
    say; ``target`` names what was acted on (never a key, a body or a credential)."""
    source = f"{client[0]}:{client[1]}" if client else "unknown"
    fields = {"action": action, "client": source, **target}
    log.info("admin %s from %s", action, source, extra={"admin": fields})
