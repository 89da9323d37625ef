"""Scopes are keyed by the deployment's secret, and keyed requests may be made to need one.

The embedded store keeps a secret it made itself (0600, beside the database, the same for
every worker that races to create it) so a restart keeps deduping; a gateway on PostgreSQL
without ``GATEWAY_SCOPE_SECRET`` refuses to start and names the variable; a route with
``anonymous: refuse`` answers a keyed request without a credential with a 401 problem and
sends nothing upstream.
"""

from __future__ import annotations

import asyncio
import os
import stat
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from idempotency_gateway.config import ConfigError
from idempotency_gateway.idempotency.scope_secret import (
    SCOPE_SECRET_ENV,
    SECRET_FILE_SUFFIX,
    resolve_scope_secret,
)
from idempotency_gateway.main import create_gateway
from tests.support import RecordingUpstream, serve_asgi, write_config
from tests.support.charges import CHARGE, CHARGES
from tests.support.gateway import CLI_SERVER_OPTIONS, GatewayLauncher, gateway_config, route
from tests.support.keyed import AUTHORIZATION, is_replay, send_keyed
from tests.support.problems import assert_problem
from tests.support.servers import PROJECT_ROOT
from tests.support.upstream import KEY_HEADER

pytestmark = pytest.mark.slow

CREATORS = 8


def test_a_configured_secret_wins_over_everything() -> None:
    secret = resolve_scope_secret(SecretStr("s3cret"), "postgresql+asyncpg://db/x")
    assert secret == b"s3cret"


def test_postgres_without_a_secret_is_refused_naming_the_variable() -> None:
    with pytest.raises(ConfigError, match=SCOPE_SECRET_ENV):
        resolve_scope_secret(None, "postgresql+asyncpg://postgres@127.0.0.1/db")
    with pytest.raises(ConfigError, match="empty"):
        resolve_scope_secret(SecretStr(""), "sqlite:///x.db")


def test_the_embedded_store_makes_a_private_secret_once_and_keeps_it(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/gateway.db"

    first = resolve_scope_secret(None, url)
    again = resolve_scope_secret(None, url)

    path = tmp_path / ("gateway.db" + SECRET_FILE_SUFFIX)
    assert first == again == path.read_bytes()
    assert len(first) == 64
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert list(tmp_path.iterdir()) == [path]  # no temporary file left behind


async def test_workers_racing_to_create_the_secret_all_read_the_same_one(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path}/gateway.db"
    program = (
        "import sys\n"
        "from idempotency_gateway.idempotency.scope_secret import resolve_scope_secret\n"
        "sys.stdout.write(resolve_scope_secret(None, sys.argv[1]).decode())\n"
    )
    processes = [
        await asyncio.create_subprocess_exec(
            sys.executable, "-c", program, url, stdout=asyncio.subprocess.PIPE
        )
        for _ in range(CREATORS)
    ]
    outputs = [(await process.communicate())[0] for process in processes]

    assert all(process.returncode == 0 for process in processes)
    assert len(set(outputs)) == 1
    assert outputs[0] == (tmp_path / ("gateway.db" + SECRET_FILE_SUFFIX)).read_bytes()


async def test_serve_on_postgres_without_a_secret_exits_with_a_clear_message(
    tmp_path: Path, postgres_url: str
) -> None:
    config = write_config(tmp_path, {"upstreams": {"a": {"url": "http://127.0.0.1:9"}},
                                     "routes": [route("/", upstream="a")]})  # fmt: skip
    environment = {k: v for k, v in os.environ.items() if k != SCOPE_SECRET_ENV}
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "idempotency_gateway.cli", "serve", "--config", str(config),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
        env={**environment, "GATEWAY_DATABASE_URL": postgres_url}, cwd=PROJECT_ROOT,
    )  # fmt: skip
    output, _ = await asyncio.wait_for(process.communicate(), 60.0)

    assert process.returncode == 2
    assert f"{SCOPE_SECRET_ENV} is not set" in output.decode()


async def test_the_embedded_store_keeps_deduping_across_a_restart(
    tmp_path: Path, upstream: RecordingUpstream
) -> None:
    config = gateway_config(upstream.url, routes=[route("/", key="required")])
    url = f"sqlite:///{tmp_path}/gateway.db"
    answers: list[httpx.Response] = []
    for _ in range(2):
        gateway = create_gateway(config, database_url=url)
        async with (
            serve_asgi(gateway, **CLI_SERVER_OPTIONS) as base,
            httpx.AsyncClient(base_url=base, trust_env=False) as client,
        ):
            answers.append(await send_keyed(client, "restart-1"))

    first, after_restart = answers
    assert first.status_code == 201
    assert is_replay(after_restart)
    assert after_restart.content == first.content
    assert upstream.count("restart-1") == 1


async def test_a_route_refusing_anonymous_keyed_requests_answers_401_and_sends_nothing(
    upstream: RecordingUpstream, postgres_url: str, unique: Callable[[str], str]
) -> None:
    key = unique("anonymous")
    config = gateway_config(upstream.url, routes=[route("/", anonymous="refuse")])
    async with GatewayLauncher() as launcher:
        gateway = await launcher.start(config, database_url=postgres_url)

        refused = await gateway.client.post(CHARGES, json=CHARGE, headers={KEY_HEADER: key})
        unkeyed = await gateway.client.post(CHARGES, json=CHARGE)
        credentialed = await gateway.client.post(
            CHARGES, json=CHARGE, headers={KEY_HEADER: key, "Authorization": AUTHORIZATION}
        )

    problem = assert_problem(refused, 401, "credential-required")
    assert "authorization" in problem["detail"]
    assert unkeyed.status_code == 201
    assert credentialed.status_code == 201
    assert not is_replay(credentialed)
    assert upstream.count(key) == 1
