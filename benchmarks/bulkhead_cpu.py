"""CPU the bulkhead layer adds to a request that finds a slot free: ``bulkhead_cpu``.

    .venv/bin/python -m benchmarks.bulkhead_cpu                    # one worker's metrics
    .venv/bin/python -m benchmarks.bulkhead_cpu --multiprocess     # as under --workers N

Calls a constant-answer ASGI app directly, bare and behind ``BulkheadMiddleware`` with a route
tier and an upstream bulkhead (the request takes and gives back two slots, with their
in-flight gauges), and reports the difference in ``time.process_time`` per request. No
sockets: what is left is the layer's own cost. ``--multiprocess`` writes the gauges to
``PROMETHEUS_MULTIPROC_DIR`` files, as a gateway with several workers does.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

ROUTE = "charges"


async def _answer(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"{}", "more_body": False})


async def cpu_per_request(requests: int) -> tuple[float, float]:
    """(bare, behind the bulkheads) seconds of CPU per request."""
    from idempotency_gateway.config import BulkheadConfig, RouteConfig, RouteMatch
    from idempotency_gateway.resilience.bulkhead import Bulkhead, BulkheadKind
    from idempotency_gateway.resilience.bulkheads import BulkheadMiddleware, route_bulkheads
    from idempotency_gateway.target import STATE_KEY, RequestTarget

    route = RouteConfig(name=ROUTE, match=RouteMatch(path_prefix="/"), upstream="primary")
    upstream = Bulkhead(BulkheadKind.UPSTREAM, "primary", BulkheadConfig(max_concurrent=100))
    tiers = {"critical": BulkheadConfig(max_concurrent=100, max_queued=10)}
    limited = BulkheadMiddleware(
        _answer,
        bulkheads=route_bulkheads(
            [route.model_copy(update={"bulkhead": "critical"})], tiers, {"primary": upstream}
        ),
    )
    target = RequestTarget(b"/v1/charges", b"", route)

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        return None

    async def run(app: Any, count: int) -> float:
        scope = {"type": "http", "method": "POST", "headers": [], "state": {STATE_KEY: target}}
        started = time.process_time()
        for _ in range(count):
            await app(scope, receive, send)
        return (time.process_time() - started) / count

    await run(_answer, 1000)
    await run(limited, 1000)
    rounds = [(await run(_answer, requests), await run(limited, requests)) for _ in range(5)]
    bare = min(round_[0] for round_ in rounds)
    behind = min(round_[1] for round_ in rounds)
    return bare, behind


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bulkhead_cpu")
    parser.add_argument("--requests", type=int, default=100_000)
    parser.add_argument(
        "--multiprocess", action="store_true", help="gauges in PROMETHEUS_MULTIPROC_DIR files"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as directory:
        if args.multiprocess:
            # Read by prometheus_client when it is first imported, hence the late imports.
            os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
        from benchmarks.runloop import loop_name, run_fast

        bare, behind = run_fast(cpu_per_request(args.requests))
    metrics = "multiprocess files" if args.multiprocess else "in-process"
    print(
        f"{loop_name()}, {metrics} metrics, best of 5 x {args.requests} requests: "
        f"bare {bare * 1e6:.2f} us, behind 2 bulkheads {behind * 1e6:.2f} us, "
        f"added {(behind - bare) * 1e6:.2f} us of CPU per request"
    )


if __name__ == "__main__":
    main()
