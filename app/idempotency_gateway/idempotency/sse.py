"""Server-sent events as the gateway sees them: boundaries and ids, never a rewrite.

An event is every byte up to and including the blank line that ends it, exactly as the
upstream sent them, so the events joined are the upstream's body byte for byte. What the
gateway reads from an event is only where it ends, its ``id:`` field and whether it carries
``data`` (the events a client's parser dispatches, and so counts).

``ResumeAfter`` is the ``Last-Event-ID`` rule of docs/CONTRACT.md: after the event whose
``id:`` is that value, once the stream has carried an ``id:``; in a stream without ids, after
that many events with data.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# Two line ends in a row: a line end, then an empty line. A lone CR is a line end of its own
# only when no LF follows it (CRLF is one line end).
_EVENT_END = re.compile(rb"(?:\r\n|\r(?!\n)|\n)(?:\r\n|\r(?!\n)|\n)")
_LINE_END = re.compile(rb"\r\n|\r|\n")


@dataclass(frozen=True, slots=True)
class Event:
    id: bytes | None  # the value of its last ``id:`` field, if it has one
    has_data: bool


def parse_event(raw: bytes) -> Event:
    event_id: bytes | None = None
    has_data = False
    for line in _LINE_END.split(raw):
        name, colon, value = line.partition(b":")
        if name == b"data":
            has_data = True
        elif name == b"id" and colon:
            value = value.removeprefix(b" ")
            # The SSE standard ignores an id with NUL in it; so does every client.
            if b"\0" not in value:
                event_id = value
    return Event(event_id, has_data)


class EventSplitter:
    """Cuts a body arriving in chunks into whole events, wherever the chunks were cut."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        events: list[bytes] = []
        start = 0
        # Only the last two bytes of what was pending could begin an event's end.
        search_from = max(len(self._pending) - 2, 0)
        buffer = self._pending + chunk
        while (found := _EVENT_END.search(buffer, max(search_from, start))) is not None:
            if found.end() == len(buffer) and buffer.endswith(b"\r"):
                break  # an LF in the next chunk would make this CR part of a CRLF
            events.append(buffer[start : found.end()])
            start = found.end()
        self._pending = buffer[start:]
        return events

    def flush(self) -> bytes:
        """What the body ended with after its last whole event (a stream cut mid-event, or
        one that ends on a CR): sent on as it is, an event of its own for the gateway."""
        rest, self._pending = self._pending, b""
        return rest


def split_events(body: bytes) -> list[bytes]:
    """A whole body's events; their concatenation is ``body``."""
    splitter = EventSplitter()
    events = splitter.feed(body)
    rest = splitter.flush()
    return [*events, rest] if rest else events


# A count of more digits than this no stream reaches; converting it would cost time, and past
# 4300 digits int() refuses (a follower left without any answer). It names no event: skip all.
_MAX_COUNT_DIGITS = 18


class ResumeAfter:
    """Which events a client resuming after ``Last-Event-ID`` still needs, fed in order."""

    def __init__(self, last_event_id: bytes | None) -> None:
        self._last_id = last_event_id
        self._resumed = last_event_id is None
        self._count = (
            int(last_event_id)
            if last_event_id and last_event_id.isdigit() and len(last_event_id) <= _MAX_COUNT_DIGITS
            else None
        )
        self._by_id = False
        self._counted = 0

    def keep(self, raw: bytes) -> bool:
        if self._resumed:
            return True
        event = parse_event(raw)
        if event.id is not None:
            self._by_id = True
        if self._by_id:
            # The event the client has is not sent again; everything after it is.
            self._resumed = event.id == self._last_id
            return False
        if self._count is not None and self._counted >= self._count:
            self._resumed = True
            return True
        if event.has_data:
            self._counted += 1
        return False
