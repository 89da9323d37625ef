"""The per-deployment secret that keys scope hashes (``GATEWAY_SCOPE_SECRET``).

Scopes are HMAC-SHA256 of the client's credential headers: without the secret, a stored scope
cannot be checked against guessed credentials. Every gateway sharing a database must use the
same secret, or their clients' keys stop matching. The embedded SQLite store is one machine's
gateway, so it creates a secret once and keeps it beside the database file; with any other
database there is no safe place to invent one, and the gateway refuses to start.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

from pydantic import SecretStr

from idempotency_gateway.config import ConfigError
from idempotency_gateway.database_url import backend_of, sqlite_path

SCOPE_SECRET_ENV = "GATEWAY_SCOPE_SECRET"
SECRET_FILE_SUFFIX = ".scope-secret"
_GENERATED_BYTES = 32


def resolve_scope_secret(secret: SecretStr | None, database_url: str) -> bytes:
    """The secret to key scopes with: the configured one, else the embedded store's own."""
    if secret is not None:
        value = secret.get_secret_value()
        if not value:
            raise ConfigError("environment", [f"{SCOPE_SECRET_ENV} is set but empty"])
        return value.encode()
    if backend_of(database_url) != "sqlite":
        raise ConfigError(
            "environment",
            [
                f"{SCOPE_SECRET_ENV} is not set: with a shared database every gateway must "
                "hash client scopes with the same secret (for example the output of "
                "`openssl rand -hex 32`)"
            ],
        )
    database = sqlite_path(database_url)
    if database == ":memory:":
        # A memory database dies with the process, and its records with it.
        return secrets.token_bytes(_GENERATED_BYTES)
    return embedded_secret(Path(database + SECRET_FILE_SUFFIX))


def embedded_secret(path: Path) -> bytes:
    """The secret stored at ``path``, created (mode 0600) by whichever process comes first.

    The new secret is written to a private temporary file and hard-linked into place: the
    link either appears complete or fails because another worker won, so every worker of
    one gateway ends up reading the same bytes.
    """
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
        descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(descriptor, "wb") as file:
                file.write(secrets.token_hex(_GENERATED_BYTES).encode())
                file.flush()
                os.fsync(file.fileno())
            with contextlib.suppress(FileExistsError):
                os.link(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
    value = path.read_bytes().strip()
    if not value:
        raise ConfigError(str(path), ["the scope secret file is empty; delete it or fill it"])
    return value
