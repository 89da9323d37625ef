"""The run: prepare PostgreSQL and Redis, start each server in turn, measure, write the report."""

from __future__ import annotations

import dataclasses
import importlib.util
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from benchmarks.loadgen import LoadGenerator, RunParameters, choose_generator
from benchmarks.measure import MemoryOutcome, Outcome, measure, memory_check, warm_key
from benchmarks.processes import ManagedProcess, StartError, load_average
from benchmarks.report import RunInfo, machine_facts, render, software_versions, targets
from benchmarks.scenarios import (
    GET_SMALL,
    MEMORY_SCENARIO,
    MEMORY_SERVER,
    MEMORY_SHARE_PASS,
    POST_NEW_KEY,
    SCENARIOS,
    SERVERS,
    Scenario,
    select,
)
from benchmarks.servers import (
    RunContext,
    ServerSpec,
    find_nginx,
    missing_modules,
    start_server,
    start_upstream,
)
from benchmarks.services import (
    DEFAULT_REDIS_URL,
    committed_transactions,
    flush_redis_database,
    postgres_version,
    prepare_database,
    redis_version,
)

# A bound on each half of the memory check, whatever the measured throughput says.
MEMORY_MAX_SECONDS = 150.0


@dataclass(frozen=True)
class Options:
    command: str
    quick: bool
    seconds: float
    warmup: float
    connections: int
    threads: int
    scenarios: str | None
    memory_requests: int
    output: Path
    builtin_upstream: bool
    builtin_loadgen: bool
    postgres_url: str
    database: str
    database_url: str | None
    redis_url: str | None


def say(text: str) -> None:
    print(text, flush=True)


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


