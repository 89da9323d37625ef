"""The gateway's own CPU per request, counted in one process: the app without the server.

    python -m benchmarks.app_cost [--requests 20000] [--rounds 3] [--concurrency 32]

Drives the gateway's ASGI app (``Gateway``: access line, routing, idempotency, proxy and its
upstream client) with requests built in this process, against nginx (or the built-in
upstream) running as a process of its own, and counts this process's CPU
(``time.process_time``) per request. The edge (``EdgeProtocol``, uvicorn's cycle) and the
load generator are left out, and so are the client's sockets: what is left is what the
gateway's own Python costs. It still moves with the machine (a shared VM's CPU speed drifts
by tens of percent): compare code changes by running both sides alternately, several times,
and compare the least of each side's rounds (noise only ever adds).

Set up as ``serve`` runs a worker: JSON access lines at ``info`` (to ``--log-file``, the null
device by default), metrics in a multiprocess directory, the disconnect callback the
gateway's own server offers. The store is the embedded SQLite file; replays come from the
in-process tier. Scenarios: ``pass`` (GET, no key), ``replay`` (POST with one key),
``new`` (POST, a new key each: the SQLite store's cost is in it).
"""

from __future__ import annotations

import argparse
import asyncio
import logging.config
import os
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

# Before prometheus_client is imported: its values pick their storage at import.
_METRICS_DIR = tempfile.mkdtemp(prefix="idgw-app-cost-metrics-")
os.environ["PROMETHEUS_MULTIPROC_DIR"] = _METRICS_DIR

from benchmarks.runloop import run_fast  # noqa: E402
from benchmarks.servers import RunContext, find_nginx, start_upstream  # noqa: E402
from idempotency_gateway.asgi import DISCONNECT_EXTENSION, Message, Receive, Scope  # noqa: E402
from idempotency_gateway.config import validate_config  # noqa: E402
from idempotency_gateway.main import Gateway  # noqa: E402
from idempotency_gateway.telemetry.logs import uvicorn_log_config  # noqa: E402

Request = Callable[[int], tuple[Scope, bytes]]


def _scope(method: str, headers: list[tuple[bytes, bytes]]) -> Scope:
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": "/small",
        "raw_path": b"/small",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"127.0.0.1"), *headers],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8080),
        "state": {},
        # As the gateway's server offers it: disconnects come by callback, no watcher task.
        "extensions": {DISCONNECT_EXTENSION: {"signal": _STAYS}},
    }


class _ClientThatStays:
    """A ``DisconnectSignal`` whose connection is never lost."""

    def reports_for(self, receive: Receive) -> bool:
        return True

    def add(self, callback: Callable[[], None]) -> None:
        pass

    def discard(self, callback: Callable[[], None]) -> None:
        pass


_STAYS = _ClientThatStays()


def pass_through(_: int) -> tuple[Scope, bytes]:
    return _scope("GET", []), b""


BODY = b'{"amount": 100, "currency": "eur"}'
JSON = [(b"content-type", b"application/json"), (b"content-length", str(len(BODY)).encode())]
REPLAYED_KEY = str(uuid.uuid4()).encode()


def replay(_: int) -> tuple[Scope, bytes]:
    return _scope("POST", [*JSON, (b"idempotency-key", REPLAYED_KEY)]), BODY


def new_key(_: int) -> tuple[Scope, bytes]:
    return _scope("POST", [*JSON, (b"idempotency-key", str(uuid.uuid4()).encode())]), BODY


SCENARIOS: dict[str, Request] = {"pass": pass_through, "replay": replay, "new": new_key}


async def _one(app: Gateway, scope: Scope, body: bytes) -> int:
    sent = False
    status = 0

    async def receive() -> Message:
        nonlocal sent
        if sent:
            raise RuntimeError("the body was read twice")
        sent = True
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = message["status"]

    await app(scope, receive, send)
    return status


async def _drive(app: Gateway, request: Request, count: int, concurrency: int) -> float:
    """CPU seconds per request over ``count`` requests, ``concurrency`` at a time."""
    remaining = count

    async def client() -> None:
        nonlocal remaining
        while remaining > 0:
            remaining -= 1
            scope, body = request(remaining)
            status = await _one(app, scope, body)
            if status != 200:
                raise RuntimeError(f"answered {status}, not 200")

    started = time.process_time()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    return (time.process_time() - started) / count


async def measure(
    upstream_url: str, work_dir: Path, args: argparse.Namespace
) -> dict[str, list[float]]:
    config = validate_config(
        {
            "upstreams": {"bench": {"url": upstream_url, "pool": {"max_connections": 100}}},
            "routes": [
                {
                    "name": "bench",
                    "match": {"path_prefix": "/"},
                    "upstream": "bench",
                    "idempotency": {"key": "optional", "methods": ["POST"]},
                }
            ],
        },
        source="benchmarks/app_cost.py",
    )
    app = Gateway(config, database_url=f"sqlite:///{work_dir / 'records.db'}")
    await app.startup()
    results: dict[str, list[float]] = {name: [] for name in args.scenarios}
    try:
        for name in args.scenarios:  # warm-up: connections, caches, the replayed key
            await _drive(app, SCENARIOS[name], 1, 1)  # a replay's first answer, stored
            await _drive(app, SCENARIOS[name], args.concurrency * 20, args.concurrency)
        for _ in range(args.rounds):
            for name in args.scenarios:
                cost = await _drive(app, SCENARIOS[name], args.requests, args.concurrency)
                results[name].append(cost * 1e6)
    finally:
        await app.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument(
        "--scenarios", type=lambda text: text.split(","), default=["pass", "replay", "new"]
    )
    parser.add_argument("--log-file", default=os.devnull, help="where access lines go")
    args = parser.parse_args()

    logging.config.dictConfig(uvicorn_log_config("info", "json"))
    handler = logging.getLogger().handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(open(args.log_file, "w"))  # noqa: SIM115 - open for the whole run

    work_dir = Path(tempfile.mkdtemp(prefix="idgw-app-cost-"))
    nginx = find_nginx()
    context = RunContext(work_dir, work_dir, "", None, nginx)
    upstream = start_upstream(context, use_nginx=nginx is not None)
    try:
        results = run_fast(measure(context.upstream_url, work_dir, args))
    finally:
        upstream.stop()
    upstream_name = "nginx" if nginx is not None else "the built-in upstream (no nginx found)"
    print(f"us of CPU per request in this process, {args.rounds} rounds of {args.requests}")
    print(f"upstream: {upstream_name}, concurrency {args.concurrency}")
    for name, costs in results.items():
        rounds = " ".join(f"{cost:.1f}" for cost in costs)
        print(f"{name:8} min {min(costs):6.1f}  median {statistics.median(costs):6.1f}  ({rounds})")


if __name__ == "__main__":
    main()
