"""The soak: minutes of duplicates and random faults on one gateway cluster.

    python -m tests.faults.soak --minutes 3            # writes tests/faults/SOAK.md
    pytest -m soak tests/faults/test_soak.py           # the same, GATEWAY_SOAK_MINUTES=3

Rounds of the fault run follow each other on the same cluster for the whole time (each: load
from eight SDK-like clients with shared and repeated operations, one fault kind leading in
turn with up to two others at random,
settling, the checker), so the surviving gateways live through everything. The resident
memory of every gateway process is sampled from ``/proc`` every few seconds. The summary
(the same table as the short run, plus memory over time) goes to ``SOAK.md`` and stdout; the
exit status is 1 when any round found a violation. Bounded: at most ``MAX_MINUTES``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import platform
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from tests.faults.checker import Report
from tests.faults.cluster import LEASE
from tests.faults.faults import KINDS
from tests.faults.scenario import FaultEnvironment, Plan, fault_environment, run_scenario

SOAK_FILE = Path(__file__).with_name("SOAK.md")
MAX_MINUTES = 30.0
SAMPLE_EVERY = 5.0


@dataclass
class SoakResult:
    minutes: float
    rounds: list[Report] = field(default_factory=list)
    rss: dict[str, list[tuple[float, int]]] = field(default_factory=dict)
    """Gateway name -> (seconds since start, resident set in KiB) samples."""

    @property
    def report(self) -> Report:
        return Report.merged(f"soak, {len(self.rounds)} rounds", self.rounds)


def resident_kib(pid: int) -> int | None:
    """VmRSS of a process, from /proc (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        return None
    return None


async def _sample_memory(environment: FaultEnvironment, result: SoakResult, started: float) -> None:
    while True:
        # Serving gateways only: one still starting up would show its interpreter loading.
        for gateway in list(environment.cluster.gateways):
            if gateway.running:
                kib = resident_kib(gateway.pid)
                if kib is not None:
                    result.rss.setdefault(gateway.name, []).append(
                        (time.monotonic() - started, kib)
                    )
        await asyncio.sleep(SAMPLE_EVERY)  # the sampling period, not a wait for anything


async def soak(minutes: float, *, workdir: Path, seed: int = 0) -> SoakResult:
    minutes = min(minutes, MAX_MINUTES)
    result = SoakResult(minutes)
    rng = random.Random(seed)
    async with fault_environment(workdir) as environment:
        started = time.monotonic()
        ends = started + minutes * 60
        sampler = asyncio.create_task(_sample_memory(environment, result, started))
        try:
            while time.monotonic() < ends:
                # Each kind in turn leads a round, joined by up to two others at random: every
                # kind strikes in a run of len(KINDS) rounds, however slow the machine is.
                leading = KINDS[len(result.rounds) % len(KINDS)]
                others = [kind for kind in KINDS if kind != leading]
                faults = [leading, *rng.sample(others, rng.randint(0, 2))]
                plan = Plan(
                    f"round {len(result.rounds) + 1}",
                    faults=faults,
                    clients=8,
                    seed=rng.randrange(1 << 30),
                    shared_share=rng.uniform(0.2, 0.5),
                    resend_chance=rng.uniform(0.05, 0.3),
                    warmup=10,
                    between=10,
                )
                report = await run_scenario(environment, plan)
                result.rounds.append(report)
                print(
                    f"{report.title}: {', '.join(faults)}: "
                    f"{'ok' if report.ok else f'{len(report.violations)} VIOLATIONS'}",
                    flush=True,
                )
        finally:
            sampler.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sampler
    return result


def _memory_table(result: SoakResult) -> list[str]:
    lines = [
        "| gateway | first sample | then, once a minute | last | max | samples |",
        "|---|---|---|---|---|---|",
    ]
    for name, samples in result.rss.items():
        minute_marks: list[str] = []
        for minute in range(1, int(result.minutes) + 1):
            at = [kib for seconds, kib in samples if seconds <= minute * 60]
            if at and samples[-1][0] >= minute * 60:
                minute_marks.append(f"{minute}m: {at[-1] / 1024:.1f}")
        first, last = samples[0], samples[-1]
        lines.append(
            f"| {name} | {first[1] / 1024:.1f} MiB at {first[0]:.0f}s | "
            f"{', '.join(minute_marks) or '-'} | {last[1] / 1024:.1f} MiB at {last[0]:.0f}s | "
            f"{max(kib for _, kib in samples) / 1024:.1f} MiB | {len(samples)} |"
        )
    return lines


def render(result: SoakResult) -> str:
    report = result.report
    requests = report.counts.get("requests (HTTP attempts)", 0)
    lines = [
        "# Soak run",
        "",
        f"Written by `python -m tests.faults.soak --minutes {result.minutes:g}` on "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC ({platform.machine()}, Python "
        f"{platform.python_version()}). Three gateway processes share a private PostgreSQL "
        f"and a private Redis; lease {LEASE:g} s; eight SDK-like clients per round over an "
        "`on_ambiguous: fail` and an `on_ambiguous: retry` route; each fault kind leading a "
        "round in turn, with up to two others at random. "
        f"{len(result.rounds)} rounds, {report.seconds:.0f} s of load, "
        f"{requests} requests ({requests / max(report.seconds, 1):.0f}/s).",
        "",
        f"**Result: {len(report.violations) or 'no'} violation"
        f"{'' if len(report.violations) == 1 else 's'}.**",
        "",
        "```",
        report.table(),
        "```",
        "",
        "## Gateway memory (resident set, from /proc, MiB)",
        "",
        *_memory_table(result),
        "",
        "A gateway killed by a fault stops being sampled; its replacement starts a new row.",
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.faults.soak", description=__doc__)
    parser.add_argument("--minutes", type=float, default=3.0, help=f"at most {MAX_MINUTES:g}")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=SOAK_FILE)
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="gateway-soak-"))
    result = asyncio.run(soak(args.minutes, workdir=workdir, seed=args.seed))
    text = render(result)
    args.output.write_text(text, encoding="utf-8")
    print(text)
    print(f"gateway logs: {workdir}")
    return 0 if result.report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
