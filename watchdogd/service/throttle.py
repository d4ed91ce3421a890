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

from watchdogd.core.ports import EventSink
from watchdogd.core.throttle import Throttle
from watchdogd.service.stats import Stats

__all__ = ["NoisyEvents"]

# The window of the rate, and so how often a source's summary may come.
WINDOW = 1.0

Source = tuple[str, str, int | None]
"""(event name, transport, the peer's uid or None for the FIFO)."""


class NoisyEvents:
    """Decides which noisy events are recorded, and records the summaries of the rest."""

    def __init__(self, events: EventSink, stats: Stats, rate: int) -> None:
        self.events = events
        self.stats = stats
        self._throttle: Throttle[Source] = Throttle(rate, WINDOW)
        self._opened = anyio.Event()

    def allow(self, name: str, via: str, uid: int | None) -> bool:
        """Whether to record this event now; if not, it is counted for its source's summary."""
        throttle = self._throttle
        if throttle.allow((name, via, uid), time.monotonic()):
            return True
        self.stats.suppressed[name] += 1
        self._opened.set()
        return False

    def resize(self, rate: int) -> None:
        self._throttle.resize(rate)

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
