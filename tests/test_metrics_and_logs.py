"""What operators watch: Prometheus metrics, structured logs and readiness (contract section 8).

Proves that ``/metrics`` on the admin port counts known traffic exactly, summed over the
workers of ``serve --workers 2`` whichever worker answers the scrape (each worker is made to
serve part of the traffic by stopping the other one for a moment); that no path, key or
credential ever becomes a label; that ``--log-format json`` writes one JSON line per request
with its request id, route, upstream, outcome, attempts, status, duration and scope hash, and
``--log-format text`` the same as ``key=value`` (with the key's hash, as the admin lookup by
key shows it), neither ever holding the credential, the key or the body; that one worker and
two show the same metric families, none a ``_created`` one, ``pid`` only on ``process_*``;
that a request the upstream never saw counts as ``not_executed``; and that ``/readyz``
follows PostgreSQL down and back up (cut for one gateway by a TCP proxy, the shared server
keeps running) while an unreachable Redis only degrades it.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import re
import signal
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from idempotency_gateway.idempotency.keys import key_hash, tenant_of
from tests.support import GatewayProcess, RecordingUpstream, eventually, free_port
from tests.support.charges import CHARGE, CHARGES
from tests.support.gateway import gateway_config, route
from tests.support.keyed import is_replay, send_keyed
from tests.support.servers import TEST_SCOPE_SECRET, StartGatewayProcess
from tests.support.tcp_proxy import TcpProxy
from tests.support.upstream import BEHAVIOR_HEADER, KEY_HEADER

pytestmark = pytest.mark.multiprocess

ROUTE = "charges"
WORKER_STARTED = re.compile(r"Started server process \[(\d+)\]")


# ----------------------------------------------------------------------------- helpers


def unique_upstream() -> str:
    """Breaker overrides are shared by name through PostgreSQL: never reuse another test's."""
    return f"payments-{uuid.uuid4().hex[:12]}"


def charges_config(upstream_url: str, upstream_name: str) -> dict[str, Any]:
    """Route ``charges`` (``/v1/charges``, key required, one attempt) and an open route ``/``."""
    config = gateway_config(
        upstream_url,
        upstreams={upstream_name: {"url": upstream_url, "retry": {"max_attempts": 1}}},
        routes=[
            route(CHARGES, name=ROUTE, upstream=upstream_name, key="required"),
            route("/", name="everything-else", upstream=upstream_name),
        ],
    )
    return config.model_dump(mode="json")


def metric_samples(scrape: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a Prometheus text scrape, by name and label set."""
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(scrape)
        for sample in family.samples
    }


# The status class each outcome's requests answered with in these tests.
STATUS_CLASS = {
    "executed": "2xx",
    "replayed": "2xx",
    "unprotected": "2xx",
    "mismatch": "4xx",
    "conflict_in_flight": "4xx",
    "rejected": "4xx",
}


def requests_of(scrape: str, route: str, outcome: str) -> float | None:
    """``requests_total`` of ``route`` and ``outcome`` (with the status class it answers)."""
    return value_of(
        scrape,
        "idempotency_gateway_requests_total",
        route=route,
        outcome=outcome,
        status_class=STATUS_CLASS[outcome],
    )


def value_of(scrape: str, name: str, **labels: str) -> float | None:
    """The sample ``name{labels}``; None when the scrape does not have it."""
    return metric_samples(scrape).get((name, frozenset(labels.items())))


async def scrape(client: httpx.AsyncClient, gateway: GatewayProcess) -> str:
    response = await client.get(gateway.admin_url + "/metrics")
    assert response.status_code == 200, response.text
    return response.text


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    """For absolute URLs. No keep-alive: every request is a new connection, accepted by
    whichever worker of the gateway is free to accept it."""
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=15.0, limits=limits, trust_env=False) as http:
        yield http


async def charge(
    client: httpx.AsyncClient, gateway: GatewayProcess, key: str, **options: Any
) -> httpx.Response:
    """``send_keyed`` (POST /v1/charges with the shared test credential) to ``gateway``."""
    return await send_keyed(client, key, path=gateway.url + CHARGES, **options)


# ------------------------------------------------------------------------------ metrics


async def worker_pids(gateway: GatewayProcess, count: int) -> list[int]:
    """The pids of ``count`` workers, once each has finished its startup."""

    def started() -> list[int] | None:
        log = gateway.log_text()
        pids = [int(pid) for pid in WORKER_STARTED.findall(log)]
        ready = log.count("Application startup complete")
        return pids if len(pids) == count and ready == count else None

    return await eventually(started, timeout=20.0, message=f"{count} workers started")


async def start_two_workers(
    start_gateway_process: StartGatewayProcess,
    config: dict[str, Any],
    postgres_url: str,
    metrics_directory: Path,
) -> tuple[GatewayProcess, list[int]]:
    """``serve --workers 2`` writing its metric files into ``metrics_directory`` (ours, to see
    which process wrote what); the gateway and its two workers' pids once both started."""
    gateway = await start_gateway_process(
        config,
        env={
            "GATEWAY_DATABASE_URL": postgres_url,
            "PROMETHEUS_MULTIPROC_DIR": str(metrics_directory),
        },
        extra_args=["--workers", "2"],
    )
    return gateway, await worker_pids(gateway, 2)


@contextlib.contextmanager
def only_worker(serving: int, workers: Sequence[int]) -> Iterator[None]:
    """SIGSTOP every other worker: new connections on the shared sockets can only be
    accepted by ``serving``. Kept short; uvicorn restarts a worker silent for 5 s."""
    stopped = [pid for pid in workers if pid != serving]
    for pid in stopped:
        os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for pid in stopped:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)


