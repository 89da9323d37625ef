"""Instructions per request, counted by valgrind's callgrind: a yardstick the machine's noise
does not move.

    python -m benchmarks.instructions [--scenarios minproxy,gw1-pass,gw1-replay-redis]
                                      [--seconds 10] [--connections 8]

CPU seconds on a shared VM drift by up to a factor of two from one run to the next, so a
change of a few percent cannot be told apart by timing (``RESULTS.md``). Instructions can:
the same code, load and inputs give the same count to a few parts in ten thousand, whatever
else the machine does. Each server under test runs under ``valgrind --tool=callgrind`` (every
process it starts too: ``serve``'s workers), warmed up, its counters zeroed, then loaded
with wrk for ``--seconds``; its counters are dumped and the instructions it ran are divided by
the answers wrk received. The upstream (nginx), PostgreSQL, Redis and wrk run natively and are
not counted: the count is the server's own work in user space. It leaves out what the kernel
does for its system calls (the socket writes, mostly, which a proxy pays once per request
either way) and how fast each instruction runs, so compare programs that do the same system
calls per request, as the proxies here do; ``python -m benchmarks`` measures seconds.

Under valgrind a server runs some fifty times slower; the counts per request stay what they
are at full speed, except what depends on how many requests one loop iteration serves (the
metrics and cache writes batched per iteration): ``--connections`` keeps that the same for
every server compared.
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.loadgen import LoadGenerator, RunParameters, choose_generator
from benchmarks.measure import warm_up
from benchmarks.processes import ManagedProcess
from benchmarks.scenarios import SCENARIO_BY_ID, SERVER_BY_ID, Scenario
from benchmarks.servers import RunContext, find_nginx, start_server, start_upstream
from benchmarks.services import (
    DEFAULT_REDIS_URL,
    DEFAULT_SERVER_URL,
    flush_redis_database,
    prepare_database,
    redis_version,
)

DEFAULT_SCENARIOS = "minproxy,gw1-pass,gw1-replay-redis,gw1-new"
DATABASE = "idempotency_gateway_bench_ir"
DUMP_TIMEOUT = 120.0


@dataclass(frozen=True)
class Count:
    scenario: str
    label: str
    requests: int
    instructions: int
    errors: int

    @property
    def per_request(self) -> float:
        return self.instructions / self.requests if self.requests else 0.0


def callgrind_launcher(out_dir: Path) -> tuple[str, ...]:
    return (
        "valgrind", "--tool=callgrind", "--trace-children=yes",
        f"--callgrind-out-file={out_dir}/callgrind.%p",
    )  # fmt: skip


def _callgrind_control(option: str, pids: Iterable[int]) -> None:
    for pid in pids:
        # Each process answers through valgrind's gdbserver; one that exited is no error.
        subprocess.run(
            ["callgrind_control", option, str(pid)], capture_output=True, timeout=60, check=False
        )


def summary_of(path: Path) -> int | None:
    """The instructions a callgrind dump holds (its ``summary:`` line), once it is written."""
    try:
        text = path.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("summary:"):
            return int(line.split()[1])
    return None


def dumped_instructions(out_dir: Path, pids: Iterable[int]) -> int:
    """The instructions counted since the zeroing, summed over the processes' first dumps."""
    total = 0
    deadline = time.monotonic() + DUMP_TIMEOUT
    for pid in pids:
        dump = out_dir / f"callgrind.{pid}.1"
        while (count := summary_of(dump)) is None:
            if not Path(f"/proc/{pid}").exists() or time.monotonic() > deadline:
                count = 0  # a helper process that exited before the dump counted nothing since
                break
            time.sleep(0.2)
        total += count
    return total


def count_scenario(
    scenario: Scenario, ctx: RunContext, generator: LoadGenerator, args: argparse.Namespace
) -> Count:
    out_dir = ctx.work_dir / scenario.id
    out_dir.mkdir()
    run_ctx = dataclasses.replace(ctx, launcher=callgrind_launcher(out_dir), start_timeout=600.0)
    spec = SERVER_BY_ID[scenario.server]
    if spec.redis and ctx.redis_url is None:
        raise SystemExit(f"{scenario.id} needs Redis, which did not answer")
    server = start_server(spec, run_ctx)
    try:
        base_url, nonce = warm_up(
            generator, scenario, server.port, connections=args.connections, seconds=args.warmup
        )
        pids = server.process.tree()
        _callgrind_control("-z", pids)
        result = generator.run(
            RunParameters(base_url, scenario.load, args.connections, args.seconds, nonce)
        )
        _callgrind_control("-d", pids)
        instructions = dumped_instructions(out_dir, pids)
    finally:
        server.stop()
    return Count(scenario.id, spec.label, result.requests, instructions, result.errors)


def table(counts: list[Count], baseline: str | None) -> str:
    base = next((count for count in counts if count.scenario == baseline), None)
    lines = [
        "| scenario | server | answers counted | instructions per request | vs baseline |",
        "|---|---|---|---|---|",
    ]
    for count in counts:
        ratio = ""
        if base is not None and count is not base and count.per_request:
            ratio = f"{base.per_request / count.per_request:.2f}x `{base.scenario}`"
        errors = f" ({count.errors} errors)" if count.errors else ""
        lines.append(
            f"| `{count.scenario}` | {count.label} | {count.requests:,}{errors} "
            f"| {count.per_request / 1000:,.0f} k | {ratio} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scenarios", default=DEFAULT_SCENARIOS)
    parser.add_argument("--baseline", default="minproxy", help="the scenario ratios are to")
    parser.add_argument("--seconds", type=int, default=10, help="counted seconds per scenario")
    parser.add_argument("--warmup", type=int, default=3, help="seconds of load before counting")
    parser.add_argument("--connections", type=int, default=8)
    parser.add_argument("--postgres-url", default=DEFAULT_SERVER_URL)
    parser.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    parser.add_argument(
        "--builtin-loadgen", action="store_true", help="the bundled generator even with wrk"
    )
    args = parser.parse_args()

    missing = [tool for tool in ("valgrind", "callgrind_control") if not shutil.which(tool)]
    if missing:
        sys.exit(f"needs {' and '.join(missing)} (Debian: apt-get install valgrind)")
    scenarios = [SCENARIO_BY_ID[name] for name in args.scenarios.split(",")]
    work_dir = Path(tempfile.mkdtemp(prefix="idgw-instructions-"))
    needs_database = any(SERVER_BY_ID[s.server].kind == "gateway" for s in scenarios)
    database_url = (
        prepare_database(args.postgres_url, DATABASE, recreate=True) if needs_database else ""
    )
    redis_url = args.redis_url if redis_version(args.redis_url) is not None else None
    if redis_url == DEFAULT_REDIS_URL:
        flush_redis_database(redis_url)  # database 14 belongs to the benchmarks
    ctx = RunContext(work_dir, work_dir, database_url, redis_url, find_nginx())
    upstream: ManagedProcess = start_upstream(ctx, use_nginx=ctx.nginx is not None)
    generator = choose_generator(force_builtin=args.builtin_loadgen, script_dir=work_dir, threads=1)
    counts: list[Count] = []
    try:
        for scenario in scenarios:
            print(f"{scenario.id}: under callgrind, {args.seconds}s counted ...", flush=True)
            counts.append(count_scenario(scenario, ctx, generator, args))
            print(f"    {counts[-1].per_request:,.0f} instructions per request", flush=True)
    finally:
        upstream.stop()
    print(f"\n{args.connections} connections, {args.seconds}s counted per scenario\n")
    print(table(counts, args.baseline))


if __name__ == "__main__":
    main()
