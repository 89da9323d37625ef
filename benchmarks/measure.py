"""One measured scenario: CPU of every party around a load run, and the memory check."""

from __future__ import annotations

import http.client
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from benchmarks.loadgen import Load, LoadGenerator, LoadResult, RunParameters, json_body
from benchmarks.processes import (
    ManagedProcess,
    cpu_seconds,
    machine_cpu_seconds,
    pids_named,
    rss_kib,
    uvicorn_workers,
)
from benchmarks.scenarios import Scenario

CPU_GROUPS = ("server", "upstream", "postgres", "redis", "loadgen", "other")


@dataclass
class CpuShares:
    """Cores kept busy during the measured run, by party (1.0 = one core all the time)."""

    cores: dict[str, float] = field(default_factory=dict)

    def get(self, name: str) -> float:
        return self.cores.get(name, 0.0)

    def describe(self) -> str:
        return " / ".join(f"{max(0.0, self.get(name)):.2f}" for name in CPU_GROUPS)


@dataclass
class Outcome:
    scenario: Scenario
    label: str  # the server as it ran (without Redis, say, when Redis was not there)
    result: LoadResult | None = None
    cpu: CpuShares | None = None
    skipped: str | None = None
    connections: int = 0
    seconds: float = 0.0
    commits: int | None = None
    """Transactions committed on the bench database during the measured run."""


@dataclass
class MemoryOutcome:
    server_label: str
    requests: int
    seconds: float
    rss_before_kib: dict[int, int]
    rss_after_kib: dict[int, int]
    target_requests: int
    reduced: bool  # --quick or --memory-requests made it smaller than 100,000

    @property
    def growth(self) -> dict[int, float]:
        return {
            pid: (self.rss_after_kib[pid] - before) / before
            for pid, before in self.rss_before_kib.items()
            if before and pid in self.rss_after_kib
        }


def _cpu_by_pid(pids: Sequence[int]) -> dict[int, float]:
    return {pid: cpu_seconds([pid]) for pid in pids}


def _delta(before: Mapping[int, float], after: Mapping[int, float]) -> float:
    # A process that appeared during the run counts from zero; one that vanished, not at all.
    return sum(value - before.get(pid, 0.0) for pid, value in after.items())


def warm_key(port: int, load: Load, key: str) -> int:
    """Send one request with ``key`` so the replay scenarios replay from the first request."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        connection.request(
            load.method,
            load.path,
            body=json_body(load.body_bytes) if load.body_bytes else None,
            headers={"Content-Type": "application/json", "Idempotency-Key": key},
        )
        response = connection.getresponse()
        response.read()
        return response.status
    finally:
        connection.close()


def warm_up(
    generator: LoadGenerator, scenario: Scenario, port: int, *, connections: int, seconds: float
) -> tuple[str, str]:
    """Load a started server for ``seconds`` (its replayed key stored first); the base URL and
    the key nonce the measured run then uses (fixed-key loads replay the warmed key)."""
    base_url = f"http://127.0.0.1:{port}"
    nonce = f"{scenario.id}-{time.time_ns()}"
    if scenario.warm_key:
        warm_key(port, scenario.load, nonce)
    warm_nonce = nonce if scenario.load.keys == "fixed" else nonce + "-warm"
    generator.run(RunParameters(base_url, scenario.load, connections, seconds, warm_nonce))
    return base_url, nonce


def measure(
    generator: LoadGenerator,
    parameters: RunParameters,
    *,
    server: ManagedProcess,
    upstream: ManagedProcess,
) -> tuple[LoadResult, CpuShares]:
    """Run the load once and account for the CPU every party used meanwhile."""
    groups: dict[str, list[int]] = {
        "server": server.tree(),
        "upstream": upstream.tree() if upstream is not server else [],
        "postgres": pids_named("postgres"),
        "redis": pids_named("redis-server"),
    }
    before = {name: _cpu_by_pid(pids) for name, pids in groups.items()}
    busy_before, _ = machine_cpu_seconds()
    started = time.monotonic()
    result = generator.run(parameters)
    wall = time.monotonic() - started
    busy_after, _ = machine_cpu_seconds()
    groups["postgres"] = sorted(set(groups["postgres"]) | set(pids_named("postgres")))
    after = {name: _cpu_by_pid(pids) for name, pids in groups.items()}
    cores = {name: _delta(before[name], after[name]) / wall for name in groups}
    cores["loadgen"] = result.generator_cpu * result.seconds / wall
    ours = sum(cores.values())
    cores["other"] = max(0.0, (busy_after - busy_before) / wall - ours)
    return result, CpuShares(cores)


def memory_check(
    generator: LoadGenerator,
    *,
    server: ManagedProcess,
    server_label: str,
    workers: int,
    base_url: str,
    connections: int,
    target_requests: int,
    rates: tuple[float, float],
    nonce: str,
    reduced: bool,
    max_seconds: float,
    share_pass: float,
    loads: tuple[Load, Load],
    warmup: float,
) -> MemoryOutcome:
    """RSS of every worker before and after ``target_requests`` (pass-through, then new keys).

    A short warm-up of the same mix comes first, so "before" is a worker that has already
    served this traffic. The request count is reached through durations computed from the
    throughputs measured earlier in the run (``rates``), each run bounded by ``max_seconds``.
    """
    for index, load in enumerate(loads):
        if warmup > 0:
            generator.run(RunParameters(base_url, load, connections, warmup, f"{nonce}-w{index}"))
    pids = uvicorn_workers(server, workers)
    before = {pid: rss_kib(pid) or 0 for pid in pids}
    requests, seconds = 0, 0.0
    wanted = (target_requests * share_pass, target_requests * (1 - share_pass))
    for index, (load, rate, count) in enumerate(zip(loads, rates, wanted, strict=True)):
        done, spent, chunk = 0, 0.0, 0
        # Chunks sized from the last throughput seen, until the count or the time bound.
        while done < count and spent < max_seconds:
            chunk += 1
            left = min(max_seconds - spent, math.ceil((count - done) / max(rate, 1.0) * 1.05))
            result = generator.run(
                RunParameters(
                    base_url, load, connections, max(1.0, left), f"{nonce}-{index}-{chunk}"
                )
            )
            done += result.requests
            spent += result.seconds
            rate = result.rps or rate
        requests += done
        seconds += spent
    after = {pid: rss_kib(pid) or 0 for pid in pids}
    return MemoryOutcome(
        server_label, requests, seconds, before, after, target_requests, reduced=reduced
    )
