"""RESULTS.md: the machine, the versions, the targets, one table per scenario group."""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.measure import CPU_GROUPS, MemoryOutcome, Outcome
from benchmarks.scenarios import SCENARIO_BY_ID, TABLES

COLUMNS = (
    "| scenario | load | req/s | p50 (ms) | p99 (ms) | errors | vs baseline | "
    "CPU cores: " + " / ".join(CPU_GROUPS) + " | notes |"
)
PACKAGES = (
    "idempotency-gateway", "uvicorn", "uvloop", "httptools", "aiohttp", "asyncpg", "SQLAlchemy",
    "redis", "fastapi", "starlette", "asgi-idempotency-header", "granian", "pyreqwest",
)  # fmt: skip


@dataclass
class RunInfo:
    command: str
    started: str
    finished: str
    wall_seconds: float
    seconds: float
    warmup: float
    connections: int
    generator: str
    upstream: str
    quick: bool
    load_start: str
    load_end: str
    machine: dict[str, str] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def machine_facts() -> dict[str, str]:
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    memory = "unknown"
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory = f"{int(line.split()[1]) / 1024 / 1024:.1f} GiB"
                break
    except OSError:
        pass
    return {
        "CPU": model,
        "cores": str(os.cpu_count()),
        "memory": memory,
        "kernel": f"{platform.system()} {platform.release()}",
    }


def _tool_version(argv: Sequence[str]) -> str:
    if shutil.which(argv[0]) is None and not os.path.exists(argv[0]):
        return "not installed"
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    text = (done.stdout + done.stderr).strip().splitlines()
    return text[0] if text else "unknown"


def software_versions(
    *, postgres: str, redis: str | None, nginx: str | None, wrk: str | None
) -> dict[str, str]:
    versions = {"python": platform.python_version()}
    for package in PACKAGES:
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = "not installed"
    versions["PostgreSQL"] = postgres
    versions["Redis"] = redis or "not reachable"
    versions["wrk"] = _tool_version([wrk, "-v"]) if wrk else "not installed"
    versions["nginx"] = _tool_version([nginx, "-v"]) if nginx else "not installed"
    return versions


def _ms(value: float) -> str:
    return f"{value:.2f}"


def _rps(value: float) -> str:
    return f"{value:,.0f}"


def ratio(outcomes: Mapping[str, Outcome], scenario_id: str, baseline_id: str) -> float | None:
    mine, theirs = outcomes.get(scenario_id), outcomes.get(baseline_id)
    if mine is None or theirs is None or mine.result is None or theirs.result is None:
        return None
    if theirs.result.rps <= 0:
        return None
    return mine.result.rps / theirs.result.rps


def _notes(outcome: Outcome, outcomes: Mapping[str, Outcome]) -> str:
    result = outcome.result
    assert result is not None
    notes = []
    load = outcome.scenario.load
    baseline = outcomes.get(outcome.scenario.baseline or "")
    if load.connections == 1 and baseline is not None and baseline.result is not None:
        added = result.p50_ms - baseline.result.p50_ms
        notes.append(f"p50 {added:+.2f} ms over `{baseline.scenario.id}`")
    cpu_per_request = _cpu_per_request(outcome)
    if cpu_per_request is not None:
        notes.append(f"{cpu_per_request:.3f} ms CPU/req")
    postgres = _cpu_per_request(outcome, "postgres")
    if postgres:
        notes.append(f"PostgreSQL {postgres:.3f} ms CPU/req")
    if outcome.commits is not None and result.requests:
        notes.append(f"{outcome.commits / result.requests:.2f} commits/req")
    if load.count_statuses and result.requests:
        executed = result.ok - (result.replayed or 0)
        notes.append(
            f"409 (expected): {result.conflicts / result.requests:.1%}, "
            f"replayed: {(result.replayed or 0) / result.requests:.1%}, "
            f"executed: {executed / result.requests:.1%}"
        )
    if load.path == "/large":
        notes.append(f"{result.rps * 1.048576:,.0f} MB/s")
    if load.body_bytes >= 1024:
        notes.append(f"{result.rps * load.body_bytes / 1e6:,.0f} MB/s up")
    if result.generator_cpu >= 0.9 and result.generator.startswith("bundled"):
        notes.append("generator saturated")
    return "; ".join(notes)


