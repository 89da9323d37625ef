"""The servers a run starts: the upstream, the baselines, the gateway and the library apps."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from benchmarks.processes import (
    ManagedProcess,
    StartError,
    clean_environment,
    free_port,
    spawn,
    venv_tool,
    wait_until_answers,
)
from benchmarks.upstream import LARGE_BODY_BYTES, SMALL_BODY

ServerKind = Literal["upstream", "nginx-proxy", "asgi-app", "gateway", "library"]
AsgiServer = Literal["uvicorn", "granian", "edge"]
REPO = Path(__file__).resolve().parent.parent
# The same ASGI server settings the gateway's own `serve` uses (app/serve.py).
UVICORN_FAST = ("--loop", "uvloop", "--http", "httptools", "--workers", "1")
# Granian as close to that as it goes: one worker, uvloop, HTTP/1 only (httptools speaks
# nothing else), no access log, its Rust runtime on one thread as uvicorn has one loop.
GRANIAN_FAST = (
    "--interface", "asgi", "--loop", "uvloop", "--workers", "1", "--http", "1",
    "--runtime-threads", "1", "--no-access-log",
)  # fmt: skip


@dataclass(frozen=True)
class ServerSpec:
    id: str
    label: str
    kind: ServerKind
    workers: int = 1
    redis: bool = False  # gateway: GATEWAY_REDIS_URL set
    cache_max_entries: int | None = None  # gateway: `cache.max_entries` (None: default)
    max_canonical_body: int | None = None  # gateway: the route's (None: default)
    library: str = ""  # library: BENCH_LIBRARY mode
    # asgi-app: a bare ASGI app (module:attribute; BENCH_UPSTREAM_URL set) and its server
    app: str = "benchmarks.minimal_proxy:app"
    asgi_server: AsgiServer = "uvicorn"
    requires: tuple[str, ...] = ()  # modules from the `bench` extra this server imports


@dataclass
class RunContext:
    work_dir: Path
    log_dir: Path
    database_url: str
    redis_url: str | None
    nginx: str | None  # path of the nginx binary when it is used

    upstream_port: int = 0
    # What the servers under test run under (``valgrind ...`` for instruction counts) and how
    # long they may take to answer once started; the upstream never runs under it.
    launcher: tuple[str, ...] = ()
    start_timeout: float = 30.0

    @property
    def upstream_url(self) -> str:
        return f"http://127.0.0.1:{self.upstream_port}"


@dataclass
class RunningServer:
    spec: ServerSpec
    process: ManagedProcess
    port: int
    admin_port: int | None = None  # a gateway's

    def stop(self) -> None:
        self.process.stop()


def missing_modules(spec: ServerSpec) -> list[str]:
    """What this server imports from the `bench` extra and this environment lacks."""
    return [name for name in spec.requires if importlib.util.find_spec(name) is None]


def find_nginx() -> str | None:
    return shutil.which("nginx") or next(
        (path for path in ("/usr/sbin/nginx", "/usr/local/sbin/nginx") if os.path.exists(path)),
        None,
    )


def _nginx_common(prefix: Path) -> str:
    temp = "\n".join(
        f"    {name}_temp_path {prefix}/{name};"
        for name in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return f"""worker_processes 1;
daemon off;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    keepalive_requests 1000000;
    keepalive_timeout 75s;
    sendfile on;
    tcp_nodelay on;
{temp}
"""


def _nginx_upstream_conf(prefix: Path, port: int) -> str:
    (prefix / "www").mkdir(exist_ok=True)
    (prefix / "www" / "large").write_bytes(b"x" * LARGE_BODY_BYTES)
    small = SMALL_BODY.decode()
    return (
        _nginx_common(prefix)
        + f"""    server {{
        listen 127.0.0.1:{port} backlog=4096;
        client_max_body_size 16m;
        client_body_buffer_size 256k;
        location = /small {{ default_type application/json; return 200 '{small}'; }}
        location = /upload {{ default_type application/json; return 200 '{small}'; }}
        location = /large {{ root {prefix}/www; default_type application/octet-stream; }}
    }}
}}
"""
    )


def _nginx_proxy_conf(prefix: Path, port: int, upstream_port: int) -> str:
    return (
        _nginx_common(prefix)
        + f"""    upstream backend {{ server 127.0.0.1:{upstream_port}; keepalive 128; }}
    server {{
        listen 127.0.0.1:{port} backlog=4096;
        client_max_body_size 16m;
        client_body_buffer_size 256k;
        location / {{
            proxy_pass http://backend;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_buffer_size 64k;
            proxy_buffers 4 64k;
            proxy_busy_buffers_size 128k;
            proxy_request_buffering off;
        }}
    }}
}}
"""
    )


def _start_nginx(name: str, ctx: RunContext, conf_text_for: str, port: int) -> ManagedProcess:
    assert ctx.nginx is not None
    prefix = ctx.work_dir / name
    prefix.mkdir(exist_ok=True)
    # Workers drop to an unprivileged user when nginx runs as root: let them read the files.
    prefix.chmod(0o755)
    ctx.work_dir.chmod(0o755)
    conf = prefix / "nginx.conf"
    conf.write_text(conf_text_for)
    argv = [ctx.nginx, "-p", str(prefix), "-e", str(prefix / "error.log"), "-c", str(conf)]
    return spawn(name, argv, log_dir=ctx.log_dir, env=clean_environment(), ports=(port,))


def start_upstream(ctx: RunContext, *, use_nginx: bool) -> ManagedProcess:
    port = free_port()
    ctx.upstream_port = port
    if use_nginx:
        prefix = ctx.work_dir / "upstream"
        prefix.mkdir(exist_ok=True)
        process = _start_nginx("upstream", ctx, _nginx_upstream_conf(prefix, port), port)
    else:
        argv = [sys.executable, "-m", "benchmarks.upstream", "--port", str(port)]
        process = spawn(
            "upstream", argv, log_dir=ctx.log_dir, env=clean_environment(), cwd=REPO, ports=(port,)
        )
    wait_until_answers(process, port, "/small")
    return process


def _gateway_config(ctx: RunContext, spec: ServerSpec) -> Path:
    cache = canonical = ""
    if spec.cache_max_entries is not None:
        cache = f"cache: {{max_entries: {spec.cache_max_entries}}}\n"
    if spec.max_canonical_body is not None:
        canonical = f", max_canonical_body: {spec.max_canonical_body}"
    text = f"""# written by benchmarks/servers.py for {spec.id}
