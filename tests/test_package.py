"""The package as users get it: a plain ``pip install .`` into a fresh virtualenv.

The installed CLI prints its version, migrates an SQLite file and serves one request through
to an upstream; the README's library example runs from the install; the client helper says
which extra it needs until ``[client]`` is installed; and a user project with its own ``app``
package imports ``idempotency_gateway`` (the import name never collides with it).
Installing resolves dependencies from PyPI or pip's cache, so this takes a minute.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys
import venv
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

import idempotency_gateway
from tests.support import GatewayProcess, RecordingUpstream, free_port, write_config
from tests.support.servers import PROJECT_ROOT
from tests.support.waiting import eventually

pytestmark = pytest.mark.slow

INSTALL_TIMEOUT = 600
COMMAND_TIMEOUT = 120
CHARGE = {"amount": 1000}


def run(*argv: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    """Run to completion; fail with its output when it fails."""
    result = subprocess.run(
        [str(arg) for arg in argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=INSTALL_TIMEOUT,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def readme_library_example() -> str:
    readme = (PROJECT_ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("## Using it as a library", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.DOTALL)
    assert match is not None
    return match.group(1)


async def charge_twice(client: httpx.AsyncClient, key: str) -> tuple[httpx.Response, ...]:
    """A keyed charge and its retry, one after the other."""
    headers = {"Idempotency-Key": key}
    return tuple([await client.post("/v1/charges", json=CHARGE, headers=headers) for _ in range(2)])


class Installed:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.bin = root / "venv" / "bin"

    @property
    def python(self) -> Path:
        return self.bin / "python"

    def pip_install(self, requirement: str) -> None:
        run(self.python, "-m", "pip", "install", "--quiet", requirement, cwd=self.root)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    root = tmp_path_factory.mktemp("installed")
    # Outside the checkout: nothing may be imported from the source tree by accident.
    venv.create(root / "venv", with_pip=True)
    package = Installed(root)
    package.pip_install(str(PROJECT_ROOT))
    return package


def test_the_installed_cli_prints_its_version_and_migrates_sqlite(installed: Installed) -> None:
    version = run(installed.bin / "idempotency-gateway", "--version", cwd=installed.root)
    assert version.strip() == f"idempotency-gateway {idempotency_gateway.__version__}"

    database = installed.root / "migrated.db"
    env = {"PATH": str(installed.bin), "GATEWAY_DATABASE_URL": f"sqlite:///{database}"}
    output = run(installed.bin / "idempotency-gateway", "migrate", cwd=installed.root, env=env)
    assert "newest migration" in output
    assert database.stat().st_size > 0


async def test_the_installed_cli_serves_a_request_to_an_upstream(
    installed: Installed, upstream: RecordingUpstream
) -> None:
    config = write_config(installed.root, {"upstreams": {"a": {"url": upstream.url}},
                                           "routes": [{"name": "all", "match": {"path_prefix": "/"},
                                                       "upstream": "a"}]})  # fmt: skip
    gateway = GatewayProcess(
        config,
        command=[str(installed.bin / "idempotency-gateway")],
        env={"GATEWAY_DATABASE_URL": f"sqlite:///{installed.root}/served.db"},
        cwd=installed.root,
        name="installed",
    )
    async with gateway, httpx.AsyncClient(base_url=gateway.url, trust_env=False) as client:
        answer, replay = await charge_twice(client, "installed-1")
    assert answer.status_code == 201
    assert replay.headers["idempotent-replayed"] == "true"
    assert upstream.count("installed-1") == 1


@pytest.fixture
async def readme_app(installed: Installed) -> AsyncIterator[str]:
    """The README's library example, served by the installed uvicorn."""
    (installed.root / "example.py").write_text(readme_library_example(), encoding="utf-8")
    port = free_port()
    server = await asyncio.create_subprocess_exec(
        installed.python, "-m", "uvicorn", "example:api", "--port", str(port),
        cwd=installed.root,
        env={"DATABASE_URL": f"sqlite:///{installed.root}/library.db", "SCOPE_SECRET": "s"},
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        await asyncio.wait_for(server.wait(), COMMAND_TIMEOUT)


async def test_the_readme_library_example_runs_from_the_install(readme_app: str) -> None:
    async with httpx.AsyncClient(base_url=readme_app, trust_env=False) as client:

        async def answers() -> bool:
            try:
                await client.get("/no-such-path")
            except httpx.TransportError:
                return False  # still starting
            return True

        started: bool = await eventually(answers, timeout=60.0, message="the app answers")
        assert started
        first, retry = await charge_twice(client, "readme-1")
    assert first.status_code == 200
    assert retry.headers["idempotent-replayed"] == "true"
    assert retry.content == first.content


def test_the_client_helper_names_its_extra_until_it_is_installed(installed: Installed) -> None:
    probe = "from idempotency_gateway import IdempotentClient; print(IdempotentClient.__name__)"
    missing = subprocess.run(
        [installed.python, "-c", probe],
        cwd=installed.root,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
        check=False,
    )
    assert missing.returncode != 0
    assert "ImportError" in missing.stderr
    assert "idempotency-gateway[client]" in missing.stderr

    installed.pip_install(f"{PROJECT_ROOT}[client]")

    assert run(installed.python, "-c", probe, cwd=installed.root).strip() == "IdempotentClient"


def test_a_project_with_its_own_app_package_imports_the_gateway(tmp_path: Path) -> None:
    (tmp_path / "app").mkdir()
    (tmp_path / "app" / "__init__.py").write_text("OWNER = 'user project'\n")
    (tmp_path / "app" / "idempotency.py").write_text("OWNER = 'user project'\n")
    program = (
        "import app, app.idempotency\n"
        "from idempotency_gateway import IdempotencyMiddleware, RecordStore, __version__\n"
        "print(app.OWNER, app.idempotency.OWNER, IdempotencyMiddleware.__module__)\n"
    )

    output = run(sys.executable, "-c", program, cwd=tmp_path)

    assert output.split() == [
        "user",
        "project",
        "user",
        "project",
        "idempotency_gateway.idempotency.middleware",
    ]


def test_the_public_api_resolves_every_name_and_ships_py_typed() -> None:
    for name in idempotency_gateway.__all__:
        assert getattr(idempotency_gateway, name) is not None, name
    package_dir = Path(idempotency_gateway.__file__).parent
    assert (package_dir / "py.typed").exists()
    with pytest.raises(AttributeError):
        getattr(idempotency_gateway, "NoSuchThing")  # noqa: B009 - the dynamic lookup is tested