def _row(outcome: Outcome, outcomes: Mapping[str, Outcome]) -> str:
    scenario = outcome.scenario
    name = f"{outcome.label} (`{scenario.id}`)"
    load = scenario.load.describe(outcome.connections)
    if outcome.result is None:
        return f"| {name} | {load} | skipped: {outcome.skipped} | | | | | | |"
    result = outcome.result
    versus = ""
    if scenario.baseline is not None:
        value = ratio(outcomes, scenario.id, scenario.baseline)
        versus = f"{value:.2f}x `{scenario.baseline}`" if value is not None else "n/a"
    cpu = outcome.cpu.describe() if outcome.cpu is not None else ""
    return (
        f"| {name} | {load} | {_rps(result.rps)} | {_ms(result.p50_ms)} | "
        f"{_ms(result.p99_ms)} | {result.errors} | {versus} | {cpu} | {_notes(outcome, outcomes)} |"
    )


@dataclass
class Target:
    name: str
    measured: str
    verdict: str  # met / missed by ... / not measured
    bound: str


def _cpu_per_request(outcome: Outcome, party: str = "server") -> float | None:
    """Milliseconds of ``party``'s CPU (a group of ``CPU_GROUPS``) per answered request."""
    if outcome.cpu is None or outcome.result is None or outcome.result.rps <= 0:
        return None
    return outcome.cpu.get(party) / outcome.result.rps * 1000


def bound_hint(outcome: Outcome | None, workers: int = 1) -> str:
    """What most likely limited a run, read from where the CPU went."""
    if outcome is None or outcome.cpu is None or outcome.result is None:
        return ""
    cpu = outcome.cpu
    cores = os.cpu_count() or 1
    total = sum(cpu.get(name) for name in CPU_GROUPS)
    hints = [f"{_cpu_per_request(outcome) or 0.0:.2f} ms of server CPU per request"]
    if outcome.connections == 1:
        hints.append("one request at a time: latency is the sum of the round trips and CPU")
    if cpu.get("server") >= 0.85 * workers:
        hints.append(f"server CPU-bound ({cpu.get('server'):.2f} cores for {workers} worker(s))")
    if total >= 0.9 * cores:
        hints.append(f"machine saturated ({total:.2f} of {cores} cores busy)")
    if cpu.get("loadgen") >= 0.9 and outcome.result.generator.startswith("bundled"):
        hints.append("load generator saturated (one core)")
    if cpu.get("postgres") >= 0.5:
        hints.append(f"PostgreSQL busy ({cpu.get('postgres'):.2f} cores)")
    if cpu.get("other") >= 0.3:
        hints.append(f"other work on the machine ({cpu.get('other'):.2f} cores)")
    if len(hints) == 1 and outcome.connections != 1:
        hints.append("no single party saturated")
    return "; ".join(hints)


def _ratio_target(
    outcomes: Mapping[str, Outcome], name: str, mine: str, base: str, floor: float, workers: int
) -> Target:
    value = ratio(outcomes, mine, base)
    if value is None:
        return Target(name, "", "not measured", "")
    mine_result, base_result = outcomes[mine].result, outcomes[base].result
    assert mine_result is not None
    assert base_result is not None
    measured = f"{value:.2f}x ({_rps(mine_result.rps)} vs {_rps(base_result.rps)} req/s)"
    mine_cpu, base_cpu = _cpu_per_request(outcomes[mine]), _cpu_per_request(outcomes[base])
    if mine_cpu and base_cpu:
        # Less sensitive to a shared machine than req/s: what each request cost its server.
        measured += (
            f"; per server CPU: {base_cpu / mine_cpu:.2f}x "
            f"({mine_cpu:.2f} vs {base_cpu:.2f} ms/req)"
        )
    verdict = "met" if value >= floor else f"missed by {(floor - value) / floor:.0%}"
    return Target(name, measured, verdict, bound_hint(outcomes.get(mine), workers))


