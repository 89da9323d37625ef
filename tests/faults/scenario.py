"""One fault run: clients under load, faults injected one after another, healing, settling,
and the checker over everything that happened.

    async with fault_environment(workdir) as environment:
        report = await run_scenario(environment, Plan("postgres", faults=[POSTGRES_RESTART]))
        assert report.ok, report.table()

Progress is measured, never slept on: the first fault waits until the clients finished
``warmup`` operations, each next step until ``between`` more finished after the last fault
healed, and the end of the run until no record of the run is still ``IN_PROGRESS`` (or the
settle deadline passes, and the checker reports what is stuck).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from tests.faults.checker import Report, check, gateway_log_errors, read_records
from tests.faults.clients import FaultClient, Load, make_clients
from tests.faults.cluster import LEASE, Cluster, PrivatePostgres, PrivateRedis, ReplicatedPostgres
from tests.faults.faults import FaultInjector
from tests.faults.upstream import FaultyUpstream
from tests.support import eventually


@dataclass(frozen=True)
class FaultEnvironment:
    cluster: Cluster
    upstream: FaultyUpstream
    postgres: PrivatePostgres
    """A ``ReplicatedPostgres`` when the environment has a standby."""
    redis_server: PrivateRedis


@contextlib.asynccontextmanager
async def fault_environment(
    workdir: Path,
    *,
    gateways: int = 3,
    synchronous_standby: bool | None = None,
    statement_timeout: str = "1s",
) -> AsyncIterator[FaultEnvironment]:
    """A private PostgreSQL and Redis, the faulty upstream and ``gateways`` gateway processes;
    everything stopped (gateways first, while their store is still up) on the way out.
    ``synchronous_standby`` (``True`` or ``False``) gives the PostgreSQL a streaming standby,
    synchronous or not, and the gateways a URL listing both."""
    async with (
        (
            PrivatePostgres()
            if synchronous_standby is None
            else ReplicatedPostgres(synchronous=synchronous_standby)
        ) as postgres,
        PrivateRedis() as redis_server,
        FaultyUpstream() as upstream,
    ):
        cluster = Cluster(
            workdir,
            upstream_url=upstream.url,
            database_url=postgres.url,
            redis_url=redis_server.url,
            size=gateways,
            statement_timeout=statement_timeout,
        )
        try:
            await cluster.start()
            yield FaultEnvironment(cluster, upstream, postgres, redis_server)
        finally:
            await cluster.close()


@dataclass(frozen=True)
class Plan:
    title: str
    faults: Sequence[str]
    """Fault kinds (``tests.faults.faults``), injected one after the other."""
    clients: int = 6
    operations_per_client: int = 400
    """An upper bound: the run ends when the plan's progress steps are done."""
    shared_share: float = 0.3
    resend_chance: float = 0.1
    warmup: int = 15
    between: int = 15
    deadline: float = 30.0
    """Seconds one operation may take, retries included, before its client gives up."""
    settle: float = LEASE * 3 + 5.0
    seed: int = 0
    replay_answered: bool = False
    """After the run, empty the replay cache and send every operation that got a final answer
    once more (``replay_answered``): the answers must come back from the records unchanged."""


async def _in_progress(dsn: str, keys: list[str]) -> int:
    try:
        connection = await asyncpg.connect(dsn, timeout=2.0)
    except (OSError, asyncpg.PostgresError):
        return -1
    try:
        count = await connection.fetchval(
            "SELECT count(*) FROM idempotency_records "
            "WHERE idempotency_key = ANY($1::text[]) AND status = 'IN_PROGRESS'",
            keys,
        )
    finally:
        await connection.close()
    return int(count)


async def _settle(environment: FaultEnvironment, keys: list[str], timeout: float) -> None:  # noqa: ASYNC109
    """Wait until no record of the run is IN_PROGRESS; past the deadline the checker says
    which ones are stuck."""
    with contextlib.suppress(AssertionError):
        await eventually(
            lambda: _settled(environment.postgres.dsn, keys), timeout=timeout, interval=0.1
        )