async def requests_counted(
    client: httpx.AsyncClient, gateway: GatewayProcess, expected: dict[str, int]
) -> None:
    """Wait until ``requests_total`` of route ``charges`` shows ``expected`` (outcome: count).
    A request is counted just after its last byte left, so a worker must not be stopped
    before this holds for the requests it served."""

    async def counted() -> dict[str, float | None] | None:
        text = await scrape(client, gateway)
        found = {outcome: requests_of(text, ROUTE, outcome) for outcome in expected}
        return found if found == expected else None

    await eventually(counted, timeout=3.0, message=f"requests counted: {expected}")


async def test_metrics_count_known_traffic_summed_over_two_workers(
    tmp_path: Path,
    upstream: RecordingUpstream,
    start_gateway_process: StartGatewayProcess,
    client: httpx.AsyncClient,
    postgres_url: str,
    unique: Callable[[str], str],
) -> None:
    payments = unique_upstream()
    metrics_directory = tmp_path / "metrics"
    metrics_directory.mkdir()
    gateway, workers = await start_two_workers(
        start_gateway_process,
        charges_config(upstream.url, payments),
        postgres_url,
        metrics_directory,
    )
    worker_a, worker_b = workers
    keys = [unique(f"metrics-{n}") for n in range(7)]

    async def send(key: str, **options: Any) -> httpx.Response:
        return await charge(client, gateway, key, **options)

    with only_worker(worker_a, workers):
        for key in keys[0:3]:
            assert (await send(key)).status_code == 201  # executed, cache miss
        for _ in range(2):
            assert is_replay(await send(keys[0]))  # replayed from A's cache: hit
        await requests_counted(client, gateway, {"executed": 3, "replayed": 2})
    with only_worker(worker_b, workers):
        for key in keys[3:6]:
            assert (await send(key)).status_code == 201  # executed, cache miss
        assert is_replay(await send(keys[0]))  # B has no copy: miss, replayed from the store
        assert is_replay(await send(keys[0]))  # now B has it: hit
        mismatch = await send(keys[3], json={**CHARGE, "amount": 1})  # cache hit, other request
        assert mismatch.status_code == 422

        gated = asyncio.create_task(send(keys[6], behavior="gate=metrics"))
        await upstream.wait_arrived("metrics")
        conflict = await send(keys[6])  # miss (not finished), reserve finds it in flight
        assert conflict.status_code == 409
        upstream.release("metrics")
        assert (await gated).status_code == 201

        executed, replayed = 7, 4
        await requests_counted(
            client,
            gateway,
            {"executed": executed, "replayed": replayed, "mismatch": 1, "conflict_in_flight": 1},
        )

    # Whichever worker answers the scrape, it shows the sums over both.
    for serving in workers:
        with only_worker(serving, workers):
            text = await scrape(client, gateway)
        for outcome, count in [
            ("executed", executed),
            ("replayed", replayed),
            ("mismatch", 1),
            ("conflict_in_flight", 1),
        ]:
            assert requests_of(text, ROUTE, outcome) == count
            assert (
                value_of(
                    text,
                    "idempotency_gateway_request_duration_seconds_count",
                    route=ROUTE,
                    outcome=outcome,
                )
                == count
            )
        # Every keyed request looked in its worker's cache once; each new key and each
        # duplicate the cache could not answer reserved once.
        assert value_of(text, "idempotency_gateway_cache_lookups_total", result="hit") == 4
        assert value_of(text, "idempotency_gateway_cache_lookups_total", result="miss") == 9
        assert (
            value_of(text, "idempotency_gateway_store_latency_seconds_count", operation="reserve")
            == 9
        )
        assert (
            value_of(
                text, "idempotency_gateway_upstream_attempts_total", upstream=payments, result="2xx"
            )
            == executed
        )
        assert value_of(text, "idempotency_gateway_breaker_state", upstream=payments) == 0
    assert upstream.total == executed
    # The pinning worked: each worker observed request durations of its own.
    for pid in workers:
        assert (metrics_directory / f"histogram_{pid}.db").exists(), pid


