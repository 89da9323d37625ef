"""``idempotency-gateway``: serve, demo, migrate, sweep, check-config."""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from idempotency_gateway.config import (
    ConfigError,
    EnvSettings,
    GatewayConfig,
    StoreConfig,
    check_admin_token,
    database_url_or_default,
    dump_config,
    environment_settings,
    load_config,
    single_upstream_config,
)
from idempotency_gateway.extras import (
    MissingExtra,
    require_database_driver,
    require_redis,
    require_server,
)
from idempotency_gateway.routing import check_routes
from idempotency_gateway.server.listeners import ListenError, bind_listeners
from idempotency_gateway.telemetry.multiprocess import MULTIPROCESS_ENV, prepare_metrics_directory
from idempotency_gateway.telemetry.startup import log_startup

# Everything else is imported by the command that needs it: `serve --workers N` must set the
# metrics directory before prometheus_client is imported anywhere in this process.


_WHOLE_NUMBER = re.compile(r"\s*[+-]?[0-9]{1,9}\s*", re.ASCII)


def _port(text: str) -> int:
    """A TCP port, or 0 for one the system picks (the startup line names it); refused here,
    by name, before anything starts."""
    port = _integer(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port: give 0 to 65535")
    return port


def _demo_port(text: str) -> int:
    """The demo prints commands that name its ports, so it needs ports known in advance."""
    port = _port(text)
    if port == 0:
        raise argparse.ArgumentTypeError("the demo needs a fixed port: give 1 to 65535")
    return port


def _positive(text: str) -> int:
    count = _integer(text)
    if count < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive whole number")
    return count


def _integer(text: str) -> int:
    # ASCII digits only, as the environment's settings take them: int() alone would also take
    # other scripts' digits and underscores.
    if not _WHOLE_NUMBER.fullmatch(text):
        raise argparse.ArgumentTypeError(f"{text[:20]!r} is not a whole number")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    from idempotency_gateway import __version__

    parser = argparse.ArgumentParser(
        prog="idempotency-gateway",
        description="An idempotency gateway: retried requests never execute twice.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", type=Path, help="YAML config file (or GATEWAY_CONFIG)")
    serve.add_argument("--upstream", help="proxy everything to this URL with default policies")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=_port, default=8080)
    serve.add_argument(
        "--admin-port", type=_port, default=None, help="health, metrics, admin API (default 8081)"
    )
    serve.add_argument("--workers", type=_positive, default=1)
    serve.add_argument("--log-level", default="info")
    serve.add_argument(
        "--log-format",
        choices=["auto", "json", "text"],
        default="auto",
        help="auto: text on a terminal, JSON lines otherwise",
    )

    demo = commands.add_parser("demo", help="embedded store + an example payments API")
    demo.add_argument("--port", type=_demo_port, default=8080)
    demo.add_argument("--upstream-port", type=_demo_port, default=9000)

    migrate = commands.add_parser(
        "migrate", help="upgrade the database schema (GATEWAY_DATABASE_URL)"
    )
    migrate.add_argument(
        "--wait", type=float, default=0, help="seconds to wait for the database to accept"
    )

    sweep = commands.add_parser("sweep", help="delete expired records now")
    sweep.add_argument("--batch-size", type=_positive, default=1000)

    check = commands.add_parser("check-config", help="validate a config file and print it")
    check.add_argument("file", type=Path)
    return parser


def _resolve_config(args: argparse.Namespace, settings: EnvSettings) -> GatewayConfig:
    config_path = args.config or settings.config
    if config_path is not None and args.upstream:
        raise ConfigError("command line", ["give either --config or --upstream, not both"])
    if args.upstream:
        return single_upstream_config(args.upstream)
    if config_path is None:
        raise ConfigError(
            "command line", ["no upstream: give --upstream URL, --config FILE or GATEWAY_CONFIG"]
        )
    return _checked(load_config(Path(config_path)), source=str(config_path))


def _checked(config: GatewayConfig, *, source: str) -> GatewayConfig:
    """What a valid file can still get wrong between its entries: routes that collide."""
    check_routes(config.routes, source=source)
    return config


def _servable(config: GatewayConfig) -> GatewayConfig:
    """``config``, once every webhook secret it names is in the environment: checked here, at
    start and on each reload, so a missing one is refused once, never first in a worker."""
    from idempotency_gateway.idempotency.webhooks import check_webhook_secrets

    check_webhook_secrets(config.routes)
    return config


def _serve(args: argparse.Namespace) -> int:
    require_server()
    settings = environment_settings()
    config = _resolve_config(args, settings)
    metrics_directory = None
    # One worker or many, the same metrics: every worker writes to the directory.
    if MULTIPROCESS_ENV not in os.environ:
        metrics_directory = prepare_metrics_directory()
    # The drain marker lives as long as this supervisor: a new `serve` starts ready.
    drain_directory = tempfile.mkdtemp(prefix="idempotency-gateway-drain-")
    try:
        return _run_server(args, settings, config, Path(drain_directory) / "draining")
    finally:
        shutil.rmtree(drain_directory, ignore_errors=True)
        if metrics_directory is not None:
            shutil.rmtree(metrics_directory, ignore_errors=True)


