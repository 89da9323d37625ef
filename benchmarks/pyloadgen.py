"""The bundled load generator, used when wrk is not installed.

    python -m benchmarks.pyloadgen '{"base_url": ..., "load": {...}, "connections": 32, ...}'

Fixed concurrency (one coroutine per connection over one aiohttp session), a bounded
duration, and the same key modes and counts as the wrk script. It runs on one core: its own
CPU use is reported, and at ~100% of a core it, not the server, is the limit.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import aiohttp

from benchmarks.loadgen import RESULT_MARKER, Load, LoadResult, json_body
from benchmarks.runloop import loop_name, run_fast


def _percentile(sorted_values: list[float], share: float) -> float:
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, max(0, round(share * len(sorted_values)) - 1))
    return sorted_values[index]


async def generate(
    base_url: str, load: Load, connections: int, seconds: float, nonce: str
) -> LoadResult:
    body = json_body(load.body_bytes) if load.body_bytes else None
    base_headers = {"Content-Type": "application/json"} if body is not None else {}
    url = base_url + load.path
    latencies: list[float] = []
    counts = {"ok": 0, "conflicts": 0, "other": 0, "socket": 0, "replayed": 0}
    sent = 0
    connector = aiohttp.TCPConnector(limit=connections, limit_per_host=0)
    timeout = aiohttp.ClientTimeout(total=10)
    async with aiohttp.ClientSession(
        connector=connector, timeout=timeout, auto_decompress=False, trust_env=False
    ) as session:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds

        async def connection(worker: int) -> None:
            nonlocal sent
            own = 0
            while loop.time() < deadline:
                own += 1
                sent += 1
                headers = dict(base_headers)
                if load.keys == "unique":
                    headers["Idempotency-Key"] = f"{nonce}-{worker}-{own}"
                elif load.keys == "fixed":
                    headers["Idempotency-Key"] = nonce
                elif load.keys == "storm":
                    headers["Idempotency-Key"] = f"{nonce}-{sent // load.storm_group}"
                started = time.perf_counter()
                try:
                    async with session.request(
                        load.method, url, data=body, headers=headers
                    ) as response:
                        await response.read()
                        status = response.status
                        replayed = "Idempotent-Replayed" in response.headers
                except (aiohttp.ClientError, TimeoutError):
                    counts["socket"] += 1
                    continue
                latencies.append(time.perf_counter() - started)
                if 200 <= status < 300:
                    counts["ok"] += 1
                    counts["replayed"] += replayed
                elif status == 409 and load.count_statuses:
                    counts["conflicts"] += 1
                else:
                    counts["other"] += 1

        cpu_started, wall_started = time.process_time(), time.perf_counter()
        await asyncio.gather(*(connection(worker) for worker in range(connections)))
        wall = time.perf_counter() - wall_started
        cpu = time.process_time() - cpu_started
    latencies.sort()
    return LoadResult(
        requests=len(latencies),
        seconds=wall,
        p50_ms=_percentile(latencies, 0.50) * 1000,
        p99_ms=_percentile(latencies, 0.99) * 1000,
        ok=counts["ok"],
        conflicts=counts["conflicts"],
        other_status=counts["other"],
        socket_errors=counts["socket"],
        replayed=counts["replayed"] if load.count_statuses else None,
        generator=f"bundled aiohttp ({loop_name()}, 1 process)",
        generator_cpu=cpu / wall if wall > 0 else 0.0,
    )


def main() -> None:
    spec = json.loads(sys.argv[1])
    result = run_fast(
        generate(
            spec["base_url"],
            Load(**spec["load"]),
            int(spec["connections"]),
            float(spec["seconds"]),
            str(spec["nonce"]),
        )
    )
    print(RESULT_MARKER + result.to_json(), flush=True)


if __name__ == "__main__":
    main()
