"""A small module of a subpackage loads without what the subpackage's exports need: package
``__init__`` files import their exports on first use (``idempotency_gateway.lazy``).

Each check runs in a fresh interpreter, since this one has long imported everything.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import idempotency_gateway

DRIVERS = ("sqlalchemy", "asyncpg", "redis")


def _loaded_after(statement: str, candidates: tuple[str, ...]) -> list[str]:
    program = (
        f"import json, sys\n{statement}\n"
        f"print(json.dumps([name for name in {candidates!r} if name in sys.modules]))"
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, check=True, timeout=60
    )
    loaded: list[str] = json.loads(done.stdout)
    return loaded


@pytest.mark.parametrize(
    "module",
    [
        "idempotency_gateway.idempotency.keys",
        "idempotency_gateway.idempotency.prefer",
        "idempotency_gateway.idempotency.report",
    ],
)
def test_a_small_domain_module_loads_no_database_or_redis_driver(module: str) -> None:
    assert _loaded_after(f"import {module}", DRIVERS) == []


def test_the_package_exports_load_when_first_used() -> None:
    middleware = ("idempotency_gateway.idempotency.middleware",)
    assert _loaded_after("import idempotency_gateway.idempotency", middleware) == []
    used = "from idempotency_gateway.idempotency import IdempotencyMiddleware"
    assert _loaded_after(used, middleware) == list(middleware)
    # Nor does the middleware itself need a driver: the store and the cache import theirs
    # when a URL names them.
    assert _loaded_after(used, DRIVERS) == []


def test_an_unknown_name_is_an_attribute_error() -> None:
    import idempotency_gateway.idempotency as domain

    with pytest.raises(AttributeError, match="no attribute 'Middleware'"):
        _ = domain.Middleware
    assert {"IdempotencyMiddleware", "RoutePolicy"} <= set(dir(domain))
    assert set(idempotency_gateway.__all__) <= set(dir(idempotency_gateway))