def families_of(scrape: str) -> dict[str, set[str]]:
    """Each family of a scrape and the label names its samples carry."""
    return {
        family.name: {name for sample in family.samples for name in sample.labels}
        for family in text_string_to_metric_families(scrape)
    }


async def test_one_worker_and_two_workers_show_the_same_metric_families(
    upstream: RecordingUpstream,
    start_gateway_process: StartGatewayProcess,
    client: httpx.AsyncClient,
    postgres_url: str,
    unique: Callable[[str], str],
) -> None:
    config = charges_config(upstream.url, unique_upstream())
    env = {"GATEWAY_DATABASE_URL": postgres_url}
    one, two = await asyncio.gather(
        start_gateway_process(config, env=env),
        start_gateway_process(config, env=env, extra_args=["--workers", "2"]),
    )
    await worker_pids(two, 2)
    before = {gateway.port: families_of(await scrape(client, gateway)) for gateway in (one, two)}
    for gateway in (one, two):
        assert (await charge(client, gateway, unique("families"))).status_code == 201
    after = {gateway.port: families_of(await scrape(client, gateway)) for gateway in (one, two)}

    assert before[one.port].keys() == before[two.port].keys()
    assert after[one.port].keys() == after[two.port].keys() == before[one.port].keys()
    for families in (*before.values(), *after.values()):
        # Present before the first request, so rate() and absent() mean the same everywhere.
        for name in ("requests", "request_duration_seconds", "upstream_attempts", "takeovers"):
            assert f"idempotency_gateway_{name}" in families
        assert not any(name.endswith("_created") for name in families)
        with_pid = {name for name, labels in families.items() if "pid" in labels}
        assert with_pid == {
            "process_cpu_seconds",
            "process_resident_memory_bytes",
            "process_start_time_seconds",
            "process_open_fds",
        }


async def test_a_request_the_upstream_never_saw_is_counted_not_executed(
    start_gateway_process: StartGatewayProcess,
    client: httpx.AsyncClient,
    postgres_url: str,
    unique: Callable[[str], str],
) -> None:
    # Nobody listens on the upstream's port: every connection is refused, nothing is sent.
    refused = f"http://127.0.0.1:{free_port()}"
    gateway = await start_gateway_process(
        charges_config(refused, unique_upstream()), env={"GATEWAY_DATABASE_URL": postgres_url}
    )
    keyed = await charge(client, gateway, unique("refused"))
    unkeyed = await client.post(gateway.url + "/v1/refunds", json=CHARGE)
    assert keyed.status_code == unkeyed.status_code == 502

    def not_executed(text: str, route: str) -> float | None:
        return value_of(
            text,
            "idempotency_gateway_requests_total",
            route=route,
            outcome="not_executed",
            status_class="5xx",
        )

    async def counted() -> str | None:
        text = await scrape(client, gateway)
        return text if not_executed(text, "everything-else") == 1 else None

    text = await eventually(counted, timeout=5.0, message="both refusals counted")
    assert not_executed(text, ROUTE) == 1
    assert not any(
        sample.labels.get("outcome") in ("executed", "unprotected")
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if family.name == "idempotency_gateway_requests"
    )


