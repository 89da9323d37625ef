"""A worker's heap once it is ready: out of the garbage collector's way.

A gateway worker imports and builds some hundred thousand long-lived objects (FastAPI,
pydantic, SQLAlchemy, asyncpg, redis, the config) before its first request, and every
request allocates a few hundred short-lived ones. CPython's collector walks the long-lived
ones again on each full collection, and runs a young collection every 700 net allocations:
on pass-through that was about a fifth of a worker's CPU (measured: see
benchmarks/RESULTS.md). ``gc.freeze()`` moves everything alive at startup into a permanent
generation no collection walks, and a larger young threshold collects the per-request
objects in fewer, equally cheap passes. Reference cycles made later are still collected.
"""

from __future__ import annotations

import gc
import logging

log = logging.getLogger(__name__)

# Ten times CPython's 700: young collections stay cheap (only young objects are walked), a
# few thousand more short-lived objects wait for one.
YOUNG_GENERATION_THRESHOLD = 7_000


def settle_after_startup() -> None:
    gc.collect()  # startup's garbage is dropped, not frozen for good
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(YOUNG_GENERATION_THRESHOLD, middle, oldest)
    log.info(
        "heap settled: %d startup objects frozen out of garbage collection, "
        "young generation threshold %d",
        gc.get_freeze_count(),
        YOUNG_GENERATION_THRESHOLD,
    )
