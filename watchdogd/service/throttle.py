"""Events a peer causes at will, at most ``limits.max_noisy_events_per_s`` per source.

Bad input, refused requests and refused connections are what a flood is
made of. Each source ((event name, transport, uid); the FIFO has no uid)
gets its events recorded up to the rate, in any sliding second; the rest
are counted, and once a second a ``<name>_suppressed`` event says how many
(:mod:`watchdogd.core.throttle` has the rules). The stats count every one,
recorded or not: ``status`` and the metrics never lose any.
"""

from __future__ import annotations

import time

import anyio

from watchdogd.core.config import NoisySettings
from watchdogd.core.ports import EventSink
from watchdogd.core.throttle import Throttle
from watchdogd.service.stats import Stats

__all__ = ["NoisyEvents", "RequestAudit"]

# The window of the rate, and so how often a source's summary may come.
WINDOW = 1.0

ErrorReply = tuple[str, str]
"""A refusal: its error code and message."""

Source = tuple[str, str, int | None]
"""(event name, transport, the peer's uid or None for the FIFO)."""


class NoisyEvents:
    """Decides which noisy events are recorded, and records the summaries of the rest."""

    def __init__(self, events: EventSink, stats: Stats, settings: NoisySettings) -> None:
        self.events = events
        self.stats = stats
        self._throttle: Throttle[Source] = Throttle(settings.max_per_s, WINDOW)
        self._opened = anyio.Event()

    def allow(self, name: str, via: str, uid: int | None) -> bool:
        """Whether to record this event now; if not, it is counted for its source's summary."""
        throttle = self._throttle
        if throttle.allow((name, via, uid), time.monotonic()):
            return True
        self.stats.suppressed[name] += 1
        self._opened.set()
        return False

    def reconfigure(self, settings: NoisySettings) -> None:
        self._throttle.resize(settings.max_per_s)

    async def run(self) -> None:
        """Record each summary when it is due (a task for the daemon's life)."""
        throttle = self._throttle
        while True:
            due = throttle.next_due()
            if due is None:
                self._opened = anyio.Event()
                await self._opened.wait()
                continue
            await anyio.sleep(max(0.0, due - time.monotonic()))  # anyio refuses a negative one
            for (name, via, uid), count in throttle.due(time.monotonic()):
                self.events.emit(
                    f"{name}_suppressed", via=via, uid=uid, count=count, window_s=WINDOW
                )


class RequestAudit:
    """Counts what a front could not decode or had to refuse; an event each, rate-limited."""

    def __init__(self, noisy: NoisyEvents) -> None:
        self.noisy = noisy
        self.stats = noisy.stats
        self.events = noisy.events

    def bad_input(self, via: str, reason: str, sample: bytes, uid: int | None = None) -> None:
        """Count undecodable input from ``uid`` (None: the FIFO)."""
        self.stats.bad_input += 1
        self.stats.bad_inputs[via] += 1
        if self.noisy.allow("bad_input", via, uid):
            self.events.emit(
                "bad_input",
                via=via,
                uid=uid,
                reason=reason,
                sample=sample[:200].decode(errors="replace"),
            )

    def refused(
        self, via: str, pid: int, scope_id: str, error: ErrorReply, uid: int | None = None
    ) -> None:
        """Count a refused request from ``uid`` (None: the FIFO)."""
        self.stats.refused += 1
        code, message = error
        self.stats.refusals[code] += 1
        if self.noisy.allow("request_refused", via, uid):
            self.events.emit(
                "request_refused",
                via=via,
                uid=uid,
                pid=pid,
                scope_id=scope_id,
                code=code,
                reason=message,
            )

    def connection_refused(self, pid: int, uid: int, limit: str, reason: str) -> None:
        """Count a socket connection refused at accept for ``limit``."""
        self.stats.connections_refused[limit] += 1
        if self.noisy.allow("connection_refused", "socket", uid):
            self.events.emit(
                "connection_refused", via="socket", uid=uid, pid=pid, limit=limit, reason=reason
            )
