"""The invariants of a fault run, checked over three independent sources of truth:

- the upstream's **ledger**: every request it received, with key, fencing token and what it
  did with it (``committed``, or ``refused``: a not-processed status or a stale token);
- the **records**, read from PostgreSQL with plain SQL (not through the gateway);
- every **answer** every client saw.

Invariants (each breach is a violation naming the key and the evidence):

1. *At most once*: on an ``on_ambiguous: fail`` route a key is committed upstream at most once.
   On a ``retry`` route it may commit again, but every later commit carries a fencing token at
   least as high as the one before (equal: the same owner resending, as the route allows;
   lower would be a fenced-off owner's write).
2. *One answer*: every final answer (not 409, not a retryable 5xx, or any replay) that any
   client got for a key is the same status and body, and it is the record's stored answer.
3. *Nothing stuck*: no record is ``IN_PROGRESS`` once the faults healed and the run settled.
4. *No fenced finalize*: a stored upstream answer is the answer of the execution holding the
   record's fencing token, the highest token committed for the key; a stored gateway answer
   is a documented problem; no execution carries a token the record never issued.
5. *Only documented 5xx*: every 5xx a client saw is the upstream's own answer or a gateway
   problem with a documented type (502, 503, 504 with their slugs).
6. *Liveness*: every operation got a final answer before its deadline (the faults are bounded).
"""

from __future__ import annotations

import itertools
import json
import zlib
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from tests.faults.clients import Attempt, Operation, Send
from tests.faults.upstream import disposition
from tests.support.problems import DOCUMENTED_5XX, PROBLEM_JSON, problem_slug
from tests.support.upstream import EXECUTION_HEADER, Execution


@dataclass(frozen=True, slots=True)
class StoredRecord:
    key: str
    status: str
    fencing_token: int
    response_status: int | None
    response_headers: dict[str, str]
    response_body: bytes


async def read_records(dsn: str, keys: Iterable[str]) -> dict[str, StoredRecord]:
    """The records of ``keys``, straight from PostgreSQL."""
    connection = await asyncpg.connect(dsn)
    try:
        rows = await connection.fetch(
            "SELECT idempotency_key, status, fencing_token, response_status, "
            "response_headers::text AS headers, response_body, body_compressed "
            "FROM idempotency_records WHERE idempotency_key = ANY($1::text[])",
            list(keys),
        )
    finally:
        await connection.close()
    records: dict[str, StoredRecord] = {}
    for row in rows:
        body = bytes(row["response_body"] or b"")
        if row["body_compressed"]:
            body = zlib.decompress(body)
        headers = json.loads(row["headers"]) if row["headers"] else []
        records[row["idempotency_key"]] = StoredRecord(
            key=row["idempotency_key"],
            status=row["status"],
            fencing_token=row["fencing_token"],
            response_status=row["response_status"],
            response_headers={str(name).lower(): str(value) for name, value in headers},
            response_body=body,
        )
    return records


def describe(status: int | None, body: bytes) -> str:
    slug = problem_slug(body)
    if slug is not None:
        return f"{status} {slug}"
    return f"{status} {body[:80]!r}"


@dataclass
class Report:
    """Counts for the summary table, and every violation found."""

    title: str
    faults: Counter[str] = field(default_factory=Counter)
    counts: dict[str, int] = field(default_factory=dict)
    errors: Counter[str] = field(default_factory=Counter)
    violations: list[str] = field(default_factory=list)
    seconds: float = 0.0
    extra: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    @classmethod
    def merged(cls, title: str, reports: Sequence[Report]) -> Report:
        """One report adding up several runs (the soak's rounds, the short run's scenarios)."""
        total = cls(title)
        for report in reports:
            total.faults.update(report.faults)
            total.errors.update(report.errors)
            for name, value in report.counts.items():
                total.counts[name] = total.counts.get(name, 0) + value
            total.violations += [f"[{report.title}] {v}" for v in report.violations]
            total.seconds += report.seconds
        return total

    def table(self) -> str:
        lines = [f"== {self.title} ({self.seconds:.1f} s) =="]
        width = 34

        def row(name: str, value: object) -> None:
            lines.append(f"  {name:<{width}} {value}")

        lines.append("faults injected")
        for kind, count in sorted(self.faults.items()):
            row(kind, count)
        if not self.faults:
            row("(none)", 0)
        lines.append("traffic and outcome")
        for name, value in self.counts.items():
            row(name, value)
        lines.append("errors seen by clients and gateways, by kind")
        for kind, count in sorted(self.errors.items(), key=lambda item: (-item[1], item[0])):
            row(kind, count)
        if not self.errors:
            row("(none)", 0)
        lines.extend(self.extra)
        lines.append(f"violations: {len(self.violations)}")
        lines.extend(f"  ! {violation}" for violation in self.violations[:50])
        return "\n".join(lines)


