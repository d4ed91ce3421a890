"""Recording events: the ring operators read, the daemon's log, torch's handlers.

:class:`EventLog` is the daemon's :class:`~watchdogd.core.ports.EventSink`.
Each event goes to a ring of the last ``capacity`` events (``watchdogctl
events`` shows what just happened), to the ``watchdogd`` logger (text or
one JSON object a line), and to a torch-style event handler by name
(``record``; ``null`` costs nothing). Neither writes from here: the
commands route the logger, and the daemon its event-log file, through a
:class:`~watchdogd.linux.logsink.LogSink`, whose thread does the writing.
A follower gets every new event through a bounded buffer: a follower that
reads too slowly loses events (and is told how many) — it never makes the
daemon wait or grow.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from watchdogd.core.ports import Metadata
from watchdogd_client.events import Event, EventSource, record

log = logging.getLogger("watchdogd")

__all__ = ["EventLog", "Follower"]


class Follower:
    def __init__(self, buffer: int) -> None:
        self._send: MemoryObjectSendStream[Event]
        self.receive: MemoryObjectReceiveStream[Event]
        self._send, self.receive = anyio.create_memory_object_stream[Event](buffer)
        self.dropped = 0

    def offer(self, event: Event) -> None:
        try:
            self._send.send_nowait(event)
        except anyio.WouldBlock:
            self.dropped += 1

    def close(self) -> None:
        self._send.close()
        self.receive.close()

    def take_dropped(self) -> int:
        dropped, self.dropped = self.dropped, 0
        return dropped


class EventLog:
    def __init__(
        self,
        capacity: int = 10_000,
        *,
        log_format: Literal["text", "json"] = "text",
        destination: str = "null",
        follower_buffer: int = 1_000,
    ) -> None:
        self._ring: deque[Event] = deque(maxlen=capacity)
        self._followers: set[Follower] = set()
        self._follower_buffer = follower_buffer
        self.log_format = log_format
        self.destination = destination

    def emit(self, name: str, /, **metadata: Metadata) -> None:
        """Record an event, logged at INFO."""
        self.emit_at(logging.INFO, name, **metadata)

    def emit_at(self, level: int, name: str, /, **metadata: Metadata) -> None:
        """Record an event, logged at ``level``."""
        event = Event(name, EventSource.AGENT, time.time_ns() // 1_000_000, metadata)
        self.append(event)
        if log.isEnabledFor(level):
            if self.log_format == "json":
                log.log(level, "%s", event.serialize())
            else:
                fields = " ".join(f"{key}={value!r}" for key, value in metadata.items())
                log.log(level, "%s %s", name, fields)
        record(event, self.destination)

    def append(self, event: Event) -> None:
        self._ring.append(event)
        for follower in self._followers:
            follower.offer(event)

    def since(self, timestamp_ms: int | None = None, limit: int | None = None) -> list[Event]:
        """Events at or after ``timestamp_ms`` (all kept ones when None), the newest ``limit``."""
        events = [e for e in self._ring if timestamp_ms is None or e.timestamp >= timestamp_ms]
        return events[-limit:] if limit else events

    @contextmanager
    def follow(
        self, timestamp_ms: int | None = None, limit: int | None = None
    ) -> Iterator[tuple[list[Event], Follower]]:
        """The backlog and a follower for what comes next, with no gap and no overlap."""
        follower = Follower(self._follower_buffer)
        self._followers.add(follower)
        try:
            yield self.since(timestamp_ms, limit), follower
        finally:
            self._followers.discard(follower)
            follower.close()