async def test_metric_labels_never_hold_paths_keys_or_credentials(
    upstream: RecordingUpstream,
    start_gateway_process: StartGatewayProcess,
    client: httpx.AsyncClient,
    postgres_url: str,
) -> None:
    payments = unique_upstream()
    gateway = await start_gateway_process(
        charges_config(upstream.url, payments),
        env={"GATEWAY_DATABASE_URL": postgres_url},
    )
    marker = f"m{uuid.uuid4().hex[:10]}"
    credential = {"Authorization": f"Bearer sk_{marker}"}
    base = gateway.url

    for n in range(15):
        keyed = {**credential, KEY_HEADER: f"{marker}-key-{n}"}
        answers = [
            await client.post(f"{base}{CHARGES}/{marker}-{n}", json=CHARGE, headers=keyed),
            await client.post(f"{base}/{marker}/{n}", json=CHARGE, headers=keyed),
            await client.get(f"{base}/{marker}/{n}?q={marker}", headers=credential),
            await client.post(
                base + CHARGES, json=CHARGE, headers={**credential, KEY_HEADER: f"{marker} {n}"}
            ),
        ]
        assert [answer.status_code for answer in answers] == [201, 201, 201, 400]
    assert upstream.total == 45

    async def all_counted() -> str | None:
        text = await scrape(client, gateway)
        counts = {
            (route_name, outcome): requests_of(text, route_name, outcome)
            for route_name, outcome in [
                (ROUTE, "executed"),
                (ROUTE, "rejected"),
                ("everything-else", "executed"),
                ("everything-else", "unprotected"),
            ]
        }
        return text if set(counts.values()) == {15} else None

    text = await eventually(all_counted, message="every request counted")

    assert marker not in text
    assert "sk_" not in text
    assert {
        value for _, labels in metric_samples(text) for label, value in labels if label == "route"
    } <= {ROUTE, "everything-else", "-"}


def pids_in(scrape_text: str, name: str) -> set[int]:
    """The ``pid`` labels of the samples of ``name``."""
    return {
        int(value)
        for (sample, labels) in metric_samples(scrape_text)
        if sample == name
        for label, value in labels
        if label == "pid"
    }


async def test_a_dead_workers_gauges_go_with_it_and_every_live_worker_reports_itself(
    tmp_path: Path,
    upstream: RecordingUpstream,
    start_gateway_process: StartGatewayProcess,
    client: httpx.AsyncClient,
    postgres_url: str,
) -> None:
    """Worker A's breaker opens (so its gauge says 2, the worst over workers); A is killed
    with SIGKILL: the gauge falls back to what live workers see, A's process metrics vanish
    and its replacement's appear. Counters keep A's requests."""
    payments = unique_upstream()
    metrics_directory = tmp_path / "metrics"
    metrics_directory.mkdir()
    config = charges_config(upstream.url, payments)
    config["upstreams"][payments]["breaker"] = {"min_calls": 2, "open_for": "300s"}
    gateway, workers = await start_two_workers(
        start_gateway_process, config, postgres_url, metrics_directory
    )
    worker_a, worker_b = workers
    failing = {BEHAVIOR_HEADER: "status=500"}
    with only_worker(worker_a, workers):
        for _ in range(2):
            answer = await client.get(gateway.url + "/v1/refunds", headers=failing)
            assert answer.status_code == 500
        text = await scrape(client, gateway)
    breaker = "idempotency_gateway_breaker_state"
    assert value_of(text, breaker, upstream=payments) == 2  # open, in A
    assert pids_in(text, "process_cpu_seconds_total") >= {worker_a, worker_b}
    version = {
        dict(labels).get("version")
        for (name, labels) in metric_samples(text)
        if name == "idempotency_gateway_build_info"
    }
    assert version == {importlib.metadata.version("idempotency-gateway")}
    server_errors = {"route": "everything-else", "outcome": "unprotected", "status_class": "5xx"}
    assert value_of(text, "idempotency_gateway_requests_total", **server_errors) == 2

    os.kill(worker_a, signal.SIGKILL)

    async def forgotten() -> str | None:
        text = await scrape(client, gateway)
        processes = pids_in(text, "process_cpu_seconds_total")
        replaced = worker_a not in processes and len(processes - {worker_a, worker_b}) >= 1
        closed = value_of(text, breaker, upstream=payments) == 0
        return text if replaced and closed else None

    text = await eventually(forgotten, timeout=20.0, message="worker A's gauges dropped")
    assert worker_b in pids_in(text, "process_resident_memory_bytes")
    assert not list(metrics_directory.glob(f"gauge_live*_{worker_a}.db"))
    assert value_of(text, "idempotency_gateway_requests_total", **server_errors) == 2