def _latency_target(
    outcomes: Mapping[str, Outcome], name: str, mine: str, base: str, limit_ms: float
) -> Target:
    a, b = outcomes.get(mine), outcomes.get(base)
    if a is None or b is None or a.result is None or b.result is None:
        return Target(name, "", "not measured", "")
    added = a.result.p50_ms - b.result.p50_ms
    measured = f"+{added:.2f} ms (p50 {a.result.p50_ms:.2f} vs {b.result.p50_ms:.2f} ms)"
    verdict = "met" if added < limit_ms else f"missed by {added - limit_ms:.2f} ms"
    return Target(name, measured, verdict, bound_hint(a))


def _memory_target(memory: MemoryOutcome | None) -> Target:
    name = "resident memory per worker flat (within 10%) over 100,000 requests"
    if memory is None or not memory.growth:
        return Target(name, "", "not measured", "")
    worst = max(memory.growth.values())  # growth is what matters: a shrinking RSS is no leak
    measured = f"largest change {worst:+.1%} over {memory.requests:,} requests"
    if memory.reduced:
        measured += f" (reduced run: {memory.target_requests:,} requested)"
    verdict = "met" if worst <= 0.10 else f"missed by {worst - 0.10:.1%}"
    bound = "reduced count: not conclusive" if memory.reduced else ""
    return Target(name, measured, verdict, bound)


def _share_of_postgres_target(
    outcomes: Mapping[str, Outcome], name: str, mine: str, most: float
) -> Target:
    """The gateway's CPU per request at most ``most`` times what PostgreSQL spent on it."""
    outcome = outcomes.get(mine)
    gateway = _cpu_per_request(outcome) if outcome is not None else None
    postgres = _cpu_per_request(outcome, "postgres") if outcome is not None else None
    if not gateway or not postgres:
        return Target(name, "", "not measured", "")
    share = gateway / postgres
    measured = f"{share:.1f}x ({gateway:.3f} vs {postgres:.3f} ms of CPU per key)"
    verdict = "met" if share <= most else f"missed by {(share - most) / most:.0%}"
    return Target(name, measured, verdict, bound_hint(outcome))


def _same_cost_target(
    outcomes: Mapping[str, Outcome], name: str, mine: str, base: str, slack: float
) -> Target:
    """The server's CPU per request in ``mine`` within ``slack`` of ``base``'s."""
    a, b = outcomes.get(mine), outcomes.get(base)
    mine_cpu = _cpu_per_request(a) if a is not None else None
    base_cpu = _cpu_per_request(b) if b is not None else None
    if not mine_cpu or not base_cpu:
        return Target(name, "", "not measured", "")
    change = mine_cpu / base_cpu - 1
    measured = f"{change:+.0%} ({mine_cpu:.3f} vs {base_cpu:.3f} ms of server CPU per request)"
    verdict = "met" if change <= slack else f"missed by {change - slack:.0%}"
    return Target(name, measured, verdict, bound_hint(a, workers=2))


def targets(outcomes: Mapping[str, Outcome], memory: MemoryOutcome | None) -> list[Target]:
    """The release's targets: ratios to the minimal aiohttp proxy (the floor of a Python
    proxy on the same server and client), to a pass-through and to asgi-idempotency-header in
    the same run, and the gateway's CPU against PostgreSQL's for the same keys."""
    return [
        _ratio_target(outcomes, "pass-through >= 1.0x minimal aiohttp proxy (1 worker)",
                      "gw1-pass", "minproxy", 1.0, 1),
        _ratio_target(outcomes, "replay from Redis >= 1.2x minimal aiohttp proxy",
                      "gw1-replay-redis", "minproxy", 1.2, 1),
        _ratio_target(outcomes, "replay from Redis >= 1.25x pass-through",
                      "gw1-replay-redis", "gw1-pass", 1.25, 1),
        _ratio_target(outcomes, "new key, PostgreSQL + Redis >= 0.35x minimal aiohttp proxy",
                      "gw1-new", "minproxy", 0.35, 1),
        _share_of_postgres_target(outcomes, "new key: gateway CPU per key <= 2x PostgreSQL's",
                                  "gw1-new", 2.0),
        _ratio_target(outcomes, "library mode, durable on PostgreSQL >= 1.5x "
                      "asgi-idempotency-header (RedisBackend)",
                      "lib-gateway", "lib-header-redis", 1.5, 1),
        _same_cost_target(outcomes, "2 workers, new keys: gateway CPU per key within 10% of "
                          "1 worker's", "gw2-new", "gw1-new", 0.10),
        _latency_target(outcomes, "added p50 at 1 connection, pass-through < 0.15 ms",
                        "gw1-pass-1c", "direct-1c", 0.15),
        _latency_target(outcomes, "added p50 at 1 connection, new key < 1.5 ms",
                        "gw1-new-1c", "direct-post-1c", 1.5),
        _memory_target(memory),
    ]  # fmt: skip


