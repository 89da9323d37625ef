"""``python -m benchmarks``: start the servers, drive the load, write RESULTS.md.

.venv/bin/python -m benchmarks                      # the full run (about 8 minutes)
.venv/bin/python -m benchmarks --quick              # every scenario, briefly
.venv/bin/python -m benchmarks --scenarios direct,gw1-pass --duration 3
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from benchmarks.runner import Options, run
from benchmarks.scenarios import MEMORY_SCENARIO, SCENARIOS
from benchmarks.services import DEFAULT_DATABASE, DEFAULT_REDIS_URL, DEFAULT_SERVER_URL

HERE = Path(__file__).resolve().parent


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Benchmark the idempotency gateway against baselines in one run.",
    )
    parser.add_argument("--quick", action="store_true", help="short runs, small memory check")
    parser.add_argument("--duration", type=float, help="seconds measured per scenario (8)")
    parser.add_argument("--warmup", type=float, help="seconds of warm-up per scenario (1)")
    parser.add_argument("--connections", type=int, default=32, help="concurrent connections")
    parser.add_argument("--threads", type=int, default=2, help="wrk threads")
    parser.add_argument(
        "--scenarios", help="comma-separated scenario ids or prefixes (default: all); see --list"
    )
    parser.add_argument("--list", action="store_true", help="list the scenarios and exit")
    parser.add_argument(
        "--memory-requests", type=int, help="requests in the memory check (100000; quick: 5000)"
    )
    parser.add_argument("--output", type=Path, default=HERE / "RESULTS.md")
    parser.add_argument(
        "--builtin-upstream", action="store_true", help="the bundled upstream even with nginx"
    )
    parser.add_argument(
        "--builtin-loadgen", action="store_true", help="the bundled generator even with wrk"
    )
    parser.add_argument(
        "--postgres-url",
        default=DEFAULT_SERVER_URL,
        help="PostgreSQL server; the bench database is dropped and created there",
    )
    parser.add_argument("--database", default=DEFAULT_DATABASE, help="name of the bench database")
    parser.add_argument(
        "--database-url",
        help="use this existing database as it is (migrated, never dropped) instead",
    )
    parser.add_argument("--redis-url", default=DEFAULT_REDIS_URL)
    parser.add_argument("--no-redis", action="store_true", help="run without Redis")
    return parser


def main(argv: list[str] | None = None) -> int:
    arguments = sys.argv[1:] if argv is None else argv
    args = _parser().parse_args(arguments)
    if args.list:
        for scenario in SCENARIOS:
            print(f"{scenario.id:20} {scenario.label}: {scenario.load.describe(args.connections)}")
        print(f"{MEMORY_SCENARIO:20} RSS of the gateway's workers over many requests")
        return 0
    options = Options(
        command=" ".join(["python -m benchmarks", shlex.join(arguments)]).strip(),
        quick=args.quick,
        seconds=args.duration if args.duration is not None else (2.0 if args.quick else 8.0),
        warmup=args.warmup if args.warmup is not None else 1.0,
        connections=args.connections,
        threads=args.threads,
        scenarios=args.scenarios,
        memory_requests=args.memory_requests or (5_000 if args.quick else 100_000),
        output=args.output,
        builtin_upstream=args.builtin_upstream,
        builtin_loadgen=args.builtin_loadgen,
        postgres_url=args.postgres_url,
        database=args.database,
        database_url=args.database_url,
        redis_url=None if args.no_redis else args.redis_url,
    )
    return run(options)


if __name__ == "__main__":
    sys.exit(main())
