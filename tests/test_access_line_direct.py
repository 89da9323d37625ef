"""The access line reaches the gateway's own JSON handler without a record when that handler is
the only one the record would reach: the same bytes, and every other configuration (another
handler, a filter, a level, another formatter) still gets a real record."""

from __future__ import annotations

import io
import json
import logging
import logging.config
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from idempotency_gateway.telemetry import request_log
from idempotency_gateway.telemetry.logs import (
    JsonFormatter,
    LineHandler,
    current_request_id,
    uvicorn_log_config,
)
from idempotency_gateway.telemetry.request_log import (
    RequestLog,
    RequestOutcome,
    write_access_line,
)
from tests.support.log_records import Capture

ACCESS = logging.getLogger("idempotency_gateway.access")
PARENT = logging.getLogger("idempotency_gateway")
MOMENT = 1_764_356_400.0415


@dataclass
class Logging:
    """The access logger's parent holding the one handler, as ``serve``'s root does (pytest
    puts handlers of its own on the root), writing into ``out``."""

    handler: logging.Handler
    out: io.StringIO

    def write(self, request: RequestLog) -> None:
        # pytest attaches its capturing handler to every logger that does not propagate when
        # the test itself starts, after the fixtures: taken off again here.
        PARENT.handlers[:] = [self.handler]
        write_access_line(request)

    def lines(self) -> list[str]:
        return self.out.getvalue().splitlines()


@pytest.fixture
def served_logging(monkeypatch: pytest.MonkeyPatch) -> Iterator[Logging]:
    out = io.StringIO()
    handler = LineHandler(out)
    handler.setFormatter(JsonFormatter())
    monkeypatch.setattr(PARENT, "handlers", [])
    monkeypatch.setattr(PARENT, "propagate", False)
    monkeypatch.setattr(ACCESS, "handlers", [])
    monkeypatch.setattr(ACCESS, "filters", [])
    monkeypatch.setattr(ACCESS, "propagate", True)
    level = ACCESS.level
    ACCESS.setLevel(logging.INFO)
    monkeypatch.setattr(time, "time", lambda: MOMENT)
    token = current_request_id.set("req-1")
    try:
        yield Logging(handler, out)
    finally:
        current_request_id.reset(token)
        ACCESS.setLevel(level)


def test_serve_logs_json_through_a_line_handler() -> None:
    config = uvicorn_log_config("info", "json")
    handler = config["handlers"]["stderr"]

    assert handler["class"] == f"{LineHandler.__module__}.{LineHandler.__qualname__}"
    assert config["formatters"]["gateway"]["()"].endswith(".JsonFormatter")


def entry() -> RequestLog:
    return RequestLog(
        "req-1",
        "POST",
        "/v1/charges",
        route="charges",
        upstream="api",
        outcome=RequestOutcome.REPLAYED,
        status=201,
        scope_hash="ab" * 8,
        key_hash="cd" * 8,
        duration_ms=0.25,
    )


