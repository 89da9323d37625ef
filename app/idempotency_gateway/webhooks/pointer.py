"""RFC 6901 JSON Pointers: where in a webhook's JSON body its delivery id is."""

from __future__ import annotations

import re

# RFC 6901 section 4: an array index is 0 or digits without a leading zero ("-", the element
# after the last, never exists). Bounded, so a long token is no huge integer to convert.
_ARRAY_INDEX = re.compile(r"0|[1-9][0-9]{0,17}")


def reference_tokens(pointer: str) -> tuple[str, ...]:
    """``/data/a~1b/0`` -> ``("data", "a/b", "0")``; ``~1`` before ``~0``, so ``~01`` is
    ``~1``, as the RFC orders it. The pointer is checked by the config (it starts with "/")."""
    return tuple(token.replace("~1", "/").replace("~0", "~") for token in pointer.split("/")[1:])


def resolve(document: object, tokens: tuple[str, ...]) -> object:
    """The value ``tokens`` point at; ``LookupError`` when nothing is there."""
    value = document
    for token in tokens:
        if isinstance(value, dict):
            if token not in value:
                raise LookupError(token)
            value = value[token]
        elif isinstance(value, list) and _ARRAY_INDEX.fullmatch(token) and int(token) < len(value):
            value = value[int(token)]
        else:
            raise LookupError(token)
    return value