# ------------------------------------------------------------------------------ logging


@pytest.fixture
def secret() -> str:
    return f"sk_live_{uuid.uuid4().hex}"


@dataclass(frozen=True)
class Logged:
    """What the access line of one request must say."""

    outcome: str
    route: str
    status: int
    attempts: int
    proxied: bool  # the request reached the upstream, so the line names it
    keyed: bool  # the request had a valid key, so the line carries the scope hash


# One request of each kind, in the order ``logged_traffic`` sends them.
EXPECTED_LINES = [
    Logged("executed", ROUTE, 201, attempts=1, proxied=True, keyed=True),
    Logged("replayed", ROUTE, 201, attempts=0, proxied=False, keyed=True),
    Logged("mismatch", ROUTE, 422, attempts=0, proxied=False, keyed=True),
    Logged("rejected", ROUTE, 400, attempts=0, proxied=False, keyed=False),
    Logged("unprotected", "everything-else", 201, attempts=1, proxied=True, keyed=False),
]


@dataclass(frozen=True)
class LoggedTraffic:
    gateway: GatewayProcess
    upstream_name: str
    answers: list[httpx.Response]
    marker: str
    """In every body and key the gateway saw; it must never reach the log."""


SendLoggedTraffic = Callable[[str], Awaitable[LoggedTraffic]]


@pytest.fixture
def send_logged_traffic(
    upstream: RecordingUpstream,
    start_gateway_process: StartGatewayProcess,
    client: httpx.AsyncClient,
    postgres_url: str,
    secret: str,
) -> SendLoggedTraffic:
    """``await send_logged_traffic(log_format)``: a gateway logging in ``log_format`` and the
    requests of ``EXPECTED_LINES``, each with the secret credential and a body (and key)
    holding a marker."""

    async def send(log_format: str) -> LoggedTraffic:
        upstream_name = unique_upstream()
        gateway = await start_gateway_process(
            charges_config(upstream.url, upstream_name),
            env={"GATEWAY_DATABASE_URL": postgres_url},
            extra_args=["--log-format", log_format],
        )
        marker = f"marker{uuid.uuid4().hex[:10]}"
        body = {"card": f"{marker}-card-number", "amount": 1000}
        keyed = {"Authorization": f"Bearer {secret}", KEY_HEADER: f"{marker}-key"}
        unkeyed = {"Authorization": f"Bearer {secret}"}
        answers = [
            await client.post(gateway.url + CHARGES, json=body, headers=keyed),
            await client.post(gateway.url + CHARGES, json=body, headers=keyed),
            await client.post(gateway.url + CHARGES, json={**body, "amount": 1}, headers=keyed),
            await client.post(gateway.url + CHARGES, json=body, headers=unkeyed),
            await client.post(gateway.url + "/v1/refunds", json=body, headers=unkeyed),
        ]
        expected_statuses = [line.status for line in EXPECTED_LINES]
        assert [answer.status_code for answer in answers] == expected_statuses
        return LoggedTraffic(gateway, upstream_name, answers, marker)

    return send


def scope_hash_of(secret: str) -> str:
    return tenant_of(
        [(b"authorization", f"Bearer {secret}".encode())],
        (b"authorization",),
        secret=TEST_SCOPE_SECRET.encode(),
    )


def assert_no_secrets(traffic: LoggedTraffic, secret: str) -> None:
    log = traffic.gateway.log_text()
    assert secret not in log
    assert traffic.marker not in log  # neither a body nor a key


