"""Each served worker freezes its startup heap out of the garbage collector's way
(``server.heap``), and still serves; a gateway built in a user's process leaves that
process's collector alone."""

from __future__ import annotations

import gc
import json
import re

import httpx
import pytest

from idempotency_gateway.server.heap import YOUNG_GENERATION_THRESHOLD, settle_after_startup
from tests.support import RecordingUpstream, eventually
from tests.support.gateway import gateway_config, route
from tests.support.servers import StartGatewayProcess

pytestmark = pytest.mark.multiprocess

SETTLED = re.compile(r"heap settled: (\d+) startup objects frozen")


def settled_workers(log_text: str) -> dict[int, int]:
    """pid -> objects frozen, from the workers' JSON log lines."""
    found = {}
    for line in log_text.splitlines():
        if "heap settled" not in line:
            continue
        entry = json.loads(line)
        match = SETTLED.search(entry["message"])
        assert match is not None
        found[entry["pid"]] = int(match.group(1))
    return found


async def test_every_served_worker_settles_its_heap_and_serves(
    upstream: RecordingUpstream, start_gateway_process: StartGatewayProcess, sqlite_url: str
) -> None:
    config = gateway_config(upstream.url, routes=[route("/", key="optional")])
    gateway = await start_gateway_process(
        config.model_dump(mode="json"),
        env={"GATEWAY_DATABASE_URL": sqlite_url},
        extra_args=["--workers", "2", "--log-format", "json"],
    )
    await eventually(
        lambda: len(settled_workers(gateway.log_text())) == 2,
        message="both workers settled their heaps",
    )
    settled = settled_workers(gateway.log_text())
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as client:
        for _ in range(20):
            response = await client.get(gateway.url + "/v1/ping")
            assert response.is_success
    assert upstream.total == 20
    # A worker's startup leaves far more than a toy process's objects alive.
    assert all(frozen > 50_000 for frozen in settled.values()), settled


def test_settling_freezes_the_heap_and_raises_the_young_threshold() -> None:
    before = gc.get_threshold()
    try:
        settle_after_startup()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (YOUNG_GENERATION_THRESHOLD, *before[1:])
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
