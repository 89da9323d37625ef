"""Run a coroutine on uvloop when it is installed (it is, with uvicorn[standard]), else asyncio."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run_fast(main: Coroutine[Any, Any, T]) -> T:
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    result: T = uvloop.run(main)
    return result


def loop_name() -> str:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "asyncio"
    return "uvloop"
