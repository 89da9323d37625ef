"""``idempotency-gateway demo``: the gateway on the embedded store in front of the example
payments API, both in this process, with curl lines that show each behaviour."""

from __future__ import annotations

import asyncio
import contextlib

import uvicorn

from idempotency_gateway.config import ConfigError, validate_config
from idempotency_gateway.demo.payments import create_payments_app
from idempotency_gateway.main import create_gateway
from idempotency_gateway.server.listeners import listening_socket

_HOST = "127.0.0.1"


def _demo_config(upstream_port: int) -> dict[str, object]:
    return {
        "upstreams": {"payments": {"url": f"http://127.0.0.1:{upstream_port}"}},
        "routes": [
            {
                "name": "charges",
                "match": {"path_prefix": "/v1/charges"},
                "upstream": "payments",
                "idempotency": {"methods": ["POST"], "key": "required"},
            },
            {"name": "default", "match": {"path_prefix": "/"}, "upstream": "payments"},
        ],
    }


def _curl_lines(port: int) -> str:
    base = f"http://{_HOST}:{port}"
    charge = (
        f"curl -si {base}/v1/charges -H 'Authorization: Bearer sk_demo' "
        "-H 'Content-Type: application/json'"
    )
    slow = (
        f"{charge} -H 'Idempotency-Key: order-2' -H 'X-Demo-Delay: 5' "
        """-d '{"amount": 500, "currency": "eur"}'"""
    )
    return f"""
idempotency-gateway demo: gateway on {base}, example payments API behind it.

1. Create a charge, then send the very same request again: the second answer is replayed
   (Idempotent-Replayed: true) and the API executed only once.
     {charge} -H 'Idempotency-Key: order-1' -d '{{"amount": 1000, "currency": "usd"}}'
     {charge} -H 'Idempotency-Key: order-1' -d '{{"amount": 1000, "currency": "usd"}}'

2. Reuse the key for a different request: 422.
     {charge} -H 'Idempotency-Key: order-1' -d '{{"amount": 9999, "currency": "usd"}}'

3. A duplicate while the first is still running: 409 with Retry-After.
     {slow} &
     sleep 1; {slow}

4. How many charges really ran:
     curl -s {base}/v1/stats

Press Ctrl-C to stop.
"""


async def _serve_both(port: int, upstream_port: int) -> None:
    # Listening first: a port in use is refused by name before the store is created.
    gateway_socket = listening_socket(_HOST, port)
    upstream_socket = listening_socket(_HOST, upstream_port)
    upstream = uvicorn.Server(
        uvicorn.Config(create_payments_app(), host=_HOST, port=upstream_port, log_level="warning")
    )
    gateway = uvicorn.Server(
        uvicorn.Config(
            create_gateway(validate_config(_demo_config(upstream_port), source="demo")),
            host=_HOST,
            port=port,
            log_level="warning",
            lifespan="on",
            server_header=False,
        )
    )
    upstream_task = asyncio.create_task(upstream.serve(sockets=[upstream_socket]))
    gateway_task = asyncio.create_task(gateway.serve(sockets=[gateway_socket]))
    while not (upstream.started and gateway.started):
        if upstream_task.done() or gateway_task.done():
            break
        await asyncio.sleep(0.05)
    else:
        print(_curl_lines(port), flush=True)
    await asyncio.gather(upstream_task, gateway_task)


def run_demo(*, port: int, upstream_port: int) -> int:
    if port == upstream_port:
        raise ConfigError(
            "command line", [f"the demo and its payments API are both on {port}: give each its own"]
        )
    # Ctrl-C is how the banner says to stop. Both servers have shut down gracefully by the
    # time uvicorn re-raises the signal, and that must not end in a traceback.
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve_both(port, upstream_port))
    return 0
