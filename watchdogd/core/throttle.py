"""How many events one source may cause: at most ``rate`` a window, the rest summarised. Pure.

Events a peer can cause at will (bad input, refused requests, refused
connections) cost the daemon formatting, the event ring and its log
destinations. A peer that floods would otherwise fill the ring with its own
noise (pushing out what an operator needs to see) and spend the loop on it.

Rules
-----
- A source is a key (the daemon uses (event name, transport, uid)). Each
  key may have ``rate`` events in any sliding ``window`` (seconds): the
  times of its last ``rate`` allowed events are kept, and an event is
  allowed when fewer than ``rate`` of them fall within the window.
- An event not allowed is counted for its key. The first one of a key
  opens a summary, due ``window`` later, that carries the count of all
  suppressed until then; the next suppressed event after that opens the
  next summary. So a key yields at most ``rate`` events and one summary in
  any window, however hard it floods, and every event is either recorded
  or counted in a summary.
- ``now`` is an argument (monotonic seconds); nothing here reads a clock
  or sleeps. The caller asks :meth:`Throttle.next_due` when to come back
  and :meth:`Throttle.due` for what to summarise then.
- Memory: a key holds at most ``rate`` times. A key is forgotten when its
  summary is due and it has been quiet for a window; one never suppressed
  stays (for the daemon: at most the node's uids times a few names).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["Throttle"]

K = TypeVar("K", bound=Hashable)


class _Source:
    __slots__ = ("allowed", "suppressed")

    def __init__(self, rate: int) -> None:
        self.allowed: deque[float] = deque(maxlen=rate)
        """When its last ``rate`` allowed events were (oldest first)."""
        self.suppressed = 0
        """Events not allowed since its open summary began (0: none open)."""


class Throttle(Generic[K]):
    """At most ``rate`` events per key in any ``window`` seconds; the rest counted per key."""

    def __init__(self, rate: int, window: float = 1.0) -> None:
        if rate < 1 or window <= 0:
            raise ValueError(f"rate must be >= 1 and window > 0, got {rate} and {window}")
        self.rate = rate
        self.window = window
        self._sources: dict[K, _Source] = {}
        # Open summaries, oldest first: due times only grow, so a deque is a heap here.
        self._open: deque[tuple[float, K]] = deque()

    def allow(self, key: K, now: float) -> bool:
        """Whether ``key``'s event at ``now`` is recorded; if not, it is counted for a summary."""
        source = self._sources.get(key)
        if source is None:
            source = self._sources[key] = _Source(self.rate)
        allowed = source.allowed
        if len(allowed) < self.rate or now - allowed[0] >= self.window:
            allowed.append(now)  # the oldest falls out (maxlen)
            return True
        if source.suppressed == 0:
            self._open.append((now + self.window, key))
        source.suppressed += 1
        return False

    def next_due(self) -> float | None:
        """When the oldest open summary is due; None when none is open."""
        return self._open[0][0] if self._open else None

    def due(self, now: float) -> list[tuple[K, int]]:
        """The summaries due by ``now``: each key and how many of its events were suppressed.

        Each is closed: the next suppressed event of that key opens another.
        """
        summaries: list[tuple[K, int]] = []
        open_, sources = self._open, self._sources
        while open_ and open_[0][0] <= now:
            _, key = open_.popleft()
            source = sources[key]
            summaries.append((key, source.suppressed))
            source.suppressed = 0
            if now - source.allowed[-1] >= self.window:
                del sources[key]  # quiet for a window: nothing to remember
        return summaries

    def resize(self, rate: int) -> None:
        """Allow ``rate`` events a window from now on (a reloaded config)."""
        if rate < 1:
            raise ValueError(f"rate must be >= 1, got {rate}")
        self.rate = rate
        for source in self._sources.values():
            source.allowed = deque(source.allowed, maxlen=rate)
