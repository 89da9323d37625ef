"""Polling with a deadline: the only sanctioned way for tests to wait on a condition."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable
from typing import TypeVar, overload

T = TypeVar("T")


@overload
async def eventually(
    predicate: Callable[[], Awaitable[T]],
    *,
    timeout: float = ...,  # noqa: ASYNC109
    interval: float = ...,
    message: str | None = ...,
) -> T: ...


@overload
async def eventually(
    predicate: Callable[[], T],
    *,
    timeout: float = ...,  # noqa: ASYNC109
    interval: float = ...,
    message: str | None = ...,
) -> T: ...


async def eventually(
    predicate: Callable[[], T | Awaitable[T]],
    *,
    timeout: float = 10.0,  # noqa: ASYNC109 - a deadline is this helper's purpose
    interval: float = 0.02,
    message: str | None = None,
) -> T:
    """Call ``predicate`` (sync or async) until it returns something truthy; return that value.

    Raises ``AssertionError`` when ``timeout`` seconds pass first. An exception raised by the
    predicate is not swallowed: it propagates at once (assert inside ``predicate`` only if a
    failure is final). The last falsy value is included in the failure message.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    attempts = 0
    while True:
        attempts += 1
        result = predicate()
        if inspect.isawaitable(result):
            result = await result
        if result:
            return result
        if loop.time() >= deadline:
            what = message or getattr(predicate, "__qualname__", repr(predicate))
            raise AssertionError(
                f"condition not met within {timeout:.2f}s after {attempts} attempts: {what} "
                f"(last value: {result!r})"
            )
        await asyncio.sleep(interval)