class Run:
    def __init__(self, options: Options) -> None:
        self.options = options
        self.ids = select(options.scenarios)
        self.work_dir = Path(tempfile.mkdtemp(prefix="idgw-bench-"))
        self.log_dir = self.work_dir / "logs"
        self.log_dir.mkdir()
        self.notes: list[str] = []
        self.outcomes: dict[str, Outcome] = {}
        self.memory: MemoryOutcome | None = None
        self.database_url = ""
        self.index = 0
        self.total = len(self.ids)
        self.nonce = datetime.now(UTC).strftime("%Y%m%d%H%M%S")
        self.header_installed = (
            importlib.util.find_spec("idempotency_header_middleware") is not None
        )
        self.generator: LoadGenerator = choose_generator(
            force_builtin=options.builtin_loadgen, script_dir=self.work_dir, threads=options.threads
        )

    def _commits(self) -> int | None:
        """Commits on the bench database so far, once the servers have reported them: a
        server process reports its counts within a second of going idle."""
        if not self.database_url:
            return None
        time.sleep(1.1)
        return committed_transactions(self.database_url)

    # -- set-up ---------------------------------------------------------------------------

    def _needs_database(self) -> bool:
        servers = {s.server for s in SCENARIOS if s.id in self.ids}
        if MEMORY_SCENARIO in self.ids:
            servers.add(MEMORY_SERVER)
        return any(spec.kind in ("gateway", "library") for spec in SERVERS if spec.id in servers)

    def _redis(self) -> tuple[str | None, str | None]:
        url = self.options.redis_url
        if url is None:
            self.notes.append("Run with --no-redis: the Redis scenarios were skipped.")
            return None, None
        version = redis_version(url)
        if version is None:
            self.notes.append(f"Redis did not answer at {url}: the Redis scenarios were skipped.")
            return None, None
        if url == DEFAULT_REDIS_URL:
            flush_redis_database(url)  # database 14 belongs to the benchmarks
        return url, version

    # -- one server and its scenarios -----------------------------------------------------

    def _adapt(self, spec: ServerSpec, ctx: RunContext) -> tuple[ServerSpec, str | None]:
        """The server as this machine can run it, or why it cannot run."""
        if spec.kind == "nginx-proxy" and ctx.nginx is None:
            return spec, "nginx is not installed"
        missing = missing_modules(spec)
        if missing:
            return spec, f"{' and '.join(missing)} not installed (pip install -e '.[bench]')"
        if spec.kind == "gateway" and spec.redis and ctx.redis_url is None:
            label = spec.label.replace("+ Redis", "+ in-process cache (no Redis)")
            return dataclasses.replace(spec, redis=False, label=label), None
        if spec.kind == "library" and spec.library.startswith("header"):
            if not self.header_installed:
                return spec, "asgi-idempotency-header is not installed"
            if spec.library == "header-redis" and ctx.redis_url is None:
                return spec, "Redis is not available"
        return spec, None

    def _skip(self, scenario: Scenario, label: str, reason: str) -> None:
        self.index += 1
        say(f"[{self.index:2}/{self.total}] {scenario.id:18} skipped: {reason}")
        connections = scenario.load.connections or self.options.connections
        self.outcomes[scenario.id] = Outcome(
            scenario, label, skipped=reason, connections=connections
        )

    def _scenario(
        self,
        scenario: Scenario,
        label: str,
        server: ManagedProcess,
        port: int,
        upstream: ManagedProcess,
    ) -> None:
        self.index += 1
        options = self.options
        connections = scenario.load.connections or options.connections
        say(
            f"[{self.index:2}/{self.total}] {scenario.id:18} {label}: "
            f"{scenario.load.describe(connections)}, {options.seconds:g}s ..."
        )
        base_url = f"http://127.0.0.1:{port}"
        nonce = f"{self.nonce}-{scenario.id}"
        if scenario.warm_key:
            status = warm_key(port, scenario.load, nonce)
            if status != 200:
                self.notes.append(f"`{scenario.id}`: warming the key answered {status}.")
        try:
            if options.warmup > 0:
                warm_nonce = nonce if scenario.load.keys == "fixed" else nonce + "-warm"
                self.generator.run(
                    RunParameters(base_url, scenario.load, connections, options.warmup, warm_nonce)
                )
            parameters = RunParameters(base_url, scenario.load, connections, options.seconds, nonce)
            commits_before = self._commits()
            result, cpu = measure(self.generator, parameters, server=server, upstream=upstream)
            commits_after = self._commits()
        except (RuntimeError, OSError) as exc:
            say(f"        failed: {exc}")
            self.outcomes[scenario.id] = Outcome(
                scenario, label, skipped=f"failed: {exc}", connections=connections
            )
            return
        commits = (
            None
            if commits_before is None or commits_after is None
            else commits_after - commits_before
        )
        self.outcomes[scenario.id] = Outcome(
            scenario,
            label,
            result,
            cpu,
            connections=connections,
            seconds=options.seconds,
            commits=commits,
        )
        versus = ""
        baseline = self.outcomes.get(scenario.baseline or "")
        if baseline is not None and baseline.result is not None and baseline.result.rps > 0:
            versus = f"  ({result.rps / baseline.result.rps:.2f}x {scenario.baseline})"
        say(
            f"        -> {result.rps:,.0f} req/s  p50 {result.p50_ms:.2f} ms  "
            f"p99 {result.p99_ms:.2f} ms  errors {result.errors}{versus}"
        )

    def _memory(self, spec: ServerSpec, server: ManagedProcess, port: int) -> None:
        self.index += 1
        options = self.options
        reduced = options.memory_requests < 100_000
        say(
            f"[{self.index:2}/{self.total}] {MEMORY_SCENARIO:18} {spec.label}: RSS per worker "
            f"over {options.memory_requests:,} requests ..."
        )
        loads = (GET_SMALL, POST_NEW_KEY)
        rates = []
        for scenario_id, load in zip((f"{spec.id}-pass", f"{spec.id}-new"), loads, strict=True):
            known = self.outcomes.get(scenario_id)
            if known is not None and known.result is not None:
                rates.append(known.result.rps)
            else:  # not measured in this run: a short probe says how long to run
                probe = self.generator.run(
                    RunParameters(
                        f"http://127.0.0.1:{port}",
                        load,
                        options.connections,
                        2.0,
                        f"{self.nonce}-probe-{scenario_id}",
                    )
                )
                rates.append(probe.rps)
        self.memory = memory_check(
            self.generator,
            server=server,
            server_label=spec.label,
            workers=spec.workers,
            base_url=f"http://127.0.0.1:{port}",
            connections=options.connections,
            target_requests=options.memory_requests,
            rates=(rates[0], rates[1]),
            nonce=f"{self.nonce}-memory",
            reduced=reduced,
            max_seconds=MEMORY_MAX_SECONDS,
            share_pass=MEMORY_SHARE_PASS,
            loads=loads,
            warmup=max(options.warmup, 2.0),
        )
        growth = ", ".join(f"{value:+.1%}" for value in self.memory.growth.values())
        say(f"        -> {self.memory.requests:,} requests; RSS change per worker: {growth}")

    def _server(self, spec: ServerSpec, ctx: RunContext, upstream: ManagedProcess) -> None:
        chosen = [s for s in SCENARIOS if s.server == spec.id and s.id in self.ids]
        do_memory = spec.id == MEMORY_SERVER and MEMORY_SCENARIO in self.ids
        if not chosen and not do_memory:
            return
        spec, reason = self._adapt(spec, ctx)
        process, port = upstream, ctx.upstream_port
        if reason is None and spec.kind != "upstream":
            say(f"        starting {spec.id}: {spec.label}")
            try:
                running = start_server(spec, ctx)
                process, port = running.process, running.port
            except StartError as exc:
                lines = [line for line in str(exc).splitlines() if line.strip()]
                reason = f"did not start ({lines[-1].strip()[:160] if lines else 'no output'})"
                self.notes.append(f"{spec.label} did not start:\n\n```\n{exc}\n```")
        if reason is not None:
            for scenario in chosen:
                self._skip(scenario, spec.label, reason)
            if do_memory:
                self.index += 1
            return
        try:
            for scenario in chosen:
                if "redis" in scenario.id and ctx.redis_url is None:
                    self._skip(scenario, spec.label, "Redis is not available")
                    continue
                self._scenario(scenario, spec.label, process, port, upstream)
            if do_memory:
                self._memory(spec, process, port)
        finally:
            if process is not upstream:
                process.stop()

    # -- the whole run --------------------------------------------------------------------

    def execute(self) -> int:
        options = self.options
        started_at, wall_started, load_start = _now(), time.monotonic(), load_average()
        redis_url, redis_server = self._redis()
        database_url, pg_version = "", "not used"
        if self._needs_database():
            say("preparing the bench database (create, migrate) ...")
            recreate = options.database_url is None
            database_url = prepare_database(
                options.database_url or options.postgres_url, options.database, recreate=recreate
            )
            pg_version = postgres_version(database_url)
        nginx = find_nginx()
        use_nginx_upstream = nginx is not None and not options.builtin_upstream
        ctx = RunContext(self.work_dir, self.log_dir, database_url, redis_url, nginx)
        self.database_url = database_url
        upstream_kind = (
            "nginx (1 worker process)" if use_nginx_upstream
            else "built-in (raw asyncio + httptools, 1 process)"
        )  # fmt: skip
        self._explain_tools(nginx, use_nginx_upstream)
        say(f"load generator: {self.generator.name}; upstream: {upstream_kind}")
        say(f"server logs: {self.log_dir}")
        upstream = start_upstream(ctx, use_nginx=use_nginx_upstream)
        try:
            for spec in SERVERS:
                self._server(spec, ctx, upstream)
        finally:
            upstream.stop()
        info = RunInfo(
            command=options.command,
            started=started_at,
            finished=_now(),
            wall_seconds=time.monotonic() - wall_started,
            seconds=options.seconds,
            warmup=options.warmup,
            connections=options.connections,
            generator=self._generator_description(),
            upstream=upstream_kind,
            quick=options.quick,
            load_start=load_start,
            load_end=load_average(),
            machine=machine_facts(),
            versions=software_versions(
                postgres=pg_version,
                redis=redis_server,
                nginx=nginx,
                wrk=shutil.which("wrk"),
            ),
            notes=self.notes,
        )
        options.output.write_text(render(info, self.outcomes, self.memory))
        say(f"wrote {options.output}")
        for target in targets(self.outcomes, self.memory):
            if target.verdict != "not measured":
                say(f"  {target.verdict:>16}: {target.name}: {target.measured}")
        failed = [
            o.scenario.id for o in self.outcomes.values() if o.skipped and "fail" in o.skipped
        ]
        if failed or any("did not start" in (o.skipped or "") for o in self.outcomes.values()):
            say(f"server logs kept in {self.log_dir}")
        else:
            shutil.rmtree(self.work_dir, ignore_errors=True)
        return 0

    def _explain_tools(self, nginx: str | None, use_nginx_upstream: bool) -> None:
        if nginx is None:
            self.notes.append(
                "nginx is not installed: the upstream is the built-in server and the nginx "
                "proxy_pass baseline was skipped (`apt-get install nginx` to add them)."
            )
        elif not use_nginx_upstream:
            self.notes.append("--builtin-upstream: the upstream is the built-in server.")
        if self.generator.name != "wrk":
            why = "--builtin-loadgen" if self.options.builtin_loadgen else "wrk is not installed"
            self.notes.append(
                f"{why}: load came from the bundled aiohttp generator, one process on one core. "
                "It is far slower than wrk: where its CPU column (`loadgen`) is near 1.00 it, "
                "not the server, set the throughput, and its latencies include its own queueing."
            )
        if not self.header_installed:
            self.notes.append(
                "asgi-idempotency-header is not installed: its library-mode baselines were "
                "skipped (`pip install asgi-idempotency-header`)."
            )
        else:
            self.notes.append(
                "asgi-idempotency-header 0.2 keeps state in its MemoryBackend (a dict in the "
                "process) or its RedisBackend (six Redis round trips for a new key); both rows "
                "are shown. Neither is durable the way the gateway's PostgreSQL record is."
            )
        self.notes.append(
            "The PostgreSQL-only replay runs with `cache: {max_entries: 0}`: the in-process LRU "
            "then evicts every entry as it is stored (app/replay/cache.py), so every replay "
            "reads PostgreSQL (one `INSERT ... ON CONFLICT` round trip)."
        )

    def _generator_description(self) -> str:
        if self.generator.name == "wrk":
            return f"wrk, {self.options.threads} threads (generated Lua: keys and bodies)"
        return "bundled aiohttp generator (benchmarks/pyloadgen.py, one process)"


def run(options: Options) -> int:
    try:
        return Run(options).execute()
    except StartError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
