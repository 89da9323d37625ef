"""Driving load: wrk with a generated Lua script when installed, else the bundled generator.

Both send the same requests: a method, a path, an optional JSON body of a given size, and an
``Idempotency-Key`` chosen by the load's key mode:

- ``none``: no key;
- ``unique``: a new key for every request (run nonce, generator thread, counter);
- ``fixed``: one key for every request (the replay scenarios warm it first);
- ``storm``: a new key every ``storm_group`` requests, sent by every connection at once, so
  the first request of a key executes while its duplicates arrive (409) or follow (replay).

Both report the same ``LoadResult``. Each run is bounded by its duration and stops by itself.
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal, Protocol

KeyMode = Literal["none", "unique", "fixed", "storm"]
RESULT_MARKER = "BENCH_RESULT "


@dataclass(frozen=True)
class Load:
    method: str = "GET"
    path: str = "/small"
    body_bytes: int = 0
    keys: KeyMode = "none"
    storm_group: int = 64
    connections: int | None = None  # None: the run's --connections
    count_statuses: bool = False  # count 409s and replays one by one (storm)

    def describe(self, connections: int) -> str:
        body = f" {self.body_bytes // 1024} KiB" if self.body_bytes >= 1024 else ""
        keys = {"none": "no key", "unique": "new key each", "fixed": "one key", "storm": "storm"}
        return f"{self.method}{body} {self.path}, {keys[self.keys]}, {connections} conn"


def json_body(size: int) -> bytes:
    """A JSON document of exactly ``size`` bytes (at least ``{}``)."""
    if size < 10:
        return b"{}"
    return b'{"pad":"' + b"x" * (size - 10) + b'"}'


@dataclass
class LoadResult:
    requests: int  # answers received
    seconds: float
    p50_ms: float
    p99_ms: float
    ok: int  # 2xx
    conflicts: int  # 409 (counted apart only with count_statuses)
    other_status: int  # every other non-2xx answer
    socket_errors: int  # connect, read, write errors and timeouts
    replayed: int | None  # 2xx answers with Idempotent-Replayed (None: not counted)
    generator: str
    generator_cpu: float  # cores the generator kept busy during the run

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds > 0 else 0.0

    @property
    def errors(self) -> int:
        """Non-2xx answers other than 409, plus socket errors."""
        return self.other_status + self.socket_errors

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> LoadResult:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class RunParameters:
    base_url: str
    load: Load
    connections: int
    seconds: float
    nonce: str


class LoadGenerator(Protocol):
    name: str

    def run(self, parameters: RunParameters) -> LoadResult: ...


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# wrk ---------------------------------------------------------------------------------------

_WRK_COMMON = """
local threads = {}
function setup(thread)
  table.insert(threads, thread)
  thread:set("tid", #threads)
end
"""

_WRK_BODY = """
local body = nil
local headers = {}
if BODY_BYTES >= 10 then
  body = '{"pad":"' .. string.rep("x", BODY_BYTES - 10) .. '"}'
  headers["Content-Type"] = "application/json"
elseif BODY_BYTES > 0 then
  body = "{}"
  headers["Content-Type"] = "application/json"
end
"""

_WRK_STATIC = """
function init(args)
  ok, conflicts, other, replayed = 0, 0, 0, 0
  wrk.method = METHOD
  wrk.path = PATH
  wrk.body = body
  for name, value in pairs(headers) do wrk.headers[name] = value end
end
"""

_WRK_DYNAMIC = """
local counter = 0
function init(args)
  ok, conflicts, other, replayed = 0, 0, 0, 0
end
function request()
  counter = counter + 1
  local key
  if KEYS == "unique" then
    key = NONCE .. "-" .. tid .. "-" .. counter
  elseif KEYS == "fixed" then
    key = NONCE
  else
    key = NONCE .. "-" .. tid .. "-" .. math.floor(counter / STORM_GROUP)
  end
  headers["Idempotency-Key"] = key
  return wrk.format(METHOD, PATH, headers, body)
end
"""

_WRK_COUNT = """
function response(status, response_headers, response_body)
  if status >= 200 and status < 300 then
    ok = ok + 1
    if response_headers["idempotent-replayed"] or response_headers["Idempotent-Replayed"] then
      replayed = replayed + 1
    end
  elseif status == 409 then
    conflicts = conflicts + 1
  else
    other = other + 1
  end
end
"""

_WRK_DONE = """
function done(summary, latency, requests)
  local ok, conflicts, other, replayed = 0, 0, 0, 0
  for _, thread in ipairs(threads) do
    ok = ok + (thread:get("ok") or 0)
    conflicts = conflicts + (thread:get("conflicts") or 0)
    other = other + (thread:get("other") or 0)
    replayed = replayed + (thread:get("replayed") or 0)
  end
  local e = summary.errors
  io.write(string.format(
    'BENCH_RESULT {"requests": %d, "duration_us": %d, "connect": %d, "read": %d, ' ..
    '"write": %d, "timeout": %d, "status": %d, "p50_us": %d, "p99_us": %d, ' ..
    '"ok": %d, "conflicts": %d, "other": %d, "replayed": %d}\\n',
    summary.requests, summary.duration, e.connect, e.read, e.write, e.timeout, e.status,
    latency:percentile(50), latency:percentile(99), ok, conflicts, other, replayed))
end
"""


def _lua_string(value: str) -> str:
    return json.dumps(value)  # a JSON string literal is a valid Lua string literal here


def wrk_script(load: Load, nonce: str) -> str:
    constants = (
        f"local METHOD = {_lua_string(load.method)}\n"
        f"local PATH = {_lua_string(load.path)}\n"
        f"local KEYS = {_lua_string(load.keys)}\n"
        f"local NONCE = {_lua_string(nonce)}\n"
        f"local STORM_GROUP = {int(load.storm_group)}\n"
        f"local BODY_BYTES = {int(load.body_bytes)}\n"
    )
    parts = ["-- generated by benchmarks/loadgen.py\n", constants, _WRK_COMMON, _WRK_BODY]
    parts.append(_WRK_STATIC if load.keys == "none" else _WRK_DYNAMIC)
    if load.count_statuses:
        parts.append(_WRK_COUNT)
    parts.append(_WRK_DONE)
    return "".join(parts)


class WrkGenerator:
    name = "wrk"

    def __init__(self, wrk: str, script_dir: Path, threads: int) -> None:
        self.wrk = wrk
        self.script_dir = script_dir
        self.threads = threads

    def run(self, parameters: RunParameters) -> LoadResult:
        load = parameters.load
        script = self.script_dir / f"{parameters.nonce}.lua"
        script.write_text(wrk_script(load, parameters.nonce))
        seconds = max(1, round(parameters.seconds))  # wrk counts whole seconds
        threads = max(1, min(self.threads, parameters.connections))
        argv = [
            self.wrk, "-t", str(threads), "-c", str(parameters.connections),
            "-d", f"{seconds}s", "--timeout", "10s", "-s", str(script),
            parameters.base_url + load.path,
        ]  # fmt: skip
        cpu_before = _children_cpu()
        completed = subprocess.run(
            argv, capture_output=True, text=True, timeout=seconds + 60, check=False
        )
        cpu = _children_cpu() - cpu_before
        line = next((x for x in completed.stdout.splitlines() if x.startswith(RESULT_MARKER)), None)
        if completed.returncode != 0 or line is None:
            raise RuntimeError(f"wrk failed ({completed.returncode}): {completed.stderr.strip()}")
        data = json.loads(line[len(RESULT_MARKER) :])
        wall = data["duration_us"] / 1e6
        socket_errors = data["connect"] + data["read"] + data["write"] + data["timeout"]
        if load.count_statuses:
            ok, conflicts, other = data["ok"], data["conflicts"], data["other"]
            replayed: int | None = data["replayed"]
        else:
            # wrk counts answers with status > 399 as errors; everything else here is 2xx.
            ok, conflicts, other = data["requests"] - data["status"], 0, data["status"]
            replayed = None
        return LoadResult(
            requests=data["requests"],
            seconds=wall,
            p50_ms=data["p50_us"] / 1000,
            p99_ms=data["p99_us"] / 1000,
            ok=ok,
            conflicts=conflicts,
            other_status=other,
            socket_errors=socket_errors,
            replayed=replayed,
            generator=f"wrk -t{threads}",
            generator_cpu=cpu / wall if wall > 0 else 0.0,
        )


# the bundled generator ---------------------------------------------------------------------


class PythonGenerator:
    """``benchmarks.pyloadgen`` in a process of its own (aiohttp client, one event loop)."""

    name = "bundled (aiohttp)"

    def run(self, parameters: RunParameters) -> LoadResult:
        spec = {
            "base_url": parameters.base_url,
            "load": asdict(parameters.load),
            "connections": parameters.connections,
            "seconds": parameters.seconds,
            "nonce": parameters.nonce,
        }
        completed = subprocess.run(
            [sys.executable, "-m", "benchmarks.pyloadgen", json.dumps(spec)],
            capture_output=True,
            text=True,
            timeout=parameters.seconds + 60,
            check=False,
            cwd=Path(__file__).resolve().parent.parent,
        )
        line = next((x for x in completed.stdout.splitlines() if x.startswith(RESULT_MARKER)), None)
        if completed.returncode != 0 or line is None:
            raise RuntimeError(
                f"the bundled load generator failed ({completed.returncode}): "
                f"{completed.stderr.strip()[-2000:]}"
            )
        return LoadResult.from_json(line[len(RESULT_MARKER) :])


def choose_generator(*, force_builtin: bool, script_dir: Path, threads: int) -> LoadGenerator:
    wrk = None if force_builtin else shutil.which("wrk")
    if wrk is not None:
        return WrkGenerator(wrk, script_dir, threads)
    return PythonGenerator()
