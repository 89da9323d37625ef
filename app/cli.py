"""``idempotency-gateway``: serve, demo, migrate, sweep, check-config."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from pathlib import Path

import uvicorn

from app.config import (
    ConfigError,
    EnvSettings,
    GatewayConfig,
    dump_config,
    load_config,
    single_upstream_config,
)
from app.main import RESOLVED_CONFIG_ENV, database_url_or_default
from app.migrate import upgrade_to_head


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="idempotency-gateway",
        description="An idempotency gateway: retried requests never execute twice.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", type=Path, help="YAML config file (or GATEWAY_CONFIG)")
    serve.add_argument("--upstream", help="proxy everything to this URL with default policies")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8080)
    serve.add_argument("--workers", type=int, default=1)
    serve.add_argument("--log-level", default="info")

    demo = commands.add_parser("demo", help="embedded store + an example payments API")
    demo.add_argument("--port", type=int, default=8080)
    demo.add_argument("--upstream-port", type=int, default=9000)

    commands.add_parser("migrate", help="upgrade the database schema (GATEWAY_DATABASE_URL)")

    sweep = commands.add_parser("sweep", help="delete expired records now")
    sweep.add_argument("--batch-size", type=int, default=1000)

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
    return load_config(Path(config_path))


def _serve(args: argparse.Namespace) -> int:
    settings = EnvSettings()
    config = _resolve_config(args, settings)
    database_url = database_url_or_default(settings.database_url)
    if database_url.startswith("sqlite"):
        # Migrate once here, before any worker starts, so workers never race on DDL.
        upgrade_to_head(database_url)
    os.environ[RESOLVED_CONFIG_ENV] = config.model_dump_json()
    uvicorn.run(
        "app.main:gateway_from_environment",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        loop="uvloop",
        http="httptools",
        lifespan="on",
        log_level=args.log_level,
        # Our own Via and request id replace the server's banner and date is added anyway.
        server_header=False,
        proxy_headers=False,
        timeout_graceful_shutdown=30,
    )
    return 0


def _migrate() -> int:
    url = database_url_or_default(EnvSettings().database_url)
    upgrade_to_head(url)
    print(f"schema is at the newest migration on {url.split('@')[-1]}")
    return 0


def _sweep(args: argparse.Namespace) -> int:
    from app.config import StoreConfig
    from app.idempotency.store import RecordStore

    async def sweep_all() -> int:
        store = RecordStore.from_url(
            database_url_or_default(EnvSettings().database_url), StoreConfig()
        )
        total = 0
        try:
            while deleted := await store.sweep(batch_size=args.batch_size):
                total += deleted
        finally:
            await store.close()
        return total

    print(f"deleted {asyncio.run(sweep_all())} expired records")
    return 0


def _check_config(args: argparse.Namespace) -> int:
    config = load_config(args.file)
    print(dump_config(config), end="")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "serve":
            return _serve(args)
        if args.command == "demo":
            from app.demo.run import run_demo

            return run_demo(port=args.port, upstream_port=args.upstream_port)
        if args.command == "migrate":
            return _migrate()
        if args.command == "sweep":
            return _sweep(args)
        return _check_config(args)
    except ConfigError as exc:
        print(f"error: invalid configuration in {exc.source}:", file=sys.stderr)
        for line in exc.errors:
            print(f"  - {line}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
