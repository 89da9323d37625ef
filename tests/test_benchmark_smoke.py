"""The benchmark harness runs end to end: ``python -m benchmarks --quick`` on two scenarios.

Real processes (the built-in upstream, a gateway on the test database) and the bundled load
generator, so neither nginx nor wrk is needed. It checks the shape of RESULTS.md and that load
went through, never how fast: the machine is shared and timings prove nothing here.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
COLUMNS = "| scenario | load | req/s | p50 (ms) | p99 (ms) | errors | vs baseline |"


def _row(text: str, scenario_id: str) -> list[str]:
    line = next(line for line in text.splitlines() if f"(`{scenario_id}`)" in line)
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def test_quick_run_writes_a_results_table(tmp_path: Path, postgres_url: str) -> None:
    output = tmp_path / "RESULTS.md"
    command = [
        sys.executable, "-m", "benchmarks", "--quick",
        "--builtin-upstream", "--builtin-loadgen", "--no-redis",
        "--scenarios", "direct,gw1-pass",
        "--duration", "1", "--warmup", "0.5", "--connections", "4",
        "--database-url", postgres_url,
        "--output", str(output),
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "[ 1/2] direct" in done.stdout  # progress, one line per scenario
    assert "[ 2/2] gw1-pass" in done.stdout

    text = output.read_text()
    assert text.startswith("# Benchmark results")
    assert "## Machine and versions" in text
    assert "## Targets" in text
    assert COLUMNS in text
    assert "bundled aiohttp generator" in text  # says which generator made the numbers
    for scenario_id in ("direct", "gw1-pass"):
        cells = _row(text, scenario_id)
        requests_per_second = float(cells[2].replace(",", ""))
        assert requests_per_second > 0, cells
        assert cells[5] == "0", cells  # no errors
    assert "x `minproxy`" not in text  # its baseline did not run: the ratio says n/a
    assert "n/a" in _row(text, "gw1-pass")[6]


def test_the_in_process_cost_harness_runs_every_scenario() -> None:
    command = [
        sys.executable, "-m", "benchmarks.app_cost",
        "--requests", "40", "--rounds", "2", "--concurrency", "4",
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    costs = {
        line.split()[0]: float(line.split()[2])
        for line in done.stdout.splitlines()
        if " min " in line
    }
    assert costs.keys() == {"pass", "replay", "new"}, done.stdout
    assert all(cost > 0 for cost in costs.values()), done.stdout


def test_instruction_counts_come_from_every_process_of_the_server(
    postgres_url: str, redis_url: str
) -> None:
    """``benchmarks.instructions``: a gateway under callgrind, briefly; ``serve`` and its
    worker are counted through the process tree (valgrind makes this test take a minute)."""
    command = [
        sys.executable, "-m", "benchmarks.instructions",
        "--scenarios", "gw1-pass", "--baseline", "gw1-pass",
        "--seconds", "1", "--warmup", "1", "--connections", "2",
        "--builtin-loadgen", "--postgres-url", postgres_url, "--redis-url", redis_url,
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {
        cells[0].strip("`"): cells
        for line in done.stdout.splitlines()
        if line.startswith("| `")
        for cells in [[cell.strip() for cell in line.strip().strip("|").split("|")]]
    }
    assert rows.keys() == {"gw1-pass"}, done.stdout
    cells = rows["gw1-pass"]
    assert int(cells[2].replace(",", "")) > 0, cells  # answers, none failed
    # Thousands of instructions per request: the worker alone runs hundreds of thousands, so
    # a count this low means its dump was missed (the process tree or the dump's name).
    assert float(cells[3].removesuffix(" k").replace(",", "")) > 100, cells
