"""Recording events: the ring operators read, the daemon's log, torch's handlers.

:class:`EventLog` is the daemon's :class:`~watchdogd.core.ports.EventSink`.
Each event goes to a ring of the last ``capacity`` events (``watchdogctl
events`` shows what just happened), to the ``watchdogd`` logger (text or
one JSON object a line), and to torch-style event handlers by name
(``record``; ``null`` costs nothing). None of them writes from here: the
commands route the logger, and the daemon every event destination, through a
:class:`~watchdogd.linux.logsink.LogSink`, whose thread does the writing.
A follower gets every new event through a bounded buffer: a follower that
reads too slowly loses events (and is told how many) — it never makes the
daemon wait or grow.

:func:`install_event_handler` gives a destination name a handler, as
torchrun's ``--event-log-handler`` expects one to exist: torch's own
(``null``, ``console``, ``dynamic_rendezvous``) or one already registered in
this process; else the config's ``[event_handlers]`` table
(``name = "module:attribute"``); else the entry point of that name in the
group ``watchdogd.event_handlers`` (torch has no way to add one). Either
names a ``logging.Handler`` or a callable that returns one.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Literal

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from watchdogd.core.config import ConfigError
from watchdogd.core.ports import Metadata
from watchdogd.linux.plugins import PluginError, load_entry_point, load_reference
from watchdogd_client.events import (
    Event,
    EventSource,
    get_logging_handler,
    record,
    register_handler,
)

log = logging.getLogger("watchdogd")

__all__ = ["EVENT_HANDLERS_GROUP", "EventLog", "Follower", "install_event_handler"]

EVENT_HANDLERS_GROUP = "watchdogd.event_handlers"


def _find_handler(name: str, configured: Mapping[str, str]) -> tuple[str, object] | None:
    """Where ``name``'s handler comes from, and what is there; None: it is known already."""
    if name in configured:
        return f"event_handlers.{name}", load_reference(configured[name])
    try:
        get_logging_handler(name)
        return None  # torch's own, or registered in this process already
    except ValueError:
        pass
    found = load_entry_point(EVENT_HANDLERS_GROUP, name)
    if found is None:
        raise PluginError(
            "not torch's (null, console, dynamic_rendezvous), not in the config's "
            f"[event_handlers], and no entry point of that name in {EVENT_HANDLERS_GROUP!r}"
        )
    return f"entry point {EVENT_HANDLERS_GROUP}[{name}]", found


def install_event_handler(name: str, configured: Mapping[str, str]) -> None:
    """Make ``name`` an event destination; ConfigError saying where it was looked for."""
    try:
        found = _find_handler(name, configured)
    except PluginError as e:
        raise ConfigError(f"event_log_handler {name!r}: {e}") from None
    if found is None:
        return
    where, handler = found
    if callable(handler):  # a class or a factory; a Handler itself is not callable
        try:
            handler = handler()
        except Exception as e:  # their factory's code: anything may fail in it
            raise ConfigError(
                f"event_log_handler {name!r}: {where}: {type(e).__name__}: {e}"
            ) from None
    if not isinstance(handler, logging.Handler):
        raise ConfigError(
            f"event_log_handler {name!r}: {where} gives a {type(handler).__name__}, "
            "not a logging.Handler"
        )
    register_handler(name, handler)


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
        destinations: tuple[str, ...] = (),
        follower_buffer: int = 1_000,
    ) -> None:
        self._ring: deque[Event] = deque(maxlen=capacity)
        self._followers: set[Follower] = set()
        self._follower_buffer = follower_buffer
        self.log_format = log_format
        self.destinations = destinations

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
        for destination in self.destinations:
            record(event, destination)

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
