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
- A timer may carry a :class:`ReleaseMark`: its owner can re-arm or
  release it by writing memory, and the table holds it as it was until
  someone asks.

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
import math
from collections.abc import Iterable, Iterator
from typing import Literal

import msgspec

from watchdogd_client.slot_layout import (
    HELD_ENTRY_FLOATS,
    HELD_RING,
    PAGE_HELD,
    PAGE_HELD_WRITING,
    RELEASE_SLOT_FLOATS,
    SLOT_ACCEPTED,
    SLOT_ARMED,
    SLOT_DEADLINE,
    SLOT_RELEASED,
    ring_start,
)

__all__ = ["ReleaseMark", "SlotPage", "Source", "Timer", "TimerTable"]

Source = Literal["fifo", "socket"]

# Below this many entries a rebuild costs more than the dead entries do.
_COMPACT_MIN = 64


class SlotPage:
    """A connection's release slots as the daemon reads them (``watchdogd_client.slot_layout``)."""

    __slots__ = ("floats", "lost", "read", "ring", "scopes")

    def __init__(self, floats: memoryview[float], slots: int) -> None:
        self.floats = floats
        self.ring = ring_start(slots)
        """Where the held ring starts."""
        self.scopes: dict[int, str] = {}
        """Slot -> the scope it is for (named by the first ``Acquire`` with it)."""
        self.read = 0
        """The held entries read so far."""
        self.lost = 0
        """Held entries the owner wrote over before they were read."""

    def mark(self, slot: int) -> ReleaseMark:
        return ReleaseMark(self.floats, slot, 0.0)

    def held(self, limit: int = HELD_RING) -> list[tuple[str, float, float]]:
        """What the owner released since the last call: ``(scope, armed at, released at)``,
        wall clock, oldest first; at most ``limit`` entries (the rest stay for the next).

        At most a ring's worth: a count the owner wrote that is not one (NaN, a
        leap past the ring, one that went back) costs it its own entries only.
        """
        floats, read = self.floats, self.read
        written = floats[PAGE_HELD]
        if limit <= 0 or not read < written < read + (1 << 52):  # past 2**52 floats skip integers
            return []
        start = max(read, int(written) - HELD_RING)
        end = min(int(written), start + limit)
        raw = []
        for n in range(start, end):
            at = self.ring + HELD_ENTRY_FLOATS * (n % HELD_RING)
            raw.append((n, floats[at], floats[at + 1], floats[at + 2]))
        # What the owner was writing meanwhile may have overwritten the oldest of them.
        after = floats[PAGE_HELD_WRITING]
        fresh = int(after) - HELD_RING if end <= after < end + (1 << 52) else end
        self.read = end
        self.lost += start - read
        spans = []
        for n, slot, armed, released in raw:
            scope_id = self.scopes.get(int(slot)) if slot.is_integer() else None
            if n < fresh or scope_id is None or not 0.0 <= released - armed < math.inf:
                self.lost += 1
                continue
            spans.append((scope_id, armed, released))
        return spans


class ReleaseMark:
    """Where a timer's owner re-arms and releases it without a request: a slot of
    floats it shares with the daemon (``watchdogd_client.slot_layout``).

    Reading it is a read of memory; the table never does. Whoever acts on a
    timer's deadline, lists it or re-arms its key asks :meth:`latest`.
    """

    __slots__ = ("arm", "base", "slots", "written")

    def __init__(self, slots: memoryview[float], index: int, arm: float) -> None:
        self.slots = slots
        self.base = index * RELEASE_SLOT_FLOATS
        self.arm = arm
        """Which arm of its slot the timer's deadline is (the owner counts them)."""
        self.written = math.nan
        """The deadline read with that arm (NaN: it came in a request)."""

    def newer(self, arm: float, written: float) -> bool:
        """Whether ``(arm, written)``, read from the slot, is a store arm to follow.

        The same count with another deadline is one too: where stores may become
        visible out of order, the count was read before its deadline was.
        """
        if not math.isfinite(written):
            return False  # an arm whose request is still on its way (or garbage)
        return arm > self.arm or (arm == self.arm and written != self.written)

    def latest(self) -> tuple[float, float] | None:
        """The count and expiration time (wall clock) of the owner's latest arm, or None
        once it released that arm (and with it every one before).

        A NaN never releases: a count that compares false holds the timer.
        """
        slots, i = self.slots, self.base
        # The owner writes the deadline, then its count: the count is read first.
        armed = slots[i + SLOT_ARMED]
        if slots[i + SLOT_RELEASED] >= armed:
            return None
        return armed, slots[i + SLOT_DEADLINE]

    def since(self) -> Literal["held", "released"] | tuple[float, float]:
        """What the owner wrote since this arm: a later store arm to follow (its
        count and deadline), ``"released"`` (this arm, or one after it), or ``"held"``.

        Released means released even while the next arm's request is on its way
        (or was refused): its count is in the slot before the daemon reads it.
        """
        slots, i = self.slots, self.base
        armed = slots[i + SLOT_ARMED]
        released = slots[i + SLOT_RELEASED]
        if not released >= armed:
            deadline = slots[i + SLOT_DEADLINE]
            if self.newer(armed, deadline):
                return armed, deadline
        return "released" if released >= self.arm else "held"

    def armed(self) -> float:
        """The count of the owner's latest arm, released or not."""
        return self.slots[self.base + SLOT_ARMED]

    def same_slot(self, other: ReleaseMark) -> bool:
        return self.slots is other.slots and self.base == other.base

    def accept(self, arm: float) -> None:
        """Tell the owner its arms up to ``arm`` are watched (0: none; arm with requests)."""
        self.slots[self.base + SLOT_ACCEPTED] = arm

    # Heap order never depends on it (the fields before it decide): two timers
    # only get this far in a tie, and then neither goes first.
    def __lt__(self, other: object) -> bool:
        return False

    def __gt__(self, other: object) -> bool:
        return False


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
    release: ReleaseMark | None = None
    """Before ``live``: msgspec orders by the last field with ``<`` itself, even on a
    tie, and ``None < None`` has no answer."""
    live: bool = True


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
        release: ReleaseMark | None = None,
    ) -> bool:
        """Arm or re-arm ``(pid, scope_id)`` at ``armed``. True when it is the new earliest."""
        timer = Timer(deadline, pid, scope_id, signal, source, uid, armed, release)
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
