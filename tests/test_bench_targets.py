"""The results' targets judge what each one says: the gateway's CPU per key against
PostgreSQL's, a second worker's CPU per key against one worker's, and the ratios of one run."""

from __future__ import annotations

from benchmarks.loadgen import LoadResult
from benchmarks.measure import CpuShares, Outcome
from benchmarks.report import Target, targets
from benchmarks.scenarios import SCENARIO_BY_ID


def _outcome(scenario: str, rps: float, *, server: float, postgres: float = 0.0) -> Outcome:
    requests = int(rps * 10)
    result = LoadResult(
        requests=requests, seconds=10.0, p50_ms=1.0, p99_ms=2.0, ok=requests, conflicts=0,
        other_status=0, socket_errors=0, replayed=None, generator="wrk", generator_cpu=0.1,
    )  # fmt: skip
    cpu = CpuShares({"server": server, "postgres": postgres})
    return Outcome(SCENARIO_BY_ID[scenario], scenario, result, cpu, connections=32, seconds=10.0)


def _by_name(outcomes: list[Outcome]) -> dict[str, Target]:
    return {target.name: target for target in targets({o.scenario.id: o for o in outcomes}, None)}


NEW_KEY_SHARE = "new key: gateway CPU per key <= 2x PostgreSQL's"
TWO_WORKERS = "2 workers, new keys: gateway CPU per key within 10% of 1 worker's"


def test_the_gateway_against_postgresql_per_key() -> None:
    # 1,000 keys/s: the gateway 1.0 core (1 ms a key), PostgreSQL 0.25 core (0.25 ms): 4x.
    four_times = _by_name([_outcome("gw1-new", 1000, server=1.0, postgres=0.25)])[NEW_KEY_SHARE]
    assert four_times.measured.startswith("4.0x (1.000 vs 0.250 ms")
    assert four_times.verdict == "missed by 100%"
    twice = _by_name([_outcome("gw1-new", 1000, server=0.5, postgres=0.25)])[NEW_KEY_SHARE]
    assert twice.verdict == "met"


def test_postgresql_not_measured_is_not_a_verdict() -> None:
    alone = _by_name([_outcome("gw1-new", 1000, server=1.0)])[NEW_KEY_SHARE]
    assert alone.verdict == "not measured"


def test_a_second_worker_per_key() -> None:
    one = _outcome("gw1-new", 1000, server=1.0)
    same = _by_name([one, _outcome("gw2-new", 1500, server=1.6)])[TWO_WORKERS]
    assert same.measured.startswith("+7% (1.067 vs 1.000 ms")
    assert same.verdict == "met"
    dearer = _by_name([one, _outcome("gw2-new", 1000, server=1.3)])[TWO_WORKERS]
    assert dearer.verdict == "missed by 20%"


def test_a_replay_against_both_of_its_baselines() -> None:
    found = _by_name(
        [
            _outcome("minproxy", 10_000, server=1.0),
            _outcome("gw1-pass", 8_000, server=1.0),
            _outcome("gw1-replay-redis", 11_000, server=1.0),
        ]
    )
    assert found["replay from Redis >= 1.2x minimal aiohttp proxy"].verdict == "missed by 8%"
    assert found["replay from Redis >= 1.25x pass-through"].verdict == "met"
    assert found["pass-through >= 1.0x minimal aiohttp proxy (1 worker)"].verdict == "missed by 20%"