async def test_json_logs_have_one_line_per_request_and_no_secrets(
    send_logged_traffic: SendLoggedTraffic, secret: str
) -> None:
    traffic = await send_logged_traffic("json")

    def access_lines() -> list[dict[str, Any]] | None:
        # Every line is JSON: a line that is not fails the test here.
        lines = [json.loads(line) for line in traffic.gateway.log_text().splitlines() if line]
        requests = [line for line in lines if line["logger"] == "idempotency_gateway.access"]
        return requests if len(requests) >= len(EXPECTED_LINES) else None

    logged = await eventually(access_lines, message="an access line per request")
    [worker] = await worker_pids(traffic.gateway, 1)

    assert len(logged) == len(EXPECTED_LINES)
    for line, answer, expected in zip(logged, traffic.answers, EXPECTED_LINES, strict=True):
        request = line["request"]
        assert (line["level"], line["message"]) == ("info", "request")
        assert (line["request_id"], line["pid"]) == (answer.headers["X-Request-Id"], worker)
        assert request["request_id"] == answer.headers["X-Request-Id"]
        assert request["route"] == expected.route
        assert request["outcome"] == expected.outcome
        assert request["attempts"] == expected.attempts
        assert request["status"] == expected.status
        assert request["upstream"] == (traffic.upstream_name if expected.proxied else None)
        assert request["scope_hash"] == (scope_hash_of(secret) if expected.keyed else None)
        # What GET /admin/records/by-key shows: the line and the record join on it.
        assert request.get("key_hash") == (
            key_hash(f"{traffic.marker}-key") if expected.keyed else None
        )
        assert isinstance(request["duration_ms"], float)
        assert request["duration_ms"] > 0
    assert_no_secrets(traffic, secret)


async def test_text_logs_write_key_value_lines_and_no_secrets(
    send_logged_traffic: SendLoggedTraffic, secret: str
) -> None:
    traffic = await send_logged_traffic("text")

    def access_lines() -> list[str] | None:
        lines = [
            line
            for line in traffic.gateway.log_text().splitlines()
            if "idempotency_gateway.access: request " in line
        ]
        return lines if len(lines) >= len(EXPECTED_LINES) else None

    logged = await eventually(access_lines, message="an access line per request")

    assert len(logged) == len(EXPECTED_LINES)
    for line, answer, expected in zip(logged, traffic.answers, EXPECTED_LINES, strict=True):
        fields = dict(re.findall(r" (\w+)=(\S+)", line))
        assert fields["request_id"] == answer.headers["X-Request-Id"]
        assert fields["route"] == expected.route
        assert fields["outcome"] == expected.outcome
        assert fields["attempts"] == str(expected.attempts)
        assert fields["status"] == str(expected.status)
        assert fields.get("upstream") == (traffic.upstream_name if expected.proxied else None)
        assert fields.get("scope_hash") == (scope_hash_of(secret) if expected.keyed else None)
        assert fields.get("key_hash") == (
            key_hash(f"{traffic.marker}-key") if expected.keyed else None
        )
        assert float(fields["duration_ms"]) > 0
    assert not any(line.startswith("{") for line in traffic.gateway.log_text().splitlines())
    assert_no_secrets(traffic, secret)


def json_lines(gateway: GatewayProcess) -> list[dict[str, Any]]:
    return [json.loads(line) for line in gateway.log_text().splitlines() if line]


