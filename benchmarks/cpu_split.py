"""User and system CPU and preemptions per request of a server, read from ``/proc``.

    python -m benchmarks.cpu_split [--scenarios gw1-new,gw2-new] [--connections 32,32]
        [--seconds 8] [--rounds 2]

Each scenario's server (every process of it: ``serve``'s workers too) runs natively under
wrk; before and after the measured run its processes' user and system CPU
(``/proc/PID/stat``) and context switches (``/proc/PID/status``) are read. Divided by the
answers: what one request costs in user space and in the kernel, how often a worker gave up
its core waiting (voluntary) and how often another process took the core from it while it
could still run (involuntary, a preemption).

Why: CPU seconds per request can rise with no more work done (the instruction count of
``benchmarks.instructions`` stays the same). A process preempted mid-request finds its caches
cold when it runs again, so the same instructions take longer: this tells that apart from
work. ``--connections`` gives each scenario its own count, to compare workers at the same
number of requests in flight each (1 worker at 8 against 2 workers at 16). Scenarios and
connection counts run in turn, ``--rounds`` times, alternating.
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import dataclass
from pathlib import Path

from benchmarks.loadgen import LoadGenerator, RunParameters, choose_generator
from benchmarks.measure import warm_up
from benchmarks.processes import CLOCK_TICKS, stat_fields
from benchmarks.scenarios import SCENARIO_BY_ID, SERVER_BY_ID
from benchmarks.servers import RunContext, find_nginx, start_server, start_upstream
from benchmarks.services import (
    DEFAULT_REDIS_URL,
    DEFAULT_SERVER_URL,
    flush_redis_database,
    prepare_database,
    redis_version,
)

DATABASE = "idempotency_gateway_bench_split"
WARMUP_SECONDS = 2


@dataclass(frozen=True)
class Usage:
    user: float  # seconds
    system: float
    voluntary: int
    involuntary: int

    def __sub__(self, other: Usage) -> Usage:
        return Usage(
            self.user - other.user,
            self.system - other.system,
            self.voluntary - other.voluntary,
            self.involuntary - other.involuntary,
        )


def usage_of(pids: list[int]) -> Usage:
    """Summed over ``pids``; a process that exited meanwhile counts nothing."""
    user = system = voluntary = involuntary = 0
    for pid in pids:
        fields = stat_fields(pid)
        if fields is None:
            continue
        try:
            status = Path(f"/proc/{pid}/status").read_text().splitlines()
        except OSError:
            continue
        user += int(fields[11])
        system += int(fields[12])
        for line in status:
            name, _, value = line.partition(":")
            if name == "voluntary_ctxt_switches":
                voluntary += int(value)
            elif name == "nonvoluntary_ctxt_switches":
                involuntary += int(value)
    return Usage(user / CLOCK_TICKS, system / CLOCK_TICKS, voluntary, involuntary)


def measure_split(
    scenario_id: str, connections: int, ctx: RunContext, generator: LoadGenerator, seconds: int
) -> str:
    scenario = SCENARIO_BY_ID[scenario_id]
    server = start_server(SERVER_BY_ID[scenario.server], ctx)
    try:
        base_url, nonce = warm_up(
            generator, scenario, server.port, connections=connections, seconds=WARMUP_SECONDS
        )
        pids = server.process.tree()
        before = usage_of(pids)
        result = generator.run(RunParameters(base_url, scenario.load, connections, seconds, nonce))
        spent = usage_of(pids) - before
    finally:
        server.stop()
    answers = max(result.requests, 1)
    return (
        f"| `{scenario.id}` | {connections} | {result.requests / seconds:,.0f} "
        f"| {spent.user / answers * 1e6:.1f} | {spent.system / answers * 1e6:.1f} "
        f"| {spent.voluntary / answers:.2f} | {spent.involuntary / answers:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenarios", default="gw1-new,gw2-new")
    parser.add_argument("--connections", default="32", help="one count, or one per scenario")
    parser.add_argument("--seconds", type=int, default=8, help="measured seconds per run")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--postgres-url", default=DEFAULT_SERVER_URL)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    args = parser.parse_args()

    scenarios = args.scenarios.split(",")
    counts = [int(count) for count in args.connections.split(",")]
    if len(counts) == 1:
        counts *= len(scenarios)
    if len(counts) != len(scenarios):
        parser.error("--connections: one count, or one per scenario")
    work_dir = Path(tempfile.mkdtemp(prefix="idgw-cpu-split-"))
    database_url = prepare_database(args.postgres_url, DATABASE, recreate=True)
    redis_url = args.redis_url if redis_version(args.redis_url) is not None else None
    if redis_url == DEFAULT_REDIS_URL:
        flush_redis_database(redis_url)  # database 14 belongs to the benchmarks
    ctx = RunContext(work_dir, work_dir, database_url, redis_url, find_nginx())
    upstream = start_upstream(ctx, use_nginx=ctx.nginx is not None)
    generator = choose_generator(force_builtin=False, script_dir=work_dir, threads=2)
    print(
        "| scenario | connections | answers/s | user us/request | system us/request "
        "| voluntary switches/request | involuntary switches/request |\n"
        "|---|---|---|---|---|---|---|",
        flush=True,
    )
    try:
        for _ in range(args.rounds):
            for scenario_id, connections in zip(scenarios, counts, strict=True):
                print(measure_split(scenario_id, connections, ctx, generator, args.seconds))
    finally:
        upstream.stop()


if __name__ == "__main__":
    main()