def _error_kind(attempt: Attempt) -> str | None:
    """What went wrong in one exchange, or None for an answer that is simply an answer."""
    if attempt.error is not None:
        return f"connection: {attempt.error}"
    assert attempt.status is not None
    if attempt.status < 400 or attempt.replayed:
        return None
    if EXECUTION_HEADER.lower() in attempt.headers:
        return f"upstream {attempt.status}"
    return f"gateway {describe(attempt.status, attempt.body)}"


def _committed_tokens(executions: Sequence[Execution]) -> list[int]:
    return [e.fencing_token or 0 for e in executions if disposition(e) == "committed"]


def _check_executions(
    operation: Operation, executions: Sequence[Execution], record: StoredRecord | None
) -> list[str]:
    found: list[str] = []
    tokens = _committed_tokens(executions)
    if operation.on_ambiguous == "fail" and len(tokens) > 1:
        found.append(
            f"{operation.key}: committed {len(tokens)} times on an on_ambiguous: fail route "
            f"(tokens {tokens})"
        )
    if any(later < earlier for earlier, later in itertools.pairwise(tokens)):
        found.append(f"{operation.key}: a commit carried a lower fencing token: {tokens}")
    if record is not None and tokens and max(tokens) > record.fencing_token:
        found.append(
            f"{operation.key}: executed with token {max(tokens)}, but the record only issued "
            f"up to {record.fencing_token}"
        )
    return found


def _check_record(
    operation: Operation,
    record: StoredRecord | None,
    executions: Mapping[int, Execution],
    finals: Sequence[Attempt],
) -> list[str]:
    key = operation.key
    if record is None:
        return [f"{key}: clients got final answers but there is no record"] if finals else []
    if record.status == "IN_PROGRESS":
        return [f"{key}: stuck IN_PROGRESS (token {record.fencing_token}) after the run settled"]
    if record.status not in ("SUCCEEDED", "FAILED_FINAL"):
        return (
            [f"{key}: clients got final answers, but the record is {record.status}"]
            if finals
            else []
        )
    found: list[str] = []
    stored = (record.response_status, record.response_body)
    origin = record.response_headers.get(EXECUTION_HEADER.lower())
    if origin is not None:
        execution = executions.get(int(origin))
        mine = [e for e in executions.values() if e.idempotency_key == key]
        highest = max(_committed_tokens(mine), default=0)
        if execution is None or execution.idempotency_key != key:
            found.append(f"{key}: stored answer names execution {origin} of another key")
        elif execution.fencing_token != record.fencing_token or disposition(execution) != (
            "committed"
        ):
            found.append(
                f"{key}: stored answer is execution {origin} with token "
                f"{execution.fencing_token} ({disposition(execution)}), but the record holds "
                f"token {record.fencing_token}: a fenced-off owner's finalize landed"
            )
        elif execution.fencing_token != highest:
            found.append(
                f"{key}: stored answer has token {execution.fencing_token}, not the highest "
                f"committed token {highest}"
            )
    else:
        slug = problem_slug(record.response_body)
        if slug is None or ((record.response_status or 0) >= 500 and slug not in DOCUMENTED_5XX):
            found.append(f"{key}: stored answer {describe(*stored)} is no documented problem")
    for attempt in finals:
        if (attempt.status, attempt.body) != stored:
            found.append(
                f"{key}: {attempt.client} got {describe(attempt.status, attempt.body)}"
                f"{' (replayed)' if attempt.replayed else ''} via {attempt.gateway}, but the "
                f"record stores {describe(*stored)}"
            )
    return found


