"""The queries on the live timers: ``list_timers`` and the timeline.

Operators (``uid`` None) see every timer; others only those on their own
processes, and for them only their own are walked, not the table.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Iterable, Iterator

from watchdogd.core.config import QuerySettings
from watchdogd.core.timers import Timer, TimerTable
from watchdogd.service.process_watch import ProcessWatch
from watchdogd.service.timeline import Timeline
from watchdogd_client import protocol as p

__all__ = ["TimerQueries"]


class TimerQueries:
    def __init__(
        self, table: TimerTable, watch: ProcessWatch, timeline: Timeline, settings: QuerySettings
    ) -> None:
        self.table = table
        self.watch = watch
        self.timeline = timeline
        self.settings = settings

    def reconfigure(self, settings: QuerySettings) -> None:
        self.settings = settings

    def timer_list(self, seq: int, uid: int | None) -> p.TimerList:
        """The soonest timers (of processes of ``uid``; all when None), and how many exist."""
        if uid is None:
            timers: Iterable[Timer] = self.table
            total = len(self.table)
        else:
            own = list(self._owned(uid))
            timers, total = own, len(own)
        now = time.monotonic()
        wall = time.time()
        infos = [
            p.TimerInfo(
                pid=t.pid,
                scope_id=t.scope_id,
                remaining_s=t.deadline - now,
                expiration_time=wall + (t.deadline - now),
                signal=t.signal,
                source=t.source,
                uid=None if t.uid < 0 else t.uid,
            )
            for t in heapq.nsmallest(self.settings.max_listed, timers)
        ]
        return p.TimerList(seq, infos, total)

    def timeline_spans(self, uid: int | None) -> list[p.TimerSpan]:
        """Recent timers from arming to their end, then live ones (those of ``uid``'s processes).

        At most ``timeline_size`` live ones, whichever come first, unsorted: for an
        operator the work on the loop stays bounded however many timers the node
        holds; for others, as for ``timer_list``, only their own are walked.
        """
        owner = self.watch.owner
        live: Iterable[tuple[Timer, int]] = (
            ((t, owner(t.pid)) for t in self.table)
            if uid is None
            else ((t, uid) for t in self._owned(uid))
        )
        return self.timeline.spans(itertools.islice(live, self.timeline.ended.maxlen or 0), uid)

    def _owned(self, uid: int) -> Iterator[Timer]:
        """The live timers on ``uid``'s processes: a walk of those, not of the table."""
        table = self.table
        for pid in self.watch.pids_of(uid):
            yield from table.of_pid(pid)
