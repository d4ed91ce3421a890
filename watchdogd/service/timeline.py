"""The recent timers, from arming to their end: the slices of a job's timeline.

No event is recorded per timer request (a trainer arms thousands a
second). Instead each timer that ends — released, expired, or dropped with
its process — is appended, as the ``Timer`` it already was, to a ring of
the last ``size`` (``timeline_size``); ``watchdogctl events --trace`` and
``watchdogd run --trace`` read it with the events. One append per ended
timer is all the hot path pays; a size of 0 keeps nothing.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Literal

from watchdogd.core.config import TimelineSettings
from watchdogd.core.timers import Ended, Outcome, Timer
from watchdogd_client import protocol as p

__all__ = ["Timeline"]


class Timeline:
    """Ended timers: ``(timer, ended, outcome, owner uid)``, monotonic times, oldest first."""

    def __init__(self, settings: TimelineSettings) -> None:
        self.ended: deque[Ended] = deque(maxlen=settings.size)

    def reconfigure(self, settings: TimelineSettings) -> None:
        """Keep the last ``size`` timers that ended from now on (the newest of those kept)."""
        if settings.size != self.ended.maxlen:
            self.ended = deque(self.ended, maxlen=settings.size)

    def timer_ended(self, ended: Ended) -> None:
        """The timer core's observer of every timer that ended."""
        self.ended.append(ended)

    def spans(self, live: Iterable[tuple[Timer, int]], uid: int | None) -> list[p.TimerSpan]:
        """Ended timers, then ``live`` ones (with their process's owner), of ``uid``'s processes.

        ``uid`` None: everyone's.
        """
        offset = time.time() - time.monotonic()
        spans = [
            _span(timer, ended + offset, outcome, offset)
            for timer, ended, outcome, owner in self.ended
            if uid is None or owner == uid
        ]
        spans += [
            _span(timer, None, "armed", offset)
            for timer, owner in live
            if uid is None or owner == uid
        ]
        return spans


def _span(
    timer: Timer, ended: float | None, outcome: Outcome | Literal["armed"], offset: float
) -> p.TimerSpan:
    return p.TimerSpan(
        pid=timer.pid,
        scope_id=timer.scope_id,
        armed=timer.armed + offset,
        ended=ended,
        outcome=outcome,
        uid=None if timer.uid < 0 else timer.uid,
    )