def _undocumented_5xx(attempt: Attempt) -> str | None:
    if attempt.status is None or attempt.status < 500:
        return None
    if EXECUTION_HEADER.lower() in attempt.headers:
        return None  # the upstream's own answer, relayed
    slug = problem_slug(attempt.body)
    content_type = attempt.headers.get("content-type", "")
    if content_type.startswith(PROBLEM_JSON) and DOCUMENTED_5XX.get(slug or "") == attempt.status:
        return None
    answer = describe(attempt.status, attempt.body)
    return f"{attempt.key}: {attempt.client} got an undocumented {answer} from {attempt.gateway}"


def check(
    title: str,
    *,
    operations: Sequence[Operation],
    sends: Sequence[Send],
    attempts: Sequence[Attempt],
    ledger: Sequence[Execution],
    records: Mapping[str, StoredRecord],
    faults: Counter[str],
    gateway_errors: Counter[str] | None = None,
) -> Report:
    by_key = {operation.key: operation for operation in operations}
    executions_of: dict[str, list[Execution]] = defaultdict(list)
    for execution in ledger:
        if execution.idempotency_key in by_key:
            executions_of[execution.idempotency_key].append(execution)
    numbered = {e.number: e for e in ledger}
    finals_of: dict[str, list[Attempt]] = defaultdict(list)
    for send in sends:
        if send.final is not None:
            finals_of[send.operation.key].append(send.final)

    report = Report(title, faults=Counter(faults))
    for operation in operations:
        record = records.get(operation.key)
        report.violations += _check_executions(operation, executions_of[operation.key], record)
        report.violations += _check_record(operation, record, numbered, finals_of[operation.key])
    for send in sends:
        if send.final is None:
            report.violations.append(
                f"{send.operation.key}: {send.client} got no final answer ({send.gave_up})"
            )
    for attempt in attempts:
        if (problem := _undocumented_5xx(attempt)) is not None:
            report.violations.append(problem)
        if (kind := _error_kind(attempt)) is not None:
            report.errors[kind] += 1
    report.errors.update(gateway_errors or Counter())

    mine = [e for executions in executions_of.values() for e in executions]
    committed = {key: len(_committed_tokens(es)) for key, es in executions_of.items()}
    duplicates = {key: count - 1 for key, count in committed.items() if count > 1}
    retry_keys = {op.key for op in operations if op.on_ambiguous == "retry"}
    statuses = Counter(record.status for record in records.values())
    report.counts = {
        "operations": len(operations),
        "sends (operations x clients, resends)": len(sends),
        "requests (HTTP attempts)": len(attempts),
        "replayed answers": sum(1 for attempt in attempts if attempt.replayed),
        "final answers": sum(1 for send in sends if send.final is not None),
        "upstream executions (all)": len(mine),
        "  committed": sum(committed.values()),
        "  refused: not processed": sum(
            1 for e in mine if disposition(e) == "refused" and "stale" not in e.behavior
        ),
        "  refused: stale fencing token": sum(1 for e in mine if "stale" in e.behavior),
        "duplicate executions (retry route)": sum(
            count for key, count in duplicates.items() if key in retry_keys
        ),
        "duplicate executions (fail route)": sum(
            count for key, count in duplicates.items() if key not in retry_keys
        ),
        "records SUCCEEDED / FAILED_FINAL": statuses["SUCCEEDED"] + statuses["FAILED_FINAL"],
        "records FAILED_RETRYABLE": statuses["FAILED_RETRYABLE"],
        "stuck records (IN_PROGRESS)": statuses["IN_PROGRESS"],
    }
    return report


def gateway_log_errors(text: str) -> Counter[str]:
    """Warnings and errors in the gateways' JSON logs, by message (first words)."""
    found: Counter[str] = Counter()
    for line in text.splitlines():
        try:
            entry: Any = json.loads(line)
        except ValueError:
            if "Traceback" in line:
                found["log: traceback"] += 1
            continue
        if isinstance(entry, dict) and entry.get("level") in ("warning", "error", "critical"):
            message = str(entry.get("message", ""))[:60]
            found[f"log {entry['level']}: {message}"] += 1
    return found