upstreams:
  bench:
    url: {ctx.upstream_url}
    pool: {{max_connections: 100}}
routes:
  - name: bench
    match: {{path_prefix: /}}
    upstream: bench
    idempotency: {{key: optional, methods: [POST, PATCH], max_stored_body: 1MiB{canonical}}}
limits: {{max_request_body: 10MiB}}
{cache}"""
    path = ctx.work_dir / f"{spec.id}.yaml"
    path.write_text(text)
    return path


def _asgi_argv(server: AsgiServer, app: str, port: int) -> list[str]:
    if server == "granian":
        return [
            venv_tool("granian"), *GRANIAN_FAST,
            "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning", app,
        ]  # fmt: skip
    if server == "edge":
        return [sys.executable, "-m", "benchmarks.edge_server", app, "--port", str(port)]
    return [
        venv_tool("uvicorn"), app, *UVICORN_FAST,
        "--port", str(port), "--log-level", "warning", "--no-access-log",
    ]  # fmt: skip


def start_server(spec: ServerSpec, ctx: RunContext) -> RunningServer:
    port = free_port()
    if spec.kind == "nginx-proxy":
        if ctx.nginx is None:
            raise StartError("nginx is not installed")
        prefix = ctx.work_dir / spec.id
        prefix.mkdir(exist_ok=True)
        process = _start_nginx(
            spec.id, ctx, _nginx_proxy_conf(prefix, port, ctx.upstream_port), port
        )
        wait_until_answers(process, port, "/small")
    elif spec.kind == "asgi-app":
        env = clean_environment({"BENCH_UPSTREAM_URL": ctx.upstream_url})
        argv = [*ctx.launcher, *_asgi_argv(spec.asgi_server, spec.app, port)]
        process = spawn(spec.id, argv, log_dir=ctx.log_dir, env=env, cwd=REPO, ports=(port,))
        wait_until_answers(process, port, "/small", timeout=ctx.start_timeout)
    elif spec.kind == "gateway":
        admin_port = free_port()
        variables = {
            "GATEWAY_DATABASE_URL": ctx.database_url,
            "GATEWAY_SCOPE_SECRET": "benchmark-scope-secret",
        }
        if spec.redis:
            assert ctx.redis_url is not None
            variables["GATEWAY_REDIS_URL"] = ctx.redis_url
        argv = [
            *ctx.launcher, venv_tool("idempotency-gateway"), "serve",
            "--config", str(_gateway_config(ctx, spec)),
            "--port", str(port), "--admin-port", str(admin_port),
            # The default log level: the access line an operator keeps on is part of the cost.
            "--workers", str(spec.workers), "--log-format", "json",
        ]  # fmt: skip
        process = spawn(
            spec.id,
            argv,
            log_dir=ctx.log_dir,
            env=clean_environment(variables),
            cwd=ctx.work_dir,
            ports=(port, admin_port),
        )
        wait_until_answers(process, admin_port, "/readyz", timeout=ctx.start_timeout)
        wait_until_answers(process, port, "/small", timeout=ctx.start_timeout)
        return RunningServer(spec, process, port, admin_port)
    elif spec.kind == "library":
        variables = {"BENCH_LIBRARY": spec.library, "BENCH_DATABASE_URL": ctx.database_url}
        if ctx.redis_url is not None:
            variables["BENCH_REDIS_URL"] = ctx.redis_url
        argv = [*ctx.launcher, *_asgi_argv("uvicorn", "benchmarks.library_app:api", port)]
        process = spawn(
            spec.id,
            argv,
            log_dir=ctx.log_dir,
            env=clean_environment(variables),
            cwd=REPO,
            ports=(port,),
        )
        wait_until_answers(process, port, "/openapi.json", timeout=ctx.start_timeout)
    else:
        raise ValueError(f"not a server kind that start_server starts: {spec.kind}")
    return RunningServer(spec, process, port)