async def test_retry_startup_and_admin_lines_say_who_what_and_where(
    upstream: RecordingUpstream,
    start_gateway_process: StartGatewayProcess,
    client: httpx.AsyncClient,
    postgres_url: str,
) -> None:
    """Decision lines inside a request carry its request id; the supervisor's startup line
    names ports, store, cache and routes (never the database password); an admin action
    says what it did and from which address."""
    payments = unique_upstream()
    password = f"pw{uuid.uuid4().hex[:12]}"
    # PostgreSQL trusts loopback here, so the password is ignored but must stay unlogged.
    database_url = postgres_url.replace("postgres@", f"postgres:{password}@")
    assert password in database_url
    gateway = await start_gateway_process(
        charges_config(upstream.url, payments),
        env={"GATEWAY_DATABASE_URL": database_url, "GATEWAY_ADMIN_TOKEN": "signals-admin-token"},
        extra_args=["--log-format", "json"],
    )
    [worker] = await worker_pids(gateway, 1)
    failed = await client.get(gateway.url + "/v1/refunds", headers={BEHAVIOR_HEADER: "status=503"})
    assert failed.status_code == 503
    forced = await client.put(
        f"{gateway.admin_url}/admin/breakers/{payments}",
        json={"state": "forced_open"},
        headers={"Authorization": "Bearer signals-admin-token"},
    )
    assert forced.status_code == 200, forced.text

    def lines_of(logger: str) -> list[dict[str, Any]]:
        return [line for line in json_lines(gateway) if line["logger"] == logger]

    [decision] = await eventually(
        lambda: lines_of("idempotency_gateway.proxy.resilient") or None,
        message="the retry decision line",
    )
    assert "not retrying upstream" in decision["message"]
    assert (decision["request_id"], decision["pid"]) == (failed.headers["X-Request-Id"], worker)

    [startup] = lines_of("idempotency_gateway.startup")
    assert (startup["port"], startup["admin_port"]) == (gateway.port, gateway.admin_port)
    assert (startup["workers"], startup["routes"], startup["cache"]) == (1, 2, "in-process")
    assert startup["store"] == database_url.replace(password, "***")
    assert password not in gateway.log_text()

    [audit] = await eventually(
        lambda: lines_of("idempotency_gateway.audit") or None, message="the admin action line"
    )
    action = audit["admin"]
    assert (action["action"], action["upstream"]) == ("breaker set to forced_open", payments)
    assert action["client"].startswith("127.0.0.1:")
    assert "request_id" not in audit  # not inside a proxied request


# ---------------------------------------------------------------------------- readiness


async def readiness(client: httpx.AsyncClient, gateway: GatewayProcess) -> tuple[int, Any]:
    response = await client.get(gateway.admin_url + "/readyz")
    return response.status_code, response.json()


async def test_readiness_follows_postgresql_down_and_up(
    upstream: RecordingUpstream,
    start_gateway_process: StartGatewayProcess,
    client: httpx.AsyncClient,
    postgres_url: str,
    unique: Callable[[str], str],
) -> None:
    async with TcpProxy("127.0.0.1", 5432) as database:
        gateway = await start_gateway_process(
            charges_config(upstream.url, unique_upstream()),
            env={"GATEWAY_DATABASE_URL": database.rewrite_url(postgres_url)},
        )
        assert await readiness(client, gateway) == (
            200,
            {"status": "ready", "store": "ok", "cache": "in-process", "schema": "ok"},
        )
        assert (await charge(client, gateway, unique("ready"))).status_code == 201

        await database.cut()

        status, body = await readiness(client, gateway)
        assert (status, body["status"], body["store"]) == (503, "not ready", "down")
        health = await client.get(gateway.admin_url + "/healthz")
        assert health.status_code == 200
        # While the store is down nothing keyed reaches the upstream (fail closed).
        refused = await charge(client, gateway, unique("down"))
        assert refused.status_code == 503
        assert upstream.total == 1

        await database.restore()

        async def ready_again() -> bool:
            return (await readiness(client, gateway))[0] == 200

        await eventually(ready_again, message="/readyz recovers with PostgreSQL")
        assert (await readiness(client, gateway))[1]["store"] == "ok"
        assert (await charge(client, gateway, unique("ready-again"))).status_code == 201
        assert upstream.total == 2


async def test_unreachable_redis_degrades_readiness_without_failing_it(
    upstream: RecordingUpstream,
    start_gateway_process: StartGatewayProcess,
    client: httpx.AsyncClient,
    postgres_url: str,
    unique: Callable[[str], str],
) -> None:
    gateway = await start_gateway_process(
        charges_config(upstream.url, unique_upstream()),
        env={
            "GATEWAY_DATABASE_URL": postgres_url,
            "GATEWAY_REDIS_URL": f"redis://127.0.0.1:{free_port()}/0",
        },
    )

    assert await readiness(client, gateway) == (
        200,
        {"status": "ready", "store": "ok", "cache": "degraded", "schema": "ok"},
    )
    key = unique("no-redis")
    assert (await charge(client, gateway, key)).status_code == 201
    assert is_replay(await charge(client, gateway, key))
    assert upstream.count(key) == 1
