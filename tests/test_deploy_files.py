"""The files in deploy/ (and the Dockerfile and docker-compose.yml) fit the gateway they deploy.

No Docker engine or cluster is needed: every YAML and JSON file parses; the commands that
docker-compose.yml, the Kubernetes manifests and the Dockerfile run are ones the real CLI
parser accepts, on the ports the gateway listens on, with ``GATEWAY_*`` settings it reads, and
their probes hit health endpoints the admin app serves; the Dockerfile's ENTRYPOINT, CMD and
HEALTHCHECK run as plain processes against real PostgreSQL (``migrate`` first when
``GATEWAY_MIGRATE_ON_START=1``, then ``serve``, then the health check passes, and fails once
the gateway is gone); and the Grafana dashboard and the Prometheus alerts query only metrics
the gateway exports, with the suffixes their types give them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fnmatch
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, cast
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from prometheus_client import REGISTRY

import idempotency_gateway.telemetry.metrics
from idempotency_gateway.cli import build_parser as cli_parser
from idempotency_gateway.config import EnvSettings, GatewayConfig, load_config, validate_config
from idempotency_gateway.demo.payments import create_payments_app
from idempotency_gateway.main import DRAIN_TIMEOUT, create_gateway
from idempotency_gateway.serve import GRACEFUL_SHUTDOWN_SECONDS
from tests.support import GatewayProcess, eventually, write_config
from tests.support.servers import PROJECT_ROOT

pytestmark = pytest.mark.slow

DEPLOY = PROJECT_ROOT / "deploy"
K8S = DEPLOY / "k8s"
DOCKERFILE = PROJECT_ROOT / "Dockerfile"
COMPOSE_FILE = PROJECT_ROOT / "docker-compose.yml"
ENTRYPOINT_SCRIPT = DEPLOY / "docker-entrypoint.sh"
DASHBOARD = DEPLOY / "grafana" / "dashboard.json"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
GATEWAY_IMAGE = "idempotency-gateway"
PROXY_PORT = 8080
ADMIN_PORT = 8081
METRIC_TOKEN = re.compile(rf"{idempotency_gateway.telemetry.metrics.PREFIX}[a-z_]+")
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
YAML_FILES = sorted(
    path
    for path in [COMPOSE_FILE, *DEPLOY.rglob("*.yml"), *DEPLOY.rglob("*.yaml")]
    if path.is_file()
)


# ------------------------------------------------------------------------------ helpers


def load_documents(path: Path) -> list[Any]:
    """Every YAML document in ``path`` (empty ones dropped)."""
    with path.open(encoding="utf-8") as stream:
        return [document for document in yaml.safe_load_all(stream) if document is not None]


def load_yaml(path: Path) -> Any:
    (document,) = load_documents(path)
    return document


def parse_cli(argv: list[str]) -> argparse.Namespace:
    """``argv`` as the real ``idempotency-gateway`` parser reads it; a rejection fails."""
    try:
        return cli_parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"idempotency-gateway rejects {argv!r} (exit {exc.code})") from None


def settings_the_gateway_reads() -> set[str]:
    prefix = EnvSettings.model_config["env_prefix"]
    return {f"{prefix}{name}".upper() for name in EnvSettings.model_fields}


def settings_the_entrypoint_reads() -> set[str]:
    return set(re.findall(r"\$\{(GATEWAY_[A-Z_]+)", ENTRYPOINT_SCRIPT.read_text()))


@functools.cache
def admin_paths() -> set[str]:
    """Paths the admin listener serves, from the admin app the gateway really builds (its
    OpenAPI document, which lists every route of its routers: FastAPI keeps included routers
    whole, so ``app.routes`` no longer lists their paths)."""
    config = validate_config(
        {
            "upstreams": {"any": {"url": "http://127.0.0.1:9"}},
            "routes": [{"name": "all", "match": {"path_prefix": "/"}, "upstream": "any"}],
        },
        source="test",
    )
    gateway = create_gateway(config, database_url="sqlite:///:memory:")
    paths: dict[str, object] = gateway.admin.openapi()["paths"]
    return set(paths)


def payments_paths() -> set[str]:
    return {getattr(route, "path", "") for route in create_payments_app().routes}


def option_value(argv: list[str], option: str) -> str:
    index = argv.index(option)
    return argv[index + 1]


# --------------------------------------------------------------------------- Dockerfile


@dataclass(frozen=True)
class Instruction:
    keyword: str
    arguments: str


def dockerfile_stages() -> list[list[Instruction]]:
    """The Dockerfile's instructions (continuations joined, comments dropped), per stage."""
    logical: list[str] = []
    current = ""
    for raw in DOCKERFILE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if line.endswith("\\"):
            current += line[:-1] + " "
            continue
        logical.append(current + line)
        current = ""
    assert not current, "the Dockerfile ends inside a line continuation"
    stages: list[list[Instruction]] = []
    for line in logical:
        keyword, _, arguments = line.partition(" ")
        instruction = Instruction(keyword.upper(), arguments.strip())
        if instruction.keyword == "FROM":
            stages.append([])
        elif stages:
            stages[-1].append(instruction)
    return stages


def final_stage(keyword: str) -> list[Instruction]:
    return [step for step in dockerfile_stages()[-1] if step.keyword == keyword]


def exec_form(arguments: str) -> list[str]:
    """A JSON exec-form argument list (``["a", "b"]``): no shell between Docker and us."""
    value = json.loads(arguments)
    assert isinstance(value, list), f"not an exec-form list: {arguments}"
    assert all(isinstance(item, str) for item in value)
    return value


def dockerfile_cmd() -> list[str]:
    (cmd,) = final_stage("CMD")
    return exec_form(cmd.arguments)