class Tally(logging.Filter):
    """Passes every record and counts them: a filter that sees nothing counted nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = 0

    def filter(self, record: logging.LogRecord) -> bool:
        self.seen += 1
        return True


def test_the_line_without_a_record_is_the_line_the_record_formats_as(
    served_logging: Logging, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[RequestLog] = []
    template = request_log._records.access_record

    def counted(request: RequestLog) -> logging.LogRecord:
        built.append(request)
        return template(request)

    monkeypatch.setattr(request_log._records, "access_record", counted)
    served_logging.write(entry())
    assert built == []  # no record: the line went straight to the handler
    tally = Tally()
    ACCESS.addFilter(tally)  # a filter must see the record: the pipeline writes this one
    served_logging.write(entry())

    direct, through_the_record = served_logging.lines()
    assert tally.seen == 1
    assert built == [entry()]
    assert direct == through_the_record
    document = json.loads(direct)
    assert document["time"] == "2025-11-28T19:00:00.041+00:00"
    assert document["request_id"] == "req-1"
    assert document["request"]["outcome"] == "replayed"
    assert list(document) == ["time", "level", "logger", "message", "pid", "request_id", "request"]


def test_a_second_handler_gets_the_record_and_the_line_is_written_once(
    served_logging: Logging,
) -> None:
    capture = Capture()
    ACCESS.addHandler(capture)

    served_logging.write(entry())

    assert len(served_logging.lines()) == 1
    (record,) = capture.records
    assert record.request == entry()  # type: ignore[attr-defined]


def test_a_handler_further_up_gets_the_record_too(
    served_logging: Logging, monkeypatch: pytest.MonkeyPatch
) -> None:
    capture = Capture()
    monkeypatch.setattr(PARENT, "propagate", True)
    monkeypatch.setattr(logging.getLogger(), "handlers", [capture])

    served_logging.write(entry())

    assert len(served_logging.lines()) == 1
    assert len(capture.records) == 1


def test_a_filter_on_the_handler_decides(served_logging: Logging) -> None:
    served_logging.handler.addFilter(lambda record: False)
    try:
        served_logging.write(entry())
    finally:
        served_logging.handler.filters.clear()

    assert served_logging.lines() == []


def test_a_handler_above_info_writes_nothing(served_logging: Logging) -> None:
    served_logging.handler.setLevel(logging.WARNING)

    served_logging.write(entry())

    assert served_logging.lines() == []


def test_a_logger_that_does_not_propagate_keeps_the_line_from_its_parents_handler(
    served_logging: Logging,
) -> None:
    ACCESS.propagate = False

    served_logging.write(entry())

    assert served_logging.lines() == []


def test_another_formatter_formats_a_record(served_logging: Logging) -> None:
    served_logging.handler.setFormatter(logging.Formatter("%(levelname)s %(message)s"))

    served_logging.write(entry())

    assert served_logging.lines() == ["INFO request"]


def test_a_plain_stream_handler_formats_a_record(served_logging: Logging) -> None:
    plain = logging.StreamHandler(served_logging.out)
    plain.setFormatter(JsonFormatter())
    served_logging.handler = plain
    tally = Tally()
    plain.addFilter(tally)

    served_logging.write(entry())

    assert tally.seen == 1
    assert json.loads(served_logging.lines()[0])["request"]["route"] == "charges"


class Broken(io.StringIO):
    def write(self, text: str) -> int:
        raise OSError("the disk is full")


def test_a_failed_write_reaches_handle_error_with_the_record(
    served_logging: Logging, monkeypatch: pytest.MonkeyPatch
) -> None:
    failed: list[logging.LogRecord] = []
    handler = served_logging.handler
    assert isinstance(handler, LineHandler)
    monkeypatch.setattr(handler, "handleError", failed.append)
    handler.setStream(Broken())

    served_logging.write(entry())

    (record,) = failed
    assert record.getMessage() == "request"
    assert record.request == entry()  # type: ignore[attr-defined]


def test_a_line_that_cannot_be_formatted_reaches_handle_error_and_goes_no_further(
    served_logging: Logging, monkeypatch: pytest.MonkeyPatch
) -> None:
    failed: list[logging.LogRecord] = []
    handler = served_logging.handler
    monkeypatch.setattr(handler, "handleError", failed.append)
    unencodable = entry()
    unencodable.path = "/caf\udce9"  # a lone surrogate: orjson refuses it

    served_logging.write(unencodable)  # raises nothing

    assert served_logging.lines() == []
    (record,) = failed
    assert record.request is unencodable  # type: ignore[attr-defined]


def test_the_line_is_formatted_under_the_handlers_lock(
    served_logging: Logging, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The formatter's clock is shared by every line of the handler: formatted by two threads
    at once, a line could get the second before's time."""
    handler = served_logging.handler
    formatter = handler.formatter
    assert isinstance(formatter, JsonFormatter)
    lock = handler.lock
    assert lock is not None
    held: list[bool] = []
    format_line = formatter.line

    def line(*args: Any, **kwargs: Any) -> str:
        held.append(lock._is_owned())  # type: ignore[attr-defined]
        return format_line(*args, **kwargs)

    monkeypatch.setattr(formatter, "line", line)

    served_logging.write(entry())

    assert held == [True]
    assert len(served_logging.lines()) == 1


def test_a_patched_call_handlers_sees_every_access_record(
    served_logging: Logging, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As Sentry's logging integration patches ``Logger.callHandlers`` for its breadcrumbs."""
    seen: list[str] = []
    call_handlers = logging.Logger.callHandlers

    def patched(self: logging.Logger, record: logging.LogRecord) -> None:
        seen.append(record.name)
        call_handlers(self, record)

    monkeypatch.setattr(logging.Logger, "callHandlers", patched)

    served_logging.write(entry())

    assert seen == [ACCESS.name]
    assert len(served_logging.lines()) == 1


def test_an_emit_replaced_on_the_handler_gets_the_record(
    served_logging: Logging, monkeypatch: pytest.MonkeyPatch
) -> None:
    emitted: list[logging.LogRecord] = []
    monkeypatch.setattr(served_logging.handler, "emit", emitted.append)

    served_logging.write(entry())

    assert [record.getMessage() for record in emitted] == ["request"]
    assert served_logging.lines() == []


class Unflushable:
    """A stream with ``write`` and nothing else: ``StreamHandler`` flushes only what can."""

    def __init__(self) -> None:
        self.written: list[str] = []

    def write(self, text: str) -> int:
        self.written.append(text)
        return len(text)


def test_a_stream_without_flush_is_written_and_reports_nothing(
    served_logging: Logging, monkeypatch: pytest.MonkeyPatch
) -> None:
    failed: list[logging.LogRecord] = []
    handler = served_logging.handler
    assert isinstance(handler, LineHandler)
    monkeypatch.setattr(handler, "handleError", failed.append)
    stream = Unflushable()
    handler.setStream(stream)  # type: ignore[arg-type]

    served_logging.write(entry())

    assert failed == []
    assert len(stream.written) == 1
    assert json.loads(stream.written[0])["message"] == "request"


def test_an_emit_patched_on_the_class_gets_the_record(
    served_logging: Logging, monkeypatch: pytest.MonkeyPatch
) -> None:
    emitted: list[str] = []
    emit = logging.StreamHandler.emit

    def patched(self: logging.StreamHandler[Any], record: logging.LogRecord) -> None:
        emitted.append(record.getMessage())
        emit(self, record)

    monkeypatch.setattr(logging.StreamHandler, "emit", patched)

    served_logging.write(entry())

    assert emitted == ["request"]
    assert len(served_logging.lines()) == 1


def test_a_format_patched_on_the_class_formats_the_line(
    served_logging: Logging, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(JsonFormatter, "format", lambda self, record: "patched")

    served_logging.write(entry())

    assert served_logging.lines() == ["patched"]
