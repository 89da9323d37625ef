"""The README's code blocks, so tests run the examples exactly as a reader copies them."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def python_example(section: str) -> str:
    """The first ```python block under the README heading ``section`` (e.g. "## Using it as a
    library")."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n{section}\n")
    block = re.search(r"```python\n(.*?)```", text[start:], flags=re.DOTALL)
    if block is None:
        raise AssertionError(f"no python example under {section!r} in README.md")
    return block.group(1)
