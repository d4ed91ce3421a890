"""Recent events, and the operators following them live.

The daemon keeps the last ``capacity`` events in a ring, so ``watchdogctl
events`` can show what just happened. A follower gets every new event
through a bounded buffer: a follower that reads too slowly loses events
(and is told how many) — it never makes the daemon wait or grow.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from watchdogd_client.events import Event

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
    def __init__(self, capacity: int = 10_000, follower_buffer: int = 1_000) -> None:
        self._ring: deque[Event] = deque(maxlen=capacity)
        self._followers: set[Follower] = set()
        self._follower_buffer = follower_buffer

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
