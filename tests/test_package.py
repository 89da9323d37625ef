"""The package as users get it: its wheel installed into fresh virtualenvs, one per install.

The base install (no extras) is the library: the middleware replays on SQLite, the CLI
migrates, and none of the extras' packages is there; what needs one says which, in one line,
and exits 2. With ``[server]`` the installed CLI serves a request through to an upstream and
the README's library example runs; the client helper says which extra it needs until
``[client]`` is installed; and a user project with its own ``app`` package imports
``idempotency_gateway`` (the import name never collides with it); and without redis-py
the gateway and the library run on the in-process cache and wake-ups.
Installing resolves dependencies from PyPI or pip's cache, so this takes a minute or two.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
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


def install(root: Path, requirement: str) -> Installed:
    # Outside the checkout: nothing may be imported from the source tree by accident.
    venv.create(root / "venv", with_pip=True)
    package = Installed(root)
    package.pip_install(requirement)
    return package


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dist = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--wheel-dir", dist,
        PROJECT_ROOT, cwd=dist)  # fmt: skip
    (built,) = dist.glob("*.whl")
    return built


@pytest.fixture(scope="module")
def base_install(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Installed:
    return install(tmp_path_factory.mktemp("base"), str(wheel))


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Installed:
    """The standalone gateway's install: the base and ``[server]``."""
    return install(tmp_path_factory.mktemp("server"), f"{wheel}[server]")


def refusal(installed: Installed, *argv: str, env: dict[str, str] | None = None) -> str:
    """What the installed CLI prints when it refuses with exit 2; that it is one line."""
    result = subprocess.run(
        [installed.bin / "idempotency-gateway", *argv],
        cwd=installed.root,
        env={"PATH": str(installed.bin), **(env or {})},
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
        check=False,
    )
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    return result.stderr


def test_the_base_install_has_none_of_the_extras(base_install: Installed) -> None:
    probe = (
        "import importlib.util\n"
        "for name in ('asyncpg', 'redis', 'uvicorn', 'fastapi', 'uvloop', 'httptools'):\n"
        "    print(name, importlib.util.find_spec(name) is not None)\n"
    )
    found = run(base_install.python, "-c", probe, cwd=base_install.root).split()
    assert found == [
        *("asyncpg", "False", "redis", "False", "uvicorn", "False"),
        *("fastapi", "False", "uvloop", "False", "httptools", "False"),
    ]


def test_the_middleware_replays_on_sqlite_from_the_base_install(base_install: Installed) -> None:
    program = base_install.root / "base_install_app.py"
    shutil.copyfile(PROJECT_ROOT / "tests" / "support" / "base_install_app.py", program)

    output = run(base_install.python, program, base_install.root / "library.db",
                 cwd=base_install.root)  # fmt: skip

    result = json.loads(output)
    first, retry = result["answers"]
    assert (first["status"], first["replayed"]) == (201, None)
    assert (retry["status"], retry["replayed"]) == (201, "true")
    assert retry["body"] == first["body"]
    assert result["executions"] == 1


def test_the_base_cli_prints_its_version_and_migrates_sqlite(base_install: Installed) -> None:
    cli = base_install.bin / "idempotency-gateway"
    version = run(cli, "--version", cwd=base_install.root)
    assert version.strip() == f"idempotency-gateway {idempotency_gateway.__version__}"

    database = base_install.root / "migrated.db"
    env = {"PATH": str(base_install.bin), "GATEWAY_DATABASE_URL": f"sqlite:///{database}"}
    output = run(cli, "migrate", cwd=base_install.root, env=env)
    assert "newest migration" in output
    assert database.stat().st_size > 0


@pytest.mark.parametrize("command", ["serve", "demo"])
def test_the_base_cli_names_the_server_extra(base_install: Installed, command: str) -> None:
    argv = [command, "--upstream", "http://127.0.0.1:9"] if command == "serve" else [command]

    message = refusal(base_install, *argv)

    assert message.startswith("error: the standalone gateway needs the [server] extra")
    assert "pip install 'idempotency-gateway[server]'" in message


def test_a_postgresql_url_without_its_extra_is_named(base_install: Installed) -> None:
    env = {"GATEWAY_DATABASE_URL": "postgresql://gateway@127.0.0.1:9/gateway"}

    message = refusal(base_install, "migrate", env=env)

    assert "pip install 'idempotency-gateway[postgres]'" in message


def test_a_redis_url_without_its_extra_is_named(installed: Installed) -> None:
    env = {"GATEWAY_REDIS_URL": "redis://127.0.0.1:9/0"}

    message = refusal(installed, "serve", "--upstream", "http://127.0.0.1:9", env=env)

    assert "pip install 'idempotency-gateway[redis]'" in message


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


def test_the_client_helper_names_its_extra_until_it_is_installed(
    installed: Installed, wheel: Path
) -> None:
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

    installed.pip_install(f"{wheel}[client]")

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


def test_a_gateway_without_redis_runs_without_redis_py_installed(tmp_path: Path) -> None:
    # ``sys.modules["redis"] = None`` makes every import of redis-py fail, as if it were not
    # installed; ``sys.modules`` then shows that nothing but building an adapter imports it.
    program = (
        "import sys\n"
        "sys.modules['redis'] = None\n"
        "import idempotency_gateway.replay, idempotency_gateway.replay.cache\n"
        "import idempotency_gateway.replay.redis_cache, idempotency_gateway.replay.wakeups\n"
        "from idempotency_gateway import InProcessCache, RedisCache, connect_redis\n"
        "from idempotency_gateway.config import CacheConfig\n"
        "from idempotency_gateway.main import replay_layer\n"
        "cache, wakeups = replay_layer(CacheConfig(), None)\n"
        "print(type(cache).__name__, type(wakeups).__name__)\n"
        "try:\n"
        "    connect_redis('redis://127.0.0.1:6379/0', timeout=1.0, connect_timeout=1.0)\n"
        "except ImportError:\n"
        "    print('needs-redis-py')\n"
    )

    output = run(sys.executable, "-c", program, cwd=tmp_path)

    assert output.split() == ["InProcessCache", "LocalWakeups", "needs-redis-py"]
