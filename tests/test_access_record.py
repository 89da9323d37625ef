"""The access line's record is a whole ``LogRecord``: what ``Logger.makeRecord`` would give,
with this moment's time and this process's id (a forked child's too), for any handler."""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from idempotency_gateway.telemetry import request_log
from idempotency_gateway.telemetry.logs import JsonFormatter
from idempotency_gateway.telemetry.request_log import RequestLog, write_access_line

ACCESS = logging.getLogger("idempotency_gateway.access")


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def captured() -> Iterator[Capture]:
    capture = Capture()
    level = ACCESS.level
    ACCESS.addHandler(capture)
    ACCESS.setLevel(logging.INFO)
    try:
        yield capture
    finally:
        ACCESS.removeHandler(capture)
        ACCESS.setLevel(level)


def entry() -> RequestLog:
    return RequestLog("req-1", "POST", "/v1/charges", route="charges", status=201)


def test_the_record_is_what_make_record_gives_at_this_moment(captured: Capture) -> None:
    before = time.time()
    write_access_line(entry())
    after = time.time()
    expected = ACCESS.makeRecord(
        ACCESS.name,
        logging.INFO,
        request_log.__file__,
        0,
        "request",
        (),
        None,
        extra={"request": entry()},
    )

    (record,) = captured.records
    assert isinstance(record, logging.LogRecord)
    timing = {"created", "msecs", "relativeCreated"}
    formatted = {"message", "asctime"}  # added by whichever formatter saw it first
    assert vars(record).keys() - formatted == vars(expected).keys()
    for name in vars(expected).keys() - timing:
        assert getattr(record, name) == getattr(expected, name), name
    assert before <= record.created <= after
    assert record.msecs == int((record.created - int(record.created)) * 1000)
    assert record.process == os.getpid()
    assert record.thread == threading.get_ident()
    started = expected.created - expected.relativeCreated / 1000
    assert record.relativeCreated == pytest.approx((record.created - started) * 1000, abs=1)
    assert record.getMessage() == "request"


def test_records_from_another_thread_name_that_thread(captured: Capture) -> None:
    worker = threading.Thread(target=write_access_line, args=(entry(),), name="other-loop")
    worker.start()
    worker.join()
    write_access_line(entry())

    assert [record.threadName for record in captured.records] == [
        "other-loop",
        threading.current_thread().name,
    ]


def test_a_forked_child_writes_its_own_process_id(captured: Capture) -> None:
    write_access_line(entry())  # the parent's records are set up before the fork
    read_end, write_end = os.pipe()
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through the pipe
        try:
            captured.records.clear()
            write_access_line(entry())
            os.write(write_end, str(captured.records[0].process).encode())
        finally:
            os._exit(0)
    os.close(write_end)
    reported = os.read(read_end, 64).decode()
    os.close(read_end)
    os.waitpid(child, 0)

    assert int(reported) == child


def test_an_applications_record_factory_builds_every_access_record(captured: Capture) -> None:
    """A factory that stamps each record with a value of its moment (as log correlation
    stamps the current trace id) sees every access line, not one copied from another."""
    default = logging.getLogRecordFactory()
    stamps = iter(range(1, 100))

    def stamping(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = default(*args, **kwargs)
        record.stamp = next(stamps)
        return record

    logging.setLogRecordFactory(stamping)
    try:
        write_access_line(entry())
        write_access_line(entry())
    finally:
        logging.setLogRecordFactory(default)

    assert [getattr(record, "stamp", None) for record in captured.records] == [1, 2]


@pytest.mark.parametrize(
    ("created", "expected"),
    [
        (1_764_356_400.0, "2025-11-28T19:00:00.000+00:00"),
        (1_764_356_400.0415, "2025-11-28T19:00:00.041+00:00"),
        (1_764_356_400.9995, "2025-11-28T19:00:00.999+00:00"),
        # The last moment before the next second that a double can hold.
        (math.nextafter(1_764_356_401.0, 0.0), "2025-11-28T19:00:00.999+00:00"),
        (math.nextafter(1.0, 0.0), "1970-01-01T00:00:00.999+00:00"),
        (1_764_356_401.0, "2025-11-28T19:00:01.000+00:00"),
    ],
)
def test_the_json_line_tells_the_time_to_the_millisecond_in_utc(
    created: float, expected: str
) -> None:
    record = ACCESS.makeRecord(ACCESS.name, logging.INFO, __file__, 0, "request", (), None)
    record.created = created

    line = json.loads(JsonFormatter().format(record))

    assert line["time"] == expected
    truncated = datetime.fromtimestamp(int(created), UTC) + timedelta(
        milliseconds=int(expected[20:23])
    )
    assert datetime.fromisoformat(line["time"]) == truncated


def test_the_json_line_carries_every_field_of_the_request() -> None:
    document = json.loads(JsonFormatter().format(request_log._records.access_record(entry())))

    assert document["request"] == {
        "request_id": "req-1",
        "method": "POST",
        "path": "/v1/charges",
        "route": "charges",
        "upstream": None,
        "outcome": "unprotected",
        "attempts": 0,
        "status": 201,
        "scope_hash": None,
        "key_hash": None,
        "duration_ms": 0.0,
    }


def test_a_lines_extra_fields_keep_the_order_they_were_given_in() -> None:
    record = ACCESS.makeRecord(
        ACCESS.name, logging.INFO, __file__, 0, "started", (), None, extra={"b": 1, "a": 2, "c": 3}
    )

    document = json.loads(JsonFormatter().format(record))

    assert list(document)[-3:] == ["b", "a", "c"]