def dockerfile_healthcheck() -> tuple[dict[str, str], list[str]]:
    (healthcheck,) = final_stage("HEALTHCHECK")
    match = re.fullmatch(r"((?:--[a-z-]+=\S+\s+)*)CMD\s+(\[.*\])", healthcheck.arguments)
    assert match is not None, f"HEALTHCHECK is not `[--options] CMD [exec form]`: {healthcheck}"
    options = dict(option.removeprefix("--").split("=", 1) for option in match[1].split())
    return options, exec_form(match[2])


def copied_files() -> dict[str, str]:
    """The final stage's ``COPY`` (from the build context): destination -> source."""
    copies: dict[str, str] = {}
    for step in final_stage("COPY"):
        words = step.arguments.split()
        if any(word.startswith("--from") for word in words):
            continue
        source, destination = [word for word in words if not word.startswith("--")]
        copies[destination] = source
    return copies


def dockerignore_excludes(path: str) -> bool:
    patterns = [
        line.strip()
        for line in (PROJECT_ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    parts = PurePosixPath(path.rstrip("/")).parts
    prefixes = ["/".join(parts[: index + 1]) for index in range(len(parts))]
    return any(
        fnmatch.fnmatch(prefix, pattern.removeprefix("**/")) or fnmatch.fnmatch(prefix, pattern)
        for pattern in patterns
        for prefix in prefixes
    )


def test_dockerfile_is_multi_stage_on_python_slim_and_runs_as_a_numeric_non_root_user() -> None:
    stages = dockerfile_stages()
    assert len(stages) >= 2
    text = DOCKERFILE.read_text()
    assert "ARG PYTHON_IMAGE=python:3.11-slim" in text
    assert re.search(r"^FROM \$\{PYTHON_IMAGE\}\s*$", text, re.MULTILINE), "final stage base"
    (user,) = final_stage("USER")
    uid, _, gid = user.arguments.partition(":")
    assert uid.isdigit(), "a numeric uid lets Kubernetes check runAsNonRoot"
    assert int(uid) != 0
    assert gid.isdigit()
    assert int(gid) != 0
    copies_from_builder = [s for s in final_stage("COPY") if "--from=builder" in s.arguments]
    assert [s.arguments.split()[-1] for s in copies_from_builder] == ["/opt/venv"]


def test_dockerfile_builds_from_files_that_exist_and_are_in_the_build_context() -> None:
    sources = [
        word
        for stage in dockerfile_stages()
        for step in stage
        if step.keyword == "COPY" and "--from" not in step.arguments
        for word in step.arguments.split()[:-1]
        if not word.startswith("--")
    ]
    assert {"pyproject.toml", "app/", "migrations/"} <= set(sources)
    for source in sources:
        assert (PROJECT_ROOT / source).exists(), f"COPY {source}: no such file"
        assert not dockerignore_excludes(source), f"COPY {source}: excluded by .dockerignore"
    for kept_out in (".git", ".venv", "tests", "idempotency-gateway.db", "app/__pycache__"):
        assert dockerignore_excludes(kept_out), f"{kept_out} should stay out of the context"


def test_dockerfile_exposes_both_ports_and_its_cmd_serves_them_with_the_copied_config() -> None:
    (expose,) = final_stage("EXPOSE")
    assert expose.arguments.split() == [str(PROXY_PORT), str(ADMIN_PORT)]
    cmd = dockerfile_cmd()
    args = parse_cli(cmd)
    assert args.command == "serve"
    assert (args.host, args.port, args.admin_port) == ("0.0.0.0", PROXY_PORT, ADMIN_PORT)
    default_config = copied_files()[str(args.config)]
    assert isinstance(load_config(PROJECT_ROOT / default_config), GatewayConfig)


def test_dockerfile_entrypoint_is_the_copied_script_that_execs_the_console_script() -> None:
    (entrypoint,) = final_stage("ENTRYPOINT")
    (program,) = exec_form(entrypoint.arguments)
    (destination,) = [dest for dest in copied_files() if PurePosixPath(dest).name == program]
    assert PROJECT_ROOT / copied_files()[destination] == ENTRYPOINT_SCRIPT
    assert "--chmod=0755" in next(
        step.arguments for step in final_stage("COPY") if destination in step.arguments
    )
    assert os.access(ENTRYPOINT_SCRIPT, os.X_OK)
    scripts = tomllib.loads((PROJECT_ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["idempotency-gateway"] == "idempotency_gateway.cli:main"
    assert 'exec idempotency-gateway "$@"' in ENTRYPOINT_SCRIPT.read_text()


def test_dockerfile_healthcheck_probes_healthz_on_the_admin_port() -> None:
    options, command = dockerfile_healthcheck()
    assert set(options) <= {"interval", "timeout", "start-period", "retries", "start-interval"}
    assert command[:2] == ["python", "-c"]
    assert "/healthz" in command[2]
    assert "/healthz" in admin_paths()
    env_line = next(step for step in final_stage("ENV") if "GATEWAY_ADMIN_PORT" in step.arguments)
    assert f"GATEWAY_ADMIN_PORT={ADMIN_PORT}" in env_line.arguments


# ------------------------------------------------- the Dockerfile's commands, as processes


class EntrypointProcess(GatewayProcess):
    """``deploy/docker-entrypoint.sh`` with the Dockerfile's CMD, adapted to free loopback
    ports and a test config, exactly as Docker would start it (no shell in between)."""

    def __init__(self, config_path: Path, *, env: dict[str, str], cwd: Path) -> None:
        super().__init__(config_path, env=env, cwd=cwd, log_dir=cwd, name="entrypoint")
        self.env["GATEWAY_ADMIN_PORT"] = str(self.admin_port)

    @property
    def argv(self) -> list[str]:
        cmd = dockerfile_cmd()
        adapted = {
            "--host": self.host,
            "--port": str(self.port),
            "--admin-port": str(self.admin_port),
            "--config": str(self.config_path),
        }
        for option, value in adapted.items():
            cmd[cmd.index(option) + 1] = value
        return [str(ENTRYPOINT_SCRIPT), *cmd]


@pytest.fixture
def container_environment(monkeypatch: pytest.MonkeyPatch, postgres_url: str) -> dict[str, str]:
    """What the image's environment gives the entrypoint: the venv's bin first on PATH, the
    database URL, and no other ``GATEWAY_*`` setting leaking in from the test's shell."""
    for name in list(os.environ):
        if name.startswith("GATEWAY_"):
            monkeypatch.delenv(name)
    venv_bin = Path(sys.executable).parent
    assert (venv_bin / "idempotency-gateway").is_file(), "run the tests from the project venv"
    plain_url = postgres_url.replace("postgresql+asyncpg://", "postgresql://", 1)
    return {
        "PATH": f"{venv_bin}{os.pathsep}{os.environ.get('PATH', '')}",
        "GATEWAY_DATABASE_URL": plain_url,
    }


@pytest.fixture
def unused_upstream_config(tmp_path: Path) -> Path:
    return write_config(
        tmp_path,
        {
            "upstreams": {"payments": {"url": "http://127.0.0.1:9"}},
            "routes": [{"name": "all", "match": {"path_prefix": "/"}, "upstream": "payments"}],
        },
    )


async def run_healthcheck(env: dict[str, str]) -> int:
    """The HEALTHCHECK's exec-form command, run the way Docker runs it."""
    _, command = dockerfile_healthcheck()
    process = await asyncio.create_subprocess_exec(
        *command,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    return await asyncio.wait_for(process.wait(), 30.0)


async def healthcheck_passes(env: dict[str, str]) -> bool:
    return await run_healthcheck(env) == 0


@contextlib.asynccontextmanager
async def healthy_entrypoint(
    config_path: Path, *, env: dict[str, str], cwd: Path
) -> AsyncIterator[EntrypointProcess]:
    """The entrypoint process, yielded once /healthz on its admin port answers 200."""
    async with (
        EntrypointProcess(config_path, env=env, cwd=cwd) as gateway,
        httpx.AsyncClient(base_url=gateway.admin_url, timeout=5.0, trust_env=False) as admin,
    ):

        async def healthz_answers() -> bool:
            try:
                return (await admin.get("/healthz")).status_code == 200
            except httpx.TransportError:
                return False

        answered: bool = await eventually(
            healthz_answers, timeout=20.0, message="/healthz on the admin port"
        )
        assert answered
        yield gateway


async def test_entrypoint_migrates_before_serving_and_the_healthcheck_passes(
    tmp_path: Path, container_environment: dict[str, str], unused_upstream_config: Path
) -> None:
    env = {**container_environment, "GATEWAY_MIGRATE_ON_START": "1"}
    async with healthy_entrypoint(unused_upstream_config, env=env, cwd=tmp_path) as gateway:
        async with httpx.AsyncClient(timeout=5.0, trust_env=False) as client:
            ready = await client.get(f"{gateway.admin_url}/readyz")
        assert ready.status_code == 200, ready.text
        assert ready.json()["store"] == "ok"
        assert await run_healthcheck(gateway.env) == 0

        log = gateway.log_text()
        migrated = log.find("schema is at the newest migration")
        assert migrated != -1, f"the entrypoint did not run migrate:\n{log}"
        assert migrated < log.index("Started server process"), "migrate must finish first"
        database_name = urlsplit(env["GATEWAY_DATABASE_URL"]).path.lstrip("/")
        assert database_name in log[migrated:].splitlines()[0]

        await gateway.kill()
        assert await run_healthcheck(gateway.env) != 0, "the check must fail with no gateway"


async def test_entrypoint_serves_without_migrating_unless_asked(
    tmp_path: Path, container_environment: dict[str, str], unused_upstream_config: Path
) -> None:
    async with healthy_entrypoint(
        unused_upstream_config, env=container_environment, cwd=tmp_path
    ) as gateway:
        assert await healthcheck_passes(gateway.env)
        log = gateway.log_text()
    assert "Started server process" in log
    assert "schema is at the newest migration" not in log


# ------------------------------------------------------------------------ every YAML file


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda path: str(path.relative_to(PROJECT_ROOT)))
def test_yaml_file_parses(path: Path) -> None:
    documents = load_documents(path)
    assert documents, f"{path} holds no YAML document"
    assert all(isinstance(document, dict) for document in documents)


def test_the_deploy_files_are_all_there() -> None:
    names = {str(path.relative_to(PROJECT_ROOT)) for path in YAML_FILES}
    assert {
        "docker-compose.yml",
        "deploy/compose/gateway.yaml",
        "deploy/prometheus/prometheus.yml",
        "deploy/prometheus/alerts.yml",
        "deploy/grafana/provisioning/datasources/prometheus.yml",
        "deploy/k8s/deployment.yaml",
        "deploy/k8s/service.yaml",
        "deploy/k8s/config/gateway.yaml",
        "deploy/k8s/secret.example.yaml",
        "deploy/k8s/migrate/job.yaml",
        "deploy/k8s/migrate/kustomization.yaml",
        "deploy/k8s/image/kustomization.yaml",
        "deploy/k8s/hpa.yaml",
        "deploy/k8s/pdb.yaml",
    } <= names


# ----------------------------------------------------------------------- docker-compose.yml


def interpolate(value: str) -> str:
    """Compose's ``${NAME:-default}`` with nothing set: the defaults the file ships with."""
    return re.sub(r"\$\{([A-Z_]+)(?::?-([^}]*))?\}", lambda match: match[2] or "", value)


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return cast("dict[str, Any]", load_yaml(COMPOSE_FILE))


def service(compose: dict[str, Any], name: str) -> dict[str, Any]:
    return cast("dict[str, Any]", compose["services"][name])


def environment(definition: dict[str, Any]) -> dict[str, str]:
    return {key: interpolate(str(value)) for key, value in definition["environment"].items()}


def gateway_image_services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {
        name: definition
        for name, definition in compose["services"].items()
        if str(definition.get("image", "")).startswith(f"{GATEWAY_IMAGE}:")
    }


def volume_source(definition: dict[str, Any], target: str) -> Path:
    for volume in definition["volumes"]:
        source, _, rest = volume.partition(":")
        if rest.split(":")[0] == target:
            return (PROJECT_ROOT / str(source)).resolve()
    raise AssertionError(f"nothing is mounted at {target}")


def test_compose_builds_the_gateway_image_for_migrate_payments_and_gateway(
    compose: dict[str, Any],
) -> None:
    services = gateway_image_services(compose)
    assert set(services) == {"migrate", "payments", "gateway"}
    for definition in services.values():
        assert definition["build"]["context"] == "."


def test_compose_commands_are_ones_the_cli_accepts(compose: dict[str, Any]) -> None:
    commands = {
        name: parse_cli(definition.get("command") or dockerfile_cmd())
        for name, definition in gateway_image_services(compose).items()
        if "entrypoint" not in definition
    }
    assert set(commands) == {"migrate", "gateway"}
    assert commands["migrate"].command == "migrate"
    assert commands["migrate"].wait == 60
    gateway = commands["gateway"]
    assert gateway.command == "serve"
    assert (gateway.host, gateway.port, gateway.admin_port) == ("0.0.0.0", PROXY_PORT, ADMIN_PORT)


def test_compose_gateway_config_is_mounted_valid_and_names_compose_services(
    compose: dict[str, Any],
) -> None:
    definition = service(compose, "gateway")
    config_path = parse_cli(definition["command"]).config
    config = load_config(volume_source(definition, str(config_path)))
    for upstream in config.upstreams.values():
        host = urlsplit(upstream.base_url).hostname
        assert host in compose["services"], f"upstream host {host} is no compose service"


def test_compose_payments_runs_the_bundled_upstream_on_the_port_the_gateway_calls(
    compose: dict[str, Any],
) -> None:
    definition = service(compose, "payments")
    entrypoint = definition["entrypoint"]
    assert entrypoint[:2] == ["uvicorn", "--factory"]
    module_name, _, factory_name = entrypoint[2].partition(":")
    module = __import__(module_name, fromlist=[factory_name])
    assert getattr(module, factory_name) is create_payments_app
    port = int(option_value(entrypoint, "--port"))

    gateway = service(compose, "gateway")
    config = load_config(volume_source(gateway, str(parse_cli(gateway["command"]).config)))
    assert urlsplit(config.upstreams["payments"].base_url).port == port

    check = " ".join(definition["healthcheck"]["test"])
    match = re.search(r"http://127\.0\.0\.1:(\d+)(/[\w/]*)", check)
    assert match is not None
    assert int(match[1]) == port
    assert match[2] in payments_paths()


def test_compose_gateway_ports_publish_proxy_and_keep_admin_on_loopback(
    compose: dict[str, Any],
) -> None:
    ports = service(compose, "gateway")["ports"]
    assert f"{PROXY_PORT}:{PROXY_PORT}" in ports
    assert f"127.0.0.1:{ADMIN_PORT}:{ADMIN_PORT}" in ports


def test_compose_environment_holds_only_settings_the_gateway_reads(
    compose: dict[str, Any],
) -> None:
    known = settings_the_gateway_reads() | settings_the_entrypoint_reads()
    for name, definition in gateway_image_services(compose).items():
        for variable in definition.get("environment", {}):
            if variable.startswith("GATEWAY_"):
                assert variable in known, f"{name}: the gateway never reads {variable}"
    gateway = environment(service(compose, "gateway"))
    assert {"GATEWAY_DATABASE_URL", "GATEWAY_REDIS_URL", "GATEWAY_ADMIN_TOKEN"} <= set(gateway)
    assert gateway["GATEWAY_ADMIN_PORT"] == str(ADMIN_PORT)
    assert "dev-only" in gateway["GATEWAY_ADMIN_TOKEN"], "the default must say it is for dev"


def test_compose_env_example_names_every_variable_the_compose_file_interpolates() -> None:
    used = set(re.findall(r"\$\{([A-Z_]+)", COMPOSE_FILE.read_text()))
    example = DEPLOY / "compose" / ".env.example"
    defined = {
        line.partition("=")[0]
        for line in example.read_text().splitlines()
        if line and not line.startswith("#")
    }
    assert used == defined


def test_compose_database_and_redis_urls_point_at_the_compose_services(
    compose: dict[str, Any],
) -> None:
    postgres = environment(service(compose, "postgres"))
    database_url = urlsplit(environment(service(compose, "gateway"))["GATEWAY_DATABASE_URL"])
    assert database_url.scheme == "postgresql"
    assert (database_url.hostname, database_url.port) == ("postgres", 5432)
    assert database_url.username == postgres["POSTGRES_USER"]
    assert database_url.password == postgres["POSTGRES_PASSWORD"]
    assert database_url.path == "/" + postgres["POSTGRES_DB"]
    migrate_url = environment(service(compose, "migrate"))["GATEWAY_DATABASE_URL"]
    assert migrate_url == database_url.geturl()
    redis_url = urlsplit(environment(service(compose, "gateway"))["GATEWAY_REDIS_URL"])
    assert (redis_url.scheme, redis_url.hostname) == ("redis", "redis")


def test_compose_starts_the_gateway_after_migrate_succeeded_and_redis_is_healthy(
    compose: dict[str, Any],
) -> None:
    assert service(compose, "postgres")["image"] == "postgres:15"
    assert service(compose, "redis")["image"] == "redis:7"
    for name in ("postgres", "redis"):
        assert service(compose, name)["healthcheck"]["test"], f"{name} needs a healthcheck"
    assert service(compose, "migrate")["depends_on"] == {
        "postgres": {"condition": "service_healthy"}
    }
    assert service(compose, "gateway")["depends_on"] == {
        "migrate": {"condition": "service_completed_successfully"},
        "redis": {"condition": "service_healthy"},
        "payments": {"condition": "service_started"},
    }


def test_compose_gateway_stop_grace_outlasts_the_drain(compose: dict[str, Any]) -> None:
    gateway = service(compose, "gateway")
    grace = gateway["stop_grace_period"]
    assert grace.endswith("s")
    config = load_config(volume_source(gateway, str(parse_cli(gateway["command"]).config)))
    drain = config.lifecycle.drain_grace
    assert int(grace[:-1]) > drain + GRACEFUL_SHUTDOWN_SECONDS + DRAIN_TIMEOUT


# -------------------------------------------------------------------- Prometheus, Grafana


def test_prometheus_scrapes_the_gateway_admin_port_and_loads_the_mounted_alerts(
    compose: dict[str, Any],
) -> None:
    prometheus = service(compose, "prometheus")
    config_target = option_value(
        [part for flag in prometheus["command"] for part in flag.split("=", 1)], "--config.file"
    )
    scrape = load_yaml(volume_source(prometheus, config_target))
    (job,) = scrape["scrape_configs"]
    assert job["metrics_path"] in admin_paths()
    (target,) = [target for config in job["static_configs"] for target in config["targets"]]
    host, _, port = target.partition(":")
    assert host in compose["services"]
    assert int(port) == parse_cli(service(compose, host)["command"]).admin_port
    for rule_file in scrape["rule_files"]:
        # Prometheus reads relative rule_files from the config file's directory.
        in_container = PurePosixPath(config_target).parent / rule_file
        assert volume_source(prometheus, str(in_container)) == ALERTS.resolve()


def test_grafana_provisions_the_datasource_and_dashboard_the_json_uses(
    compose: dict[str, Any],
) -> None:
    grafana = service(compose, "grafana")
    provisioning = volume_source(grafana, "/etc/grafana/provisioning")
    (datasource,) = load_yaml(provisioning / "datasources" / "prometheus.yml")["datasources"]
    assert urlsplit(datasource["url"]).hostname in compose["services"]
    (provider,) = load_yaml(provisioning / "dashboards" / "idempotency-gateway.yml")["providers"]
    dashboard_target = next(
        volume.split(":")[1] for volume in grafana["volumes"] if volume.endswith(".json:ro")
    )
    assert volume_source(grafana, dashboard_target) == DASHBOARD.resolve()
    assert str(PurePosixPath(dashboard_target).parent) == provider["options"]["path"]

    dashboard = json.loads(DASHBOARD.read_text())
    references = [
        item["datasource"]
        for panel in dashboard["panels"]
        for item in [panel, *panel.get("targets", [])]
        if "datasource" in item
    ]
    assert references
    assert all(reference["uid"] == datasource["uid"] for reference in references)


def test_dashboard_queries_name_no_scrape_job_of_their_own() -> None:
    # Scrape configs name jobs as they like (Compose, the Prometheus Operator, annotations):
    # a panel bound to one job name shows nothing under the others.
    dashboard = json.loads(DASHBOARD.read_text())
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            assert re.search(r'job="', target["expr"]) is None, panel["title"]


def test_the_docker_run_example_sets_every_variable_postgresql_requires() -> None:
    example = DOCKERFILE.read_text().partition("docker run")[2].partition("\n#\n")[0]
    assert "GATEWAY_DATABASE_URL=postgresql://" in example
    assert "GATEWAY_SCOPE_SECRET=" in example  # without it a gateway on PostgreSQL exits 2


@pytest.mark.parametrize(
    "path",
    [
        PROJECT_ROOT / "README.md",
        *sorted((PROJECT_ROOT / "docs").glob("*.md")),
        *sorted(path for path in DEPLOY.rglob("*") if path.is_file()),
        COMPOSE_FILE,
        DOCKERFILE,
    ],
    ids=lambda path: str(path.relative_to(PROJECT_ROOT)),
)
def test_source_paths_named_in_docs_and_deploy_files_exist(path: Path) -> None:
    named = re.findall(r"\bapp/[\w./]*\w", path.read_text(errors="replace"))
    missing = [name for name in named if not (PROJECT_ROOT / name).exists()]
    assert missing == []


def test_dashboard_panels_have_unique_ids_and_queries() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    graphs = [panel for panel in dashboard["panels"] if panel["type"] != "row"]
    assert len(graphs) >= 10
    for panel in graphs:
        assert panel["targets"], panel["title"]
        assert all(target["expr"].strip() for target in panel["targets"]), panel["title"]


def exported_metrics() -> dict[str, str]:
    """Series names the gateway exports (counters with ``_total``) and their types."""
    exported: dict[str, str] = {}
    for family in REGISTRY.collect():
        if family.name.startswith(idempotency_gateway.telemetry.metrics.PREFIX):
            name = f"{family.name}_total" if family.type == "counter" else family.name
            exported[name] = family.type
    return exported


def undefined_metric_names(text: str) -> set[str]:
    """Tokens that are no series of an exported metric: an unknown name, a counter without
    ``_total``, or a histogram without ``_bucket``/``_sum``/``_count``."""
    exported = exported_metrics()
    wrong: set[str] = set()
    for token in set(METRIC_TOKEN.findall(text)):
        base = next((token.removesuffix(s) for s in HISTOGRAM_SUFFIXES if token.endswith(s)), "")
        if exported.get(base) == "histogram" or exported.get(token) in {"counter", "gauge"}:
            continue
        wrong.add(token)
    return wrong


def test_metric_name_check_catches_misspelt_and_mis_suffixed_names() -> None:
    assert (
        undefined_metric_names(
            "rate(idempotency_gateway_requests_total[5m]) "
            "idempotency_gateway_store_latency_seconds_bucket idempotency_gateway_breaker_state"
        )
        == set()
    )
    assert undefined_metric_names(
        "idempotency_gateway_requests idempotency_gateway_store_latency_seconds "
        "idempotency_gateway_replays_total"
    ) == {
        "idempotency_gateway_requests",
        "idempotency_gateway_store_latency_seconds",
        "idempotency_gateway_replays_total",
    }


@pytest.mark.parametrize("path", [DASHBOARD, ALERTS], ids=lambda path: path.name)
def test_queries_use_only_metrics_the_gateway_exports(path: Path) -> None:
    text = path.read_text()
    assert len(set(METRIC_TOKEN.findall(text))) >= 5
    assert undefined_metric_names(text) == set()


def test_dashboard_shows_every_exported_metric() -> None:
    used = set(METRIC_TOKEN.findall(DASHBOARD.read_text()))
    shown = {
        next((t.removesuffix(s) for s in HISTOGRAM_SUFFIXES if t.endswith(s)), t) for t in used
    }
    assert set(exported_metrics()) - shown == set()


def test_alert_rules_are_complete_and_uniquely_named() -> None:
    (group,) = load_yaml(ALERTS)["groups"]
    names = [rule["alert"] for rule in group["rules"]]
    assert len(names) == len(set(names))
    for rule in group["rules"]:
        assert rule["expr"].strip()
        assert rule["labels"]["severity"] in {"critical", "warning", "info"}
        assert rule["annotations"]["summary"]
        assert rule["annotations"]["description"]
    covered = " ".join(rule["expr"] for rule in group["rules"])
    for metric in (
        "breaker_state",
        "store_errors_total",
        "fenced_writes_total",
        'takeovers_total{reason="abandoned"}',
        'requests_total{outcome="replayed"}',
        "retry_budget_exhausted_total",
        "upstream_attempts_total",
        "bulkhead_in_flight",
        "bulkhead_refusals_total",
    ):
        assert idempotency_gateway.telemetry.metrics.PREFIX + metric in covered, metric


# ---------------------------------------------------------------------------- Kubernetes


def rendered_kustomization(directory: Path) -> list[dict[str, Any]]:
    return list(yaml.safe_load_all(run_tool("kubectl", "kustomize", str(directory)).stdout))


@pytest.fixture(scope="module")
def k8s() -> dict[tuple[str, str], dict[str, Any]]:
    """What the README's steps apply (``kubectl apply -k deploy/k8s/migrate``, then
    ``kubectl apply -k deploy/k8s``), rendered by the real kustomize, plus the example Secret
    that the operator creates beforehand."""
    documents = [
        *rendered_kustomization(K8S / "migrate"),
        *rendered_kustomization(K8S),
        *load_documents(K8S / "secret.example.yaml"),
    ]
    objects: dict[tuple[str, str], dict[str, Any]] = {}
    for document in documents:
        assert {"apiVersion", "kind", "metadata"} <= set(document)
        key = (document["kind"], document["metadata"]["name"])
        assert key not in objects, f"{key} is defined twice"
        objects[key] = document
    return objects


def pod_spec(workload: dict[str, Any]) -> dict[str, Any]:
    template = workload["spec"]
    if workload["kind"] == "CronJob":
        template = template["jobTemplate"]["spec"]
    return cast("dict[str, Any]", template["template"]["spec"])


def the_container(workload: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod_spec(workload)["containers"]
    return cast("dict[str, Any]", container)


def deployment(k8s: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    return k8s[("Deployment", "idempotency-gateway")]


def container_env(
    k8s: dict[tuple[str, str], dict[str, Any]], container: dict[str, Any]
) -> dict[str, str]:
    """The environment a container gets from its ConfigMaps and Secrets (``envFrom``)."""
    values: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            values |= k8s[("ConfigMap", source["configMapRef"]["name"])]["data"]
        else:
            values |= k8s[("Secret", source["secretRef"]["name"])]["stringData"]
    return values


def container_port(container: dict[str, Any], port: str | int) -> int:
    if isinstance(port, int):
        return port
    (number,) = [item["containerPort"] for item in container["ports"] if item["name"] == port]
    return int(number)


def resolved_cli(
    k8s: dict[tuple[str, str], dict[str, Any]], container: dict[str, Any]
) -> argparse.Namespace:
    """The container's arguments as the CLI reads them, with ``--config`` and
    ``--admin-port`` filled in from the environment as the gateway does."""
    args = parse_cli(container["args"])
    env = container_env(k8s, container)
    if args.command == "serve":
        if args.config is None:
            args.config = Path(env["GATEWAY_CONFIG"])
        if args.admin_port is None:
            args.admin_port = int(env["GATEWAY_ADMIN_PORT"])
    return args


def test_k8s_deployment_runs_three_replicas_of_serve_on_both_ports(
    k8s: dict[tuple[str, str], dict[str, Any]],
) -> None:
    workload = deployment(k8s)
    assert workload["spec"]["replicas"] == 3
    container = the_container(workload)
    args = resolved_cli(k8s, container)
    assert args.command == "serve"
    assert args.host == "0.0.0.0"
    assert container_port(container, "http") == args.port == PROXY_PORT
    assert container_port(container, "admin") == args.admin_port == ADMIN_PORT


def test_k8s_probes_use_healthz_and_readyz_on_the_admin_port(
    k8s: dict[tuple[str, str], dict[str, Any]],
) -> None:
    container = the_container(deployment(k8s))
    admin_port = resolved_cli(k8s, container).admin_port
    probes = {
        kind: container[kind]["httpGet"]
        for kind in ("livenessProbe", "readinessProbe", "startupProbe")
    }
    assert probes["livenessProbe"]["path"] == "/healthz"
    assert probes["readinessProbe"]["path"] == "/readyz"
    assert probes["startupProbe"]["path"] == "/healthz"
    for probe in probes.values():
        assert container_port(container, probe["port"]) == admin_port
        assert probe["path"] in admin_paths()


def test_k8s_config_comes_from_the_configmap_and_is_valid(
    k8s: dict[tuple[str, str], dict[str, Any]],
) -> None:
    workload = deployment(k8s)
    container = the_container(workload)
    config_path = PurePosixPath(str(resolved_cli(k8s, container).config))
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == str(config_path.parent)]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod_spec(workload)["volumes"] if v["name"] == mount["name"]]
    configmap = k8s[("ConfigMap", volume["configMap"]["name"])]
    (item,) = [i for i in volume["configMap"]["items"] if i["path"] == config_path.name]
    config = validate_config(yaml.safe_load(configmap["data"][item["key"]]), source="k8s")
    assert config.sweeper.interval > 0


def test_k8s_environment_holds_only_settings_the_gateway_reads_and_secrets_are_placeholders(
    k8s: dict[tuple[str, str], dict[str, Any]],
) -> None:
    known = settings_the_gateway_reads()
    workloads = [
        workload
        for workload in k8s.values()
        if workload["kind"] in {"Deployment", "Job", "CronJob"}
    ]
    assert len(workloads) == 3
    for workload in workloads:
        env = container_env(k8s, the_container(workload))
        assert "GATEWAY_DATABASE_URL" in env
        assert set(env) <= known, f"{workload['metadata']['name']}: {set(env) - known}"
    secret = k8s[("Secret", "idempotency-gateway")]
    assert "data" not in secret, "an example Secret holds readable placeholders only"
    for name in ("GATEWAY_DATABASE_URL", "GATEWAY_ADMIN_TOKEN"):
        assert "REPLACE_ME" in secret["stringData"][name]
    gateway_env = container_env(k8s, the_container(deployment(k8s)))
    assert {"GATEWAY_REDIS_URL", "GATEWAY_ADMIN_TOKEN"} <= set(gateway_env)


def test_k8s_pods_run_as_the_image_user_without_privileges(
    k8s: dict[tuple[str, str], dict[str, Any]],
) -> None:
    (user,) = final_stage("USER")
    uid = int(user.arguments.partition(":")[0])
    for workload in k8s.values():
        if workload["kind"] not in {"Deployment", "Job", "CronJob"}:
            continue
        pod = pod_spec(workload)
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == uid
        container = the_container(workload)
        (image,) = load_yaml(K8S / "image" / "kustomization.yaml")["images"]
        assert container["image"] == f"{image['newName']}:{image['newTag']}"
        assert container["securityContext"]["allowPrivilegeEscalation"] is False
        assert container["securityContext"]["capabilities"]["drop"] == ["ALL"]
        assert container["resources"]["requests"]["cpu"]


def test_k8s_termination_grace_outlasts_pre_stop_and_the_drain(
    k8s: dict[tuple[str, str], dict[str, Any]],
) -> None:
    workload = deployment(k8s)
    pre_stop = the_container(workload)["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    delay = int(pre_stop[1])
    assert delay > 0, "endpoints must drop the pod before it gets SIGTERM"
    grace = pod_spec(workload)["terminationGracePeriodSeconds"]
    config = load_config(K8S / "config" / "gateway.yaml")
    drain = config.lifecycle.drain_grace
    assert grace > delay + drain + GRACEFUL_SHUTDOWN_SECONDS + DRAIN_TIMEOUT


def test_k8s_services_select_the_gateway_pods_and_name_its_ports(
    k8s: dict[tuple[str, str], dict[str, Any]],
) -> None:
    workload = deployment(k8s)
    labels = workload["spec"]["template"]["metadata"]["labels"]
    container = the_container(workload)
    ports: dict[str, int] = {}
    for (kind, _), service_object in k8s.items():
        if kind != "Service":
            continue
        assert service_object["spec"]["selector"].items() <= labels.items()
        for port in service_object["spec"]["ports"]:
            assert container_port(container, port["targetPort"]) == port["port"]
            ports[port["name"]] = port["port"]
    assert ports == {"http": PROXY_PORT, "admin": ADMIN_PORT}
    admin_service = k8s[("Service", "idempotency-gateway-admin")]
    assert admin_service["metadata"]["annotations"]["prometheus.io/path"] in admin_paths()


def test_k8s_migration_job_and_sweep_cronjob_run_cli_commands(
    k8s: dict[tuple[str, str], dict[str, Any]],
) -> None:
    migrate = resolved_cli(k8s, the_container(k8s[("Job", "idempotency-gateway-migrate")]))
    assert (migrate.command, migrate.wait) == ("migrate", 120)
    sweep = resolved_cli(k8s, the_container(k8s[("CronJob", "idempotency-gateway-sweep")]))
    assert sweep.command == "sweep"


def test_k8s_autoscaler_and_disruption_budget_target_the_deployment(
    k8s: dict[tuple[str, str], dict[str, Any]],
) -> None:
    workload = deployment(k8s)
    hpa = k8s[("HorizontalPodAutoscaler", "idempotency-gateway")]["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": workload["metadata"]["name"],
    }
    assert hpa["minReplicas"] == workload["spec"]["replicas"]
    assert [metric["resource"]["name"] for metric in hpa["metrics"]] == ["cpu"]
    pdb = k8s[("PodDisruptionBudget", "idempotency-gateway")]["spec"]
    labels = workload["spec"]["template"]["metadata"]["labels"]
    assert pdb["selector"]["matchLabels"].items() <= labels.items()
    assert pdb["maxUnavailable"] < workload["spec"]["replicas"]


def test_k8s_kustomization_lists_existing_files_but_never_the_example_secret() -> None:
    kustomization = load_yaml(K8S / "kustomization.yaml")
    resources = kustomization["resources"]
    assert "secret.example.yaml" not in resources
    for resource in resources:
        assert (K8S / resource).is_file(), resource
    assert {"deployment.yaml", "service.yaml", "sweep-cronjob.yaml"} <= set(resources)
    (image,) = load_yaml(K8S / "image" / "kustomization.yaml")["images"]
    assert image["name"] == GATEWAY_IMAGE


def test_k8s_migration_job_is_applied_on_its_own_with_the_gateways_image() -> None:
    # A Job's pod template is immutable: applied again with every release of the gateways, a
    # changed Job would be refused while the finished one exists.
    gateways = rendered_kustomization(K8S)
    (job,) = rendered_kustomization(K8S / "migrate")
    assert job["kind"] == "Job"
    assert "Job" not in {document["kind"] for document in gateways}
    images = {
        container["image"]
        for document in [*gateways, job]
        if document["kind"] in {"Deployment", "CronJob", "Job"}
        for container in pod_spec(document)["containers"]
    }
    assert len(images) == 1
    assert not images.pop().startswith(f"{GATEWAY_IMAGE}:")  # the registry's name, set once


def test_k8s_sweep_cronjob_is_applied_suspended_while_the_gateways_sweep(
    k8s: dict[tuple[str, str], dict[str, Any]],
) -> None:
    cronjob = k8s[("CronJob", "idempotency-gateway-sweep")]
    config = load_config(K8S / "config" / "gateway.yaml")
    assert cronjob["spec"]["suspend"] is (config.sweeper.interval > 0)


def config_volume_name(rendered: str) -> str:
    (workload,) = [
        document for document in yaml.safe_load_all(rendered) if document["kind"] == "Deployment"
    ]
    (volume,) = [v for v in pod_spec(workload)["volumes"] if "configMap" in v]
    return str(volume["configMap"]["name"])


def test_k8s_config_change_rolls_the_deployment_pods(tmp_path: Path) -> None:
    """A Deployment rolls its pods only when its pod template changes: the generated
    ConfigMap's name carries a hash of the config, and the template refers to that name."""
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    before = config_volume_name(run_tool("kubectl", "kustomize", str(copy)).stdout)
    config_file = copy / "config" / "gateway.yaml"
    config_file.write_text(config_file.read_text().replace("lease: 30s", "lease: 20s"))
    after = config_volume_name(run_tool("kubectl", "kustomize", str(copy)).stdout)
    assert before.startswith("idempotency-gateway-config-")
    assert after.startswith("idempotency-gateway-config-")
    assert before != after


# ------------------------------------------------------------- the tools' own validators


def tool_path(name: str) -> str:
    """``name`` from the virtualenv (PyPI tools) or PATH (Debian ones). Missing fails: CI
    must run these checks, and ``scripts/test`` installs every one of them."""
    in_venv = Path(sys.executable).parent / name
    found = str(in_venv) if in_venv.is_file() else shutil.which(name)
    if found is None:
        pytest.fail(f"{name} is not installed: run scripts/test (ensure_deploy_validators)")
    return found


def run_tool(name: str, *args: str, cwd: Path = PROJECT_ROOT) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(
        [tool_path(name), *args], cwd=cwd, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, f"{name} {' '.join(args)}:\n{result.stdout}{result.stderr}"
    return result


def test_prometheus_config_passes_promtool() -> None:
    run_tool("promtool", "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml"))


def test_alert_rules_pass_promtool_check_and_their_unit_tests() -> None:
    run_tool("promtool", "check", "rules", str(ALERTS))
    tested = run_tool("promtool", "test", "rules", "alerts.test.yml", cwd=ALERTS.parent)
    assert "SUCCESS" in tested.stdout


def test_rendered_k8s_manifests_pass_kubernetes_validate_strictly(tmp_path: Path) -> None:
    manifests = [K8S / "secret.example.yaml"]
    for name, directory in (("gateways", K8S), ("migrate", K8S / "migrate")):
        manifests.append(tmp_path / f"{name}.yaml")
        manifests[-1].write_text(run_tool("kubectl", "kustomize", str(directory)).stdout)
    for manifest in manifests:
        result = run_tool("kubernetes-validate", "--strict", str(manifest))
        assert "passed" in result.stdout + result.stderr


def test_compose_file_passes_the_compose_spec_schema_used_by_compose_v2() -> None:
    run_tool("check-jsonschema", "--builtin-schema", "vendor.compose-spec", str(COMPOSE_FILE))


def test_compose_file_passes_compose_v1_config() -> None:
    run_tool("docker-compose", "--file", str(COMPOSE_FILE), "config", "--quiet")


def test_dockerfile_passes_hadolint() -> None:
    run_tool("hadolint", str(DOCKERFILE))


def shell_scripts() -> list[Path]:
    """Every shell script of the project: ``*.sh`` files and files with a shell shebang."""
    found = []
    for folder in (PROJECT_ROOT / "scripts", DEPLOY, PROJECT_ROOT / "benchmarks"):
        for path in sorted(folder.rglob("*")):
            if not path.is_file():
                continue
            with path.open("rb") as stream:
                first_line = stream.readline()
            if path.suffix == ".sh" or re.match(rb"#!.*\b(ba)?sh\b", first_line):
                found.append(path)
    return found


def test_every_shell_script_passes_shellcheck() -> None:
    scripts = shell_scripts()
    assert {PROJECT_ROOT / "scripts" / "test", ENTRYPOINT_SCRIPT} <= set(scripts)
    run_tool("shellcheck", "--external-sources", *map(str, scripts))
