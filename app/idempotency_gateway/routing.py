"""Longest-prefix matching of request paths, on whole path segments.

``/v1/charges`` matches ``/v1/charges`` and ``/v1/charges/ch_1`` but not ``/v1/chargesX``:
a prefix that splits a segment would route by accident.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

T = TypeVar("T")


class PrefixRouter(Generic[T]):
    def __init__(self, entries: Iterable[tuple[str, T]]) -> None:
        # Longest first, so the first hit is the most specific route.
        self._entries = sorted(
            ((prefix.rstrip("/"), value) for prefix, value in entries),
            key=lambda entry: len(entry[0]),
            reverse=True,
        )

    def match(self, path: str) -> T | None:
        for prefix, value in self._entries:
            if not prefix or path == prefix or path.startswith(prefix + "/"):
                return value
        return None
