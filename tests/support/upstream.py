"""A scriptable, recording HTTP upstream served over loopback inside the test's event loop.

Every request is recorded as an :class:`Execution`. What the upstream answers is scripted per
request by the ``X-Test-Behavior`` header (comma-separated items), so one upstream serves many
scenarios::

    X-Test-Behavior: status=503,retry-after=2
    X-Test-Behavior: gate=g1                  # blocks until upstream.release("g1")
    X-Test-Behavior: hang                     # never answers
    X-Test-Behavior: reset                    # TCP reset, no answer
    X-Test-Behavior: stream=5,chunk=1024,stream-gate=s1
    X-Test-Behavior: body=1048576
    X-Test-Behavior: echo-headers
    X-Test-Behavior: set-cookie=session=abc   # adds Set-Cookie: session=abc to the answer
    X-Test-Behavior: status-first=503,times=2 # 503 twice for this request, then the default

``status-first=S`` (with ``times=N``, default 1) answers ``S`` to the first ``N`` executions
of the *same request*, and from then on what the other items say (``201`` by default). The
same request means the same ``X-Test-Id`` header when one is sent, else the same
``Idempotency-Key`` (requests with neither share one counter). That is how a test scripts
"fails twice, then succeeds" for a client or gateway that retries with identical headers.

The default answer is ``201`` with JSON
``{"execution": n, "key": ..., "fencing_token": ..., "path": ..., "body_sha256": ...}`` and the
header ``X-Upstream-Execution: n`` (every answer carries that header).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import socket
import struct
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.support.lifecycle import StartedInContext

BEHAVIOR_HEADER = "X-Test-Behavior"
EXECUTION_HEADER = "X-Upstream-Execution"
FENCING_HEADER = "Idempotency-Fencing-Token"
KEY_HEADER = "Idempotency-Key"
TEST_ID_HEADER = "X-Test-Id"

DEFAULT_CHUNK = 1024


@dataclass(frozen=True)
class Execution:
    """One request as the upstream received it."""

    method: str
    path: str
    query_string: str
    headers: dict[str, str]
    """Lower-cased name -> value (the last one when a name repeats)."""
    raw_headers: list[tuple[str, str]]
    """Every header line in arrival order, names as sent."""
    body: bytes
    idempotency_key: str | None
    fencing_token: int | None
    number: int = 0
    """The global execution counter value ``n`` given to this request (1-based)."""
    raw_path: str = ""
    """The request target exactly as it arrived: percent-encoding and query string intact."""
    behavior: dict[str, str] = field(default_factory=dict)
    """The parsed ``X-Test-Behavior`` items (bare items map to ``""``)."""

    def header_values(self, name: str) -> list[str]:
        """All values of ``name`` (case-insensitive), in arrival order."""
        lowered = name.lower()
        return [value for key, value in self.raw_headers if key.lower() == lowered]


def parse_behavior(value: str | None) -> dict[str, str]:
    """Parse ``X-Test-Behavior``: ``"gate=a, hang"`` -> ``{"gate": "a", "hang": ""}``."""
    items: dict[str, str] = {}
    if not value:
        return items
    for raw in value.split(","):
        item = raw.strip()
        if not item:
            continue
        name, _, arg = item.partition("=")
        items[name.strip().lower()] = arg.strip()
    return items


def _int_or_none(value: str | None) -> int | None:
    if value is None:
        return None
    try:
        return int(value.strip())
    except ValueError:
        return None


class _Gate:
    """A pair of lazily created events for one gate name."""

    __slots__ = ("arrivals", "arrived", "released")

    def __init__(self) -> None:
        self.arrived = asyncio.Event()
        self.released = asyncio.Event()
        self.arrivals = 0


class RecordingUpstream(StartedInContext):
    """An aiohttp upstream on ``127.0.0.1:<ephemeral>`` that records and scripts answers.

    Use as ``async with RecordingUpstream() as upstream: ...``; ``upstream.url`` is
    ``http://127.0.0.1:PORT``. Gate events are per name and may be touched before or after the
    request arrives. On exit, requests still waiting (gates, ``hang``) are cancelled.
    """

    def __init__(self, *, host: str = "127.0.0.1") -> None:
        self._host = host
        self.executions: list[Execution] = []
        self._gates: dict[str, _Gate] = {}
        self._inflight: set[asyncio.Task[Any]] = set()
        self._runner: web.AppRunner | None = None
        self._port: int | None = None
        self._closing = False

    # ----------------------------------------------------------------- lifecycle

    @property
    def port(self) -> int:
        if self._port is None:
            raise RuntimeError("RecordingUpstream is not started")
        return self._port

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}"

    async def start(self) -> None:
        if self._runner is not None:
            raise RuntimeError("RecordingUpstream already started")
        app = web.Application(client_max_size=1024**3)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        # handler_cancellation: a client disconnect cancels the handler (ends ``hang``/gates).
        runner = web.AppRunner(
            app, handle_signals=False, handler_cancellation=True, shutdown_timeout=5.0
        )
        await runner.setup()
        self._runner = runner
        try:
            site = web.TCPSite(runner, self._host, 0)
            await site.start()
            self._port = int(runner.addresses[0][1])
        except BaseException:
            await self.close()
            raise

    async def close(self) -> None:
        self._closing = True
        tasks = [task for task in self._inflight if not task.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    # ------------------------------------------------------------------- queries

    @property
    def total(self) -> int:
        """How many requests the upstream received (executed), all keys together."""
        return len(self.executions)

    @property
    def inflight(self) -> int:
        """Requests whose handler is still running (gated, hanging, streaming)."""
        return sum(1 for task in self._inflight if not task.done())

    def count(self, key: str) -> int:
        """How many executions carried ``Idempotency-Key: key``."""
        return sum(1 for execution in self.executions if execution.idempotency_key == key)

    def executions_for(self, key: str) -> list[Execution]:
        return [execution for execution in self.executions if execution.idempotency_key == key]

    def executions_of_test_id(self, test_id: str) -> list[Execution]:
        """Executions that carried ``X-Test-Id: test_id``."""
        lowered = TEST_ID_HEADER.lower()
        return [e for e in self.executions if e.headers.get(lowered) == test_id]

    def _repeat_number(self, execution: Execution) -> int:
        """1 for the first execution of this request (same X-Test-Id, else same key), 2 ..."""
        lowered = TEST_ID_HEADER.lower()
        test_id = execution.headers.get(lowered)
        if test_id is not None:
            return len(self.executions_of_test_id(test_id))
        return sum(
            1
            for e in self.executions
            if lowered not in e.headers and e.idempotency_key == execution.idempotency_key
        )

    # --------------------------------------------------------------------- gates

    def _gate(self, name: str) -> _Gate:
        gate = self._gates.get(name)
        if gate is None:
            gate = self._gates[name] = _Gate()
        return gate

    def arrived(self, name: str) -> asyncio.Event:
        """Event set once a request reached gate ``name`` (``gate=`` or ``stream-gate=``)."""
        return self._gate(name).arrived

    def arrivals(self, name: str) -> int:
        """How many requests reached gate ``name`` so far."""
        return self._gate(name).arrivals

    def release(self, name: str) -> None:
        """Open gate ``name``: every request waiting there (now or later) proceeds."""
        self._gate(name).released.set()

    async def wait_arrived(self, name: str, *, timeout: float = 10.0) -> None:  # noqa: ASYNC109
        """Wait (with a deadline) until a request reached gate ``name``."""
        try:
            await asyncio.wait_for(self.arrived(name).wait(), timeout)
        except TimeoutError:
            raise AssertionError(f"no request reached gate {name!r} within {timeout}s") from None

    async def _pass_gate(self, name: str) -> None:
        gate = self._gate(name)
        gate.arrivals += 1
        gate.arrived.set()
        await gate.released.wait()

    # ------------------------------------------------------------------- handler

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        task = asyncio.current_task()
        if task is not None:
            self._inflight.add(task)
        try:
            return await self._answer(request)
        finally:
            if task is not None:
                self._inflight.discard(task)

    def _record(self, request: web.Request, body: bytes, behavior: dict[str, str]) -> Execution:
        raw = [(name, value) for name, value in request.headers.items()]
        headers = {name.lower(): value for name, value in raw}
        execution = Execution(
            method=request.method,
            path=request.path,
            query_string=request.query_string,
            headers=headers,
            raw_headers=raw,
            body=body,
            idempotency_key=headers.get(KEY_HEADER.lower()),
            fencing_token=_int_or_none(headers.get(FENCING_HEADER.lower())),
            number=len(self.executions) + 1,
            behavior=behavior,
            raw_path=request.raw_path,
        )
        self.executions.append(execution)
        return execution

    async def _answer(self, request: web.Request) -> web.StreamResponse:
        behavior = parse_behavior(request.headers.get(BEHAVIOR_HEADER))
        body = await request.read()
        execution = self._record(request, body, behavior)
        n = execution.number

        if "reset" in behavior:
            _reset_connection(request)
            await _forever()
        if "hang" in behavior:
            await _forever()
        if "gate" in behavior:
            await self._pass_gate(behavior["gate"])

        headers = {EXECUTION_HEADER: str(n)}
        if "retry-after" in behavior:
            headers["Retry-After"] = behavior["retry-after"]
        if "set-cookie" in behavior:
            headers["Set-Cookie"] = behavior["set-cookie"]
        explicit_status = _int_or_none(behavior.get("status"))
        if "status-first" in behavior:
            times = _int_or_none(behavior.get("times"))
            if self._repeat_number(execution) <= (1 if times is None else times):
                explicit_status = _int_or_none(behavior["status-first"])

        if "stream" in behavior:
            return await self._stream(request, behavior, explicit_status or 200, headers)
        if "body" in behavior:
            size = int(behavior["body"])
            return web.Response(
                status=explicit_status or 200,
                body=b"y" * size,
                content_type="application/octet-stream",
                headers=headers,
            )
        if "echo-headers" in behavior:
            echoed: dict[str, str] = {}
            for name, value in execution.raw_headers:
                lowered = name.lower()
                echoed[lowered] = f"{echoed[lowered]}, {value}" if lowered in echoed else value
            return _json_response(explicit_status or 200, echoed, headers)

        payload = {
            "execution": n,
            "key": execution.idempotency_key,
            "fencing_token": execution.fencing_token,
            "path": execution.path,
            "body_sha256": hashlib.sha256(body).hexdigest(),
        }
        return _json_response(explicit_status or 201, payload, headers)

    async def _stream(
        self,
        request: web.Request,
        behavior: dict[str, str],
        status: int,
        headers: dict[str, str],
    ) -> web.StreamResponse:
        chunks = int(behavior["stream"])
        size = int(behavior.get("chunk") or DEFAULT_CHUNK)
        gate = behavior.get("stream-gate")
        response = web.StreamResponse(status=status, headers=headers)
        response.content_type = "application/octet-stream"
        response.enable_chunked_encoding()
        await response.prepare(request)
        chunk = b"x" * size
        for index in range(chunks):
            if gate and index == chunks - 1:
                await self._pass_gate(gate)
            await response.write(chunk)
        await response.write_eof()
        return response


def _json_response(status: int, payload: Any, headers: dict[str, str]) -> web.Response:
    return web.Response(
        status=status,
        body=json.dumps(payload).encode(),
        content_type="application/json",
        headers=headers,
    )


def _forever() -> Awaitable[None]:
    """A future nobody completes: it ends only by cancellation (disconnect or close)."""
    return asyncio.get_running_loop().create_future()


def _reset_connection(request: web.Request) -> None:
    """Abort the connection with a TCP RST (SO_LINGER 0) so the client sees a reset."""
    transport = request.transport
    if transport is None:
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()
