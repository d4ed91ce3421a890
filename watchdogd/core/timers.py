"""The timer table: which process must finish what by when. Pure: no I/O, no clock.

Rules
-----
- A timer is keyed by ``(pid, scope_id)``. Arming an existing key replaces
  its deadline and signal; releasing removes it; releasing a missing key is a
  no-op (torch semantics: a release races an expiry harmlessly).
- Deadlines are on the caller's monotonic clock; the table never reads one.
  ``pop_expired(now)`` hands back every timer whose deadline is ``<= now``,
  soonest first, and forgets them.
- ``next_deadline()`` is the earliest live deadline, so the daemon sleeps
  exactly until then (no polling interval).

Theory of operation
-------------------
Live timers sit in ``pid -> {scope_id: Timer}``: release-all and "this
process exited" drop a pid's timers in one step, and no ``(pid, scope)``
tuple is stored per timer. The heap holds the ``Timer`` objects themselves,
ordered by ``(deadline, pid, scope_id)``. Replacing or removing a timer
marks the old object dead and leaves it in the heap (lazy deletion, as
asyncio's loop does with cancelled handles); dead entries are skipped when
they reach the top, and the heap is rebuilt from the live timers once dead
entries outnumber live ones, so memory stays O(live) and every operation
stays O(log n) amortized.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator
from typing import Literal

import msgspec

__all__ = ["IDLE_SCOPE", "Ended", "Outcome", "Source", "Timer", "TimerTable"]

Source = Literal["fifo", "socket"]
Outcome = Literal["released", "expired", "dropped"]
"""How a timer ended: its owner released it, it expired, or its process exited."""

IDLE_SCOPE = "(idle)"
"""The timer a worker with an idle timeout holds while it holds no other (the daemon's own,
released when the worker arms another: no scope of the trainer's)."""

# Below this many entries a rebuild costs more than the dead entries do.
_COMPACT_MIN = 64


class Timer(msgspec.Struct, order=True, gc=False):
    """One armed timer. Field order is heap order: ``(deadline, pid, scope_id)``."""

    deadline: float
    pid: int
    scope_id: str
    signal: int
    source: Source
    uid: int  # the requester's, -1 when unknown (FIFO); an int so heap order never fails
    armed: float = 0.0
    """When it was armed, on the deadline's clock (a job's timeline shows it from then)."""
    live: bool = True


Ended = tuple["Timer", float, Outcome, int]
"""A timer that ended: ``(timer, when (monotonic), how, its process's owner uid)``.

A plain tuple, not a class: one is made for every release, on the hot path.
"""


class TimerTable:
    def __init__(self) -> None:
        self._by_pid: dict[int, dict[str, Timer]] = {}
        self._heap: list[Timer] = []
        self._live = 0

    def __len__(self) -> int:
        return self._live

    def __iter__(self) -> Iterator[Timer]:
        """Live timers in no particular order."""
        for scopes in self._by_pid.values():
            yield from scopes.values()

    def entries(self) -> list[Timer]:
        """A cheap copy (one list of references) holding every live timer; skip ``not .live``."""
        return list(self._heap)

    def of_pid(self, pid: int) -> Iterable[Timer]:
        """Live timers of ``pid``, in no particular order."""
        scopes = self._by_pid.get(pid)
        return scopes.values() if scopes else ()

    def count_for(self, pid: int) -> int:
        scopes = self._by_pid.get(pid)
        return len(scopes) if scopes else 0

    def get(self, pid: int, scope_id: str) -> Timer | None:
        scopes = self._by_pid.get(pid)
        return scopes.get(scope_id) if scopes else None

    def arm(
        self,
        pid: int,
        scope_id: str,
        deadline: float,
        signal: int,
        source: Source = "socket",
        uid: int = -1,
        armed: float = 0.0,
    ) -> bool:
        """Arm or re-arm ``(pid, scope_id)`` at ``armed``. True when it is the new earliest."""
        timer = Timer(deadline, pid, scope_id, signal, source, uid, armed)
        scopes = self._by_pid.get(pid)
        if scopes is None:
            scopes = self._by_pid[pid] = {}
        old = scopes.get(scope_id)
        if old is None:
            self._live += 1
        else:
            old.live = False
        scopes[scope_id] = timer
        heap = self._heap
        heapq.heappush(heap, timer)
        self._maybe_compact()
        return heap[0] is timer

    def release(self, pid: int, scope_id: str) -> Timer | None:
        """Disarm ``(pid, scope_id)``; the removed timer, or None if it was not armed."""
        scopes = self._by_pid.get(pid)
        if not scopes:
            return None
        timer = scopes.pop(scope_id, None)
        if timer is None:
            return None
        if not scopes:
            del self._by_pid[pid]
        self._forget(timer)
        return timer

    def release_pid(self, pid: int) -> list[Timer]:
        """Disarm every timer of ``pid`` (released by its owner, or the process exited)."""
        scopes = self._by_pid.pop(pid, None)
        if not scopes:
            return []
        for timer in scopes.values():
            self._forget(timer)
        return list(scopes.values())

    def next_deadline(self) -> float | None:
        """The earliest live deadline, or None when nothing is armed."""
        heap = self._heap
        while heap and not heap[0].live:
            heapq.heappop(heap)
        return heap[0].deadline if heap else None

    def pop_expired(self, now: float) -> list[Timer]:
        """Remove and return every live timer with ``deadline <= now``, soonest first."""
        expired: list[Timer] = []
        heap = self._heap
        while heap and heap[0].deadline <= now:
            timer = heapq.heappop(heap)
            if not timer.live:
                continue
            scopes = self._by_pid[timer.pid]
            del scopes[timer.scope_id]
            if not scopes:
                del self._by_pid[timer.pid]
            timer.live = False
            self._live -= 1
            expired.append(timer)
        return expired

    def _forget(self, timer: Timer) -> None:
        timer.live = False
        self._live -= 1
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        heap = self._heap
        if len(heap) > _COMPACT_MIN and len(heap) > 2 * self._live:
            self._heap = [t for t in heap if t.live]
            heapq.heapify(self._heap)
