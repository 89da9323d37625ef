"""The supervisor's first line: where the gateway listens and what it runs on."""

from __future__ import annotations

import logging
import logging.config

from sqlalchemy.engine import make_url

from idempotency_gateway.telemetry.logs import LogFormat, uvicorn_log_config

log = logging.getLogger("idempotency_gateway.startup")


def without_password(url: str) -> str:
    return make_url(url).render_as_string(hide_password=True)


def log_startup(
    *,
    log_level: str,
    log_format: LogFormat,
    host: str,
    port: int,
    admin_port: int,
    workers: int,
    database_url: str,
    redis_url: str | None,
    routes: int,
) -> None:
    """One line an operator can check a deployment against; passwords shown as ``***``."""
    # uvicorn configures logging only when it starts; this line comes first.
    logging.config.dictConfig(uvicorn_log_config(log_level, log_format))
    store = without_password(database_url)
    cache = f"redis {without_password(redis_url)}" if redis_url else "in-process"
    log.info(
        "starting: proxy on %s:%d, admin on %s:%d, %d worker(s), store %s, cache %s, %d routes",
        host,
        port,
        host,
        admin_port,
        workers,
        store,
        cache,
        routes,
        extra={
            "port": port,
            "admin_port": admin_port,
            "workers": workers,
            "store": store,
            "cache": cache,
            "routes": routes,
        },
    )