async def _settled(dsn: str, keys: list[str]) -> bool:
    return await _in_progress(dsn, keys) == 0


async def _progress(load: Load, count: int, what: str) -> None:
    target = load.finished + count

    def reached() -> bool:
        return load.finished >= target

    await eventually(reached, timeout=60.0, interval=0.05, message=what)


async def run_scenario(environment: FaultEnvironment, plan: Plan) -> Report:
    started = time.monotonic()
    rng = random.Random(plan.seed)
    load = Load()
    clients = make_clients(
        plan.clients,
        plan.operations_per_client,
        shared_share=plan.shared_share,
        rng=rng,
        prefix=f"{plan.title.replace(' ', '-')}-{plan.seed}",
    )
    cluster = environment.cluster
    log_marks = {gateway.name: len(gateway.log_text()) for gateway in cluster.all_gateways}
    injector = FaultInjector(
        cluster,
        environment.upstream,
        environment.postgres,
        environment.redis_server,
        load,
        rng,
        client_deadline=plan.deadline,
    )
    tasks = [
        asyncio.create_task(
            client.run(
                lambda: cluster.gateways,
                load,
                deadline=plan.deadline,
                resend_chance=plan.resend_chance,
                rng=random.Random(rng.random()),
            )
        )
        for client in clients
    ]
    try:
        await _progress(load, plan.warmup, "warm-up operations finished")
        for kind in plan.faults:
            await injector.inject(kind)
            await _progress(load, plan.between, f"operations finished after {kind}")
        load.stop.set()
        tasks += [task for _, task in load.extra_clients]
        await asyncio.wait_for(asyncio.gather(*tasks), timeout=plan.deadline * 2 + 10)
    finally:
        load.stop.set()
        environment.upstream.fault = None
        tasks += [task for _, task in load.extra_clients]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    clients += [client for client, _ in load.extra_clients]

    operations = list({op.key: op for client in clients for op in client.operations}.values())
    sent = {send.operation.key for client in clients for send in client.sends}
    operations = [operation for operation in operations if operation.key in sent]
    keys = [operation.key for operation in operations]
    await _settle(environment, keys, plan.settle)
    replays: FaultClient | None = None
    if plan.replay_answered:
        replays = await replay_answered(environment, clients, load, plan)
        clients.append(replays)
        await _settle(environment, keys, plan.settle)
    records = await read_records(environment.postgres.dsn, keys)
    log_text = "\n".join(
        gateway.log_text()[log_marks.get(gateway.name, 0) :] for gateway in cluster.all_gateways
    )
    report = check(
        plan.title,
        operations=operations,
        sends=[send for client in clients for send in client.sends],
        attempts=[attempt for client in clients for attempt in client.attempts],
        ledger=environment.upstream.executions,
        records=records,
        faults=injector.injected,
        gateway_errors=gateway_log_errors(log_text),
    )
    if replays is not None:
        report.counts["replays after the run (cache emptied)"] = len(replays.sends)
        report.counts["  answered as replays"] = sum(
            1 for send in replays.sends if send.final is not None and send.final.replayed
        )
    if injector.measured:
        report.extra.append("measured")
        report.extra += [f"  {name:<34} {value:.3g}" for name, value in injector.measured.items()]
    report.seconds = time.monotonic() - started
    return report


async def replay_answered(
    environment: FaultEnvironment, clients: Sequence[FaultClient], load: Load, plan: Plan
) -> FaultClient:
    """Restart the private Redis (the replay cache forgets everything), then send every
    operation some client got a final answer for once more, from a fresh client: each answer
    must now come from the record, and the checker holds it to every earlier final answer."""
    await environment.redis_server.kill()
    await environment.redis_server.start()
    answered = {
        send.operation.key: send.operation
        for client in clients
        for send in client.sends
        if send.final is not None
    }
    replays = FaultClient("replays-after-the-run", list(answered.values()))
    cluster = environment.cluster
    await replays.run(
        lambda: cluster.gateways,
        load,
        deadline=plan.deadline,
        resend_chance=0.0,
        rng=random.Random(plan.seed),
        finish_all=True,
    )
    return replays
