"""An ASGI app under the gateway's own server protocol (``EdgeProtocol``), as ``serve`` runs it.

    python -m benchmarks.edge_server benchmarks.hello_app:app --port 8000

With the constant answer of ``hello_app`` this is the edge alone: beside ``hello-uvicorn``
(the same app under uvicorn's httptools protocol) it shows what the edge's limits and
deadlines, the head checks and the joined writes cost per request.
"""

from __future__ import annotations

import argparse

import uvicorn

from idempotency_gateway.config import LimitsConfig
from idempotency_gateway.server.protocol import EdgeServerConfig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("app", help="module:attribute of the ASGI app")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    config = EdgeServerConfig(
        args.app,
        limits=LimitsConfig(),
        host="127.0.0.1",
        port=args.port,
        loop="uvloop",
        ws="none",
        log_level="warning",
        access_log=False,
        # As ``serve`` sets them: no Server header, client addresses as the socket gives them.
        server_header=False,
        proxy_headers=False,
    )
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
