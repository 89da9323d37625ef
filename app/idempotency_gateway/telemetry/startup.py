"""The supervisor's first line: where the gateway listens and what it runs on."""

from __future__ import annotations

import logging
import logging.config
import re

from idempotency_gateway.telemetry.logs import LogFormat, uvicorn_log_config

log = logging.getLogger("idempotency_gateway.startup")


# The password of a URL's userinfo: ``scheme://user:PASSWORD@host...``. A pattern, not a URL
# parser, because a Redis Cluster URL lists several hosts (``h1:6379,h2:6379``), which no URL
# parser accepts, and a line that merely names the store must never stop the gateway.
_PASSWORD = re.compile(r"(?<=://)([^:/@]*):[^@/]*@")


def without_password(url: str) -> str:
    return _PASSWORD.sub(r"\1:***@", url)


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
