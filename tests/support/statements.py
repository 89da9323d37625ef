"""``StatementLog``: every statement the stores opened meanwhile send to PostgreSQL.

asyncpg's own query logger, added to each connection as the store's pool opens it: the
statements as the driver sent them, with their arguments, nothing of the store replaced.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg
import pytest
from asyncpg.connection import LoggedQuery


class StatementLog:
    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.sent: list[LoggedQuery] = []
        create_pool = asyncpg.create_pool

        def logging_pool(
            *args: Any,
            init: Callable[[asyncpg.Connection], Awaitable[None]] | None = None,
            **kwargs: Any,
        ) -> asyncpg.Pool:
            async def init_and_log(connection: asyncpg.Connection) -> None:
                if init is not None:
                    await init(connection)
                connection.add_query_logger(self.sent.append)

            return create_pool(*args, init=init_and_log, **kwargs)

        monkeypatch.setattr(asyncpg, "create_pool", logging_pool)

    def naming(self, key: str) -> list[str]:
        """The statements (their SQL) whose arguments name ``key``, alone or in an array."""
        return [query.query for query in self.sent if _names(query.args, key)]

    def of(self, statement: str) -> int:
        """How many times ``statement`` (its exact SQL) was sent."""
        return sum(query.query == statement for query in self.sent)


def _names(args: Any, key: str) -> bool:
    return any(arg == key or (isinstance(arg, list | tuple) and key in arg) for arg in args or ())