def render(
    info: RunInfo,
    outcomes: Mapping[str, Outcome],
    memory: MemoryOutcome | None,
) -> str:
    lines = ["# Benchmark results", ""]
    lines.append(
        f"`{info.command}`, {info.started} to {info.finished} ({info.wall_seconds:.0f} s). "
        f"Each scenario: {info.warmup:g} s warm-up, then {info.seconds:g} s measured; "
        f"{info.connections} connections unless a row says otherwise. "
        f"Load generator: {info.generator}. Upstream: {info.upstream}."
    )
    if info.quick:
        lines += ["", "**Quick run** (`--quick`): short runs, a reduced memory check; "
                  "the numbers are a smoke test, not a measurement."]  # fmt: skip
    lines += [
        "",
        "Whatever else ran on the machine shows in the `other` CPU column (what the rest of "
        f"the machine used during each run; load average {info.load_start} at the start, "
        f"{info.load_end} at the end). Runs are short and a VM's speed drifts: compare ratios "
        "within this run rather than across runs.",
        "",
        "## Machine and versions",
        "",
        "| | |",
        "|---|---|",
    ]
    lines += [f"| {name} | {value} |" for name, value in info.machine.items()]
    lines += [f"| {name} | {value} |" for name, value in info.versions.items()]

    lines += ["", "## Targets", "", "| target | measured | result | what bounds it |"]
    lines.append("|---|---|---|---|")
    for target in targets(outcomes, memory):
        lines.append(f"| {target.name} | {target.measured} | {target.verdict} | {target.bound} |")

    for table in TABLES:
        rows = [o for o in outcomes.values() if o.scenario.table == table]
        if not rows:
            continue
        lines += ["", f"## {table}", "", COLUMNS, header_separator(COLUMNS)]
        lines += [_row(outcome, outcomes) for outcome in rows]

    if memory is not None:
        lines += ["", "## Resident memory per worker", ""]
        lines.append(
            f"{memory.server_label}: {memory.requests:,} requests in {memory.seconds:.0f} s "
            "(pass-through, then new keys), RSS read from /proc before and after."
        )
        if memory.reduced:
            lines.append(
                f"Reduced run: {memory.target_requests:,} requests requested instead of 100,000."
            )
        lines += ["", "| worker pid | RSS before (MiB) | RSS after (MiB) | change |"]
        lines.append("|---|---|---|---|")
        for pid, before in memory.rss_before_kib.items():
            after = memory.rss_after_kib.get(pid, 0)
            change = memory.growth.get(pid)
            shown = f"{change:+.1%}" if change is not None else "worker gone"
            lines.append(f"| {pid} | {before / 1024:.1f} | {after / 1024:.1f} | {shown} |")

    lines += ["", "## Notes", ""]
    lines += [f"- {note}" for note in info.notes]
    lines += [
        "- Errors are non-2xx answers plus socket errors (connect, read, write, timeout); in "
        "the storm the 409s are expected answers and are reported as a share instead.",
        "- CPU cores: user+system CPU time from /proc over the measured run divided by its "
        "wall time. `server` is the process under test with its workers, `postgres` every "
        "PostgreSQL backend on the machine, `other` the rest of the machine.",
        "- `vs baseline` is the ratio of throughputs (req/s) to the named scenario of the same "
        "run.",
    ]
    return "\n".join(lines) + "\n"


def header_separator(columns: str) -> str:
    return "|" + "---|" * (columns.count("|") - 1)


def compare_known(outcomes: Mapping[str, Outcome]) -> list[str]:
    """Scenario ids whose baseline was not part of the run (their ratio reads n/a)."""
    return [
        o.scenario.id
        for o in outcomes.values()
        if o.scenario.baseline is not None
        and o.scenario.baseline not in outcomes
        and o.scenario.baseline in SCENARIO_BY_ID
    ]
