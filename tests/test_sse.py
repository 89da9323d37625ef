"""Server-sent events as the gateway cuts them: whole events, byte for byte, wherever the
chunks were cut; ``Last-Event-ID`` by the upstream's ids, else by the count of data events."""

from __future__ import annotations

import pytest

from idempotency_gateway.idempotency.sse import (
    EventSplitter,
    ResumeAfter,
    parse_event,
    split_events,
)
from idempotency_gateway.idempotency.streams import is_event_stream

MIXED_LINE_ENDS = b"data: a\n\nid: 2\r\ndata: b\r\n\r\n: ping\r\rdata: c\r\n\ndata: d"


@pytest.mark.parametrize(
    ("body", "events"),
    [
        (b"data: a\n\ndata: b\n\n", [b"data: a\n\n", b"data: b\n\n"]),
        (
            b"data: a\r\n\r\nevent: x\r\ndata: b\r\n\r\n",
            [b"data: a\r\n\r\n", b"event: x\r\ndata: b\r\n\r\n"],
        ),
        (
            MIXED_LINE_ENDS,
            [
                b"data: a\n\n",
                b"id: 2\r\ndata: b\r\n\r\n",
                b": ping\r\r",
                b"data: c\r\n\n",
                b"data: d",
            ],
        ),
        (b"", []),
        (b"data: cut mid-ev", [b"data: cut mid-ev"]),
    ],
)
def test_a_body_splits_into_its_events_and_joins_back(body: bytes, events: list[bytes]) -> None:
    assert split_events(body) == events
    assert b"".join(events) == body


@pytest.mark.parametrize("size", [1, 2, 3, 5, 7])
def test_chunks_cut_anywhere_give_the_same_events(size: int) -> None:
    splitter = EventSplitter()
    events: list[bytes] = []
    for start in range(0, len(MIXED_LINE_ENDS), size):
        events.extend(splitter.feed(MIXED_LINE_ENDS[start : start + size]))
    rest = splitter.flush()
    assert [*events, rest] == split_events(MIXED_LINE_ENDS)


def test_a_cr_at_a_chunk_end_waits_for_a_possible_lf() -> None:
    splitter = EventSplitter()
    assert splitter.feed(b"data: a\r\n\r") == []
    assert splitter.feed(b"\ndata: b\n\n") == [b"data: a\r\n\r\n", b"data: b\n\n"]


@pytest.mark.parametrize(
    ("raw", "event_id", "has_data"),
    [
        (b"id: 7\ndata: x\n\n", b"7", True),
        (b"id:7\n\n", b"7", False),
        (b"id: 1\nid: 2\n\n", b"2", False),
        (b"id: a\0b\ndata: x\n\n", None, True),
        (b": id: 3\ndata\n\n", None, True),
        (b"identity: 3\ndatum: x\n\n", None, False),
    ],
)
def test_an_event_names_its_id_and_whether_it_has_data(
    raw: bytes, event_id: bytes | None, has_data: bool
) -> None:
    event = parse_event(raw)
    assert (event.id, event.has_data) == (event_id, has_data)


COUNTED = [b": hello\n\n", b"data: 1\n\n", b"data: 2\n\n", b": ping\n\n", b"data: 3\n\n"]
WITH_IDS = [b": hello\n\n", b"id: 10\ndata: 1\n\n", b"id: 11\ndata: 2\n\n", b"id: 12\ndata: 3\n\n"]


@pytest.mark.parametrize(
    ("events", "last_event_id", "kept"),
    [
        (COUNTED, None, COUNTED),
        (COUNTED, b"0", COUNTED),
        (COUNTED, b"2", COUNTED[3:]),
        (COUNTED, b"3", []),
        (COUNTED, b"9", []),
        (WITH_IDS, b"11", WITH_IDS[3:]),
        (WITH_IDS, b"10", WITH_IDS[2:]),
        # Numbers are ids once the stream carries ids, never a count.
        (WITH_IDS, b"1", []),
        (WITH_IDS, b"nope", []),
        (COUNTED, b"nope", []),
    ],
)
def test_resume_after_last_event_id(
    events: list[bytes], last_event_id: bytes | None, kept: list[bytes]
) -> None:
    resume = ResumeAfter(last_event_id)
    assert [raw for raw in events if resume.keep(raw)] == kept


@pytest.mark.parametrize(
    ("headers", "events"),
    [
        ([(b"content-type", b"text/event-stream")], True),
        ([(b"Content-Type", b"Text/Event-Stream; charset=utf-8")], True),
        ([(b"content-type", b"text/event-stream"), (b"content-encoding", b"identity")], True),
        # Compressed: its bytes are not events, so it is never cut into events.
        ([(b"content-type", b"text/event-stream"), (b"content-encoding", b"gzip")], False),
        ([(b"content-type", b"application/json")], False),
        ([], False),
    ],
)
def test_which_answers_are_event_streams(headers: list[tuple[bytes, bytes]], events: bool) -> None:
    assert is_event_stream(headers) is events