def _run_server(
    args: argparse.Namespace, settings: EnvSettings, config: GatewayConfig, drain_marker: Path
) -> int:
    from idempotency_gateway.drain import DRAIN_MARKER_ENV, DrainState
    from idempotency_gateway.idempotency.scope_secret import resolve_scope_secret
    from idempotency_gateway.migrate import upgrade_to_head
    from idempotency_gateway.serve import serve

    admin_port = args.admin_port if args.admin_port is not None else settings.admin_port
    if admin_port == args.port != 0:
        # The second bind would fail anyway, as "address in use": this says what is wrong.
        raise ConfigError(
            "command line" if args.admin_port is not None else "GATEWAY_ADMIN_PORT",
            [f"the admin port and the proxy port are both {admin_port}: give each its own"],
        )
    database_url = database_url_or_default(settings.database_url)
    # Refuse here, with a clear message, rather than in every worker.
    require_database_driver(database_url)
    if settings.redis_url is not None:
        require_redis()
    check_admin_token(settings.admin_token)
    _servable(config)
    # Listening before the store is touched: a port in use leaves nothing created behind.
    listeners = bind_listeners(args.host, args.port, admin_port)
    resolve_scope_secret(settings.scope_secret, database_url)
    if database_url.startswith("sqlite"):
        # Migrate once here, before any worker starts, so workers never race on DDL.
        upgrade_to_head(database_url)
    os.environ["GATEWAY_ADMIN_PORT"] = str(listeners.admin_port)
    os.environ[DRAIN_MARKER_ENV] = str(drain_marker)
    log_startup(
        log_level=args.log_level,
        log_format=args.log_format,
        host=args.host,
        port=listeners.port,
        admin_port=listeners.admin_port,
        workers=args.workers,
        database_url=database_url,
        redis_url=settings.redis_url,
        routes=len(config.routes),
    )
    return serve(
        host=args.host,
        listeners=listeners,
        workers=args.workers,
        log_level=args.log_level,
        log_format=args.log_format,
        limits=config.limits,
        gateway_config=config,
        # SIGHUP reads the same source again: the file (--config or GATEWAY_CONFIG).
        reload_config=lambda: _servable(_resolve_config(args, environment_settings())),
        drain=DrainState(drain_marker),
    )


def _migrate(args: argparse.Namespace) -> int:
    from idempotency_gateway.migrate import upgrade_to_head

    url = database_url_or_default(environment_settings().database_url)
    deadline = time.monotonic() + args.wait
    while True:
        # A container starting beside its database must not fail because it came up first.
        error = asyncio.run(_database_error(url))
        if error is None:
            break
        if time.monotonic() >= deadline:
            print(f"error: the database does not answer: {error}", file=sys.stderr)
            return 1
        time.sleep(1)
    upgrade_to_head(url)
    print(f"schema is at the newest migration on {url.split('@')[-1]}")
    return 0


async def _database_error(url: str) -> str | None:
    from idempotency_gateway.errors import StoreUnavailable
    from idempotency_gateway.storage import open_store

    store = open_store(url, StoreConfig())
    try:
        await store.ping()
    except StoreUnavailable as exc:
        return str(exc)
    finally:
        await store.close()
    return None


def _sweep(args: argparse.Namespace) -> int:
    from idempotency_gateway.errors import StoreUnavailable
    from idempotency_gateway.storage import open_store

    async def sweep_all() -> int | None:
        url = database_url_or_default(environment_settings().database_url)
        store = open_store(url, StoreConfig())
        try:
            return await store.sweep(batch_size=args.batch_size)
        finally:
            await store.close()

    try:
        deleted = asyncio.run(sweep_all())
    except StoreUnavailable as exc:
        print(f"error: the database does not answer: {exc}", file=sys.stderr)
        return 1
    if deleted is None:
        print("another sweeper is running; nothing done")
        return 0
    print(f"deleted {deleted} expired records")
    return 0


def _check_config(args: argparse.Namespace) -> int:
    config = _checked(load_config(args.file), source=str(args.file))
    print(dump_config(config), end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "demo":
            require_server()
            from idempotency_gateway.demo.run import run_demo

            return run_demo(port=args.port, upstream_port=args.upstream_port)
        if args.command == "migrate":
            return _migrate(args)
        if args.command == "sweep":
            return _sweep(args)
        return _check_config(args)
    except ConfigError as exc:
        print(f"error: invalid configuration in {exc.source}:", file=sys.stderr)
        for line in exc.errors:
            print(f"  - {line}", file=sys.stderr)
        return 2
    except MissingExtra as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ListenError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
