"""The timer service's counters, owned by one object.

Plain ints and ``Counter`` s bumped on the event loop (no locks, no metric
objects on the hot path), read by ``status`` and, at scrape time, by the
metrics collector's thread: a read may be one increment behind, never torn.
"""

from __future__ import annotations

from collections import Counter

__all__ = ["Stats"]


class Stats:
    """What the timer service has done since it started."""

    __slots__ = (
        "bad_input",
        "bad_inputs",
        "connections",
        "connections_refused",
        "dropped",
        "escalated",
        "expired",
        "expired_injected",
        "refusals",
        "refused",
        "requests",
        "signalled",
        "signals",
        "suppressed",
    )

    def __init__(self) -> None:
        self.expired = 0
        """Timers whose deadline passed."""
        self.expired_injected = 0
        """Of those, the timers of workers a drill's fault was injected into."""
        self.signalled = 0
        """Expiries that signalled their process."""
        self.escalated = 0
        """SIGKILLs sent after ``kill_grace``."""
        self.dropped = 0
        """Timers dropped because their process exited (or was gone at expiry or restore)."""
        self.refused = 0
        self.bad_input = 0
        self.connections = 0
        """Socket connections open now."""
        self.requests: Counter[str] = Counter()
        """Requests served, by ``fifo`` or ``socket.<op>``."""
        self.signals: Counter[int] = Counter()
        """Signals sent, by number."""
        self.refusals: Counter[str] = Counter()
        """Refused requests, by error code."""
        self.bad_inputs: Counter[str] = Counter()
        """Undecodable input, by transport."""
        self.connections_refused: Counter[str] = Counter()
        """Socket connections refused at accept, by the limit they met."""
        self.suppressed: Counter[str] = Counter()
        """Events counted but not recorded (over ``max_noisy_events_per_s``), by name."""
