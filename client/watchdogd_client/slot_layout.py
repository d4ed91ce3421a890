"""The release slots' layout: timers armed and released by writing memory.

The daemon hands each socket connection a memfd (``Welcome.slot_page``: its
slot count), sealed against shrinking so that reading it can never fault.
It holds float64s in the host's order: ``slot_page`` slots of
:data:`RELEASE_SLOT_FLOATS`, then the held ring of :data:`HELD_RING`
entries of three. Slot 0 is the header.

**A slot** belongs to one scope for the connection's life (the first
``Acquire`` naming it says which). The client writes:

- :data:`SLOT_ARMED`: the count of its latest arm of the scope on this
  connection (the n-th arm is arm n), after :data:`SLOT_DEADLINE`, that
  arm's expiration time (wall clock), or NaN for an arm sent as an
  ``Acquire`` (its deadline is in the frame, and the daemon may yet refuse
  it). An arm sent as an ``Acquire`` is written before it is sent.
- :data:`SLOT_RELEASED`: the count of the latest arm it released (every
  arm up to it is released).

The daemon writes :data:`SLOT_ACCEPTED`: the arm count it read when it
last accepted an ``Acquire`` with the slot, 0 after it refused one (or
stopped watching the slot).

**A store arm** is sent nowhere. The client may make one when
``SLOT_ACCEPTED`` is at least the count of the first ``Acquire`` it sent
for the scope, with the same signal, on this connection, and the deadline
is finite and at least :data:`STORE_ARM_LEAD` seconds ahead. The daemon
reads every slot it watches at least every :data:`SLOT_SWEEP` seconds and
whenever a deadline it holds comes: the latest arm written is the timer.

**The held ring.** The daemon sees only a slot's latest arm, so the client
appends how long each timer it released through a slot was held: entry
``n`` (at ``n % HELD_RING``) is ``(slot, armed at, released at)``, wall
clock. Before it writes entries the client stores in the header's
:data:`PAGE_HELD_WRITING` float the count they bring the ring to, and after
them it stores that count in :data:`PAGE_HELD`. The client may write them in batches
(the Python client does at its look for replies, at most a millisecond of
calls after a release, and before a query, at close and at exit). The
daemon reads what is new whenever it looks at the page, up to
``PAGE_HELD``, then reads ``PAGE_HELD_WRITING`` again: an entry the client
may have been writing over meanwhile is counted as lost, never read torn.

**The header**: :data:`PAGE_CLOSED` turns non-zero once the daemon reads
the page no more (the connection is closing); the client then arms and
releases with frames, which find the daemon that serves next.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "HELD_ENTRY_FLOATS",
    "HELD_RING",
    "PAGE_CLOSED",
    "PAGE_HELD",
    "PAGE_HELD_WRITING",
    "RELEASE_SLOT_FLOATS",
    "SLOT_ACCEPTED",
    "SLOT_ARMED",
    "SLOT_DEADLINE",
    "SLOT_RELEASED",
    "SLOT_SWEEP",
    "STORE_ARM_LEAD",
    "page_bytes",
    "ring_start",
]

RELEASE_SLOT_FLOATS: Final = 4
SLOT_RELEASED: Final = 0
SLOT_ARMED: Final = 1
SLOT_DEADLINE: Final = 2
SLOT_ACCEPTED: Final = 3
PAGE_CLOSED: Final = 0
PAGE_HELD: Final = 1
PAGE_HELD_WRITING: Final = 2
HELD_RING: Final = 1024
"""Entries in the held ring: the releases a page can take between two sweeps."""
HELD_ENTRY_FLOATS: Final = 3
"""A held-ring entry: ``(slot, armed at, released at)``; entry ``n`` is at
``ring_start(slots) + HELD_ENTRY_FLOATS * (n % HELD_RING)``."""
STORE_ARM_LEAD: Final = 1.0
"""Seconds ahead a store arm's deadline must be (four sweeps)."""
SLOT_SWEEP: Final = 0.25
"""The longest the daemon goes between two reads of a slot it watches."""


def ring_start(slots: int) -> int:
    """Where the held ring starts, in floats, on a page of ``slots`` slots."""
    return slots * RELEASE_SLOT_FLOATS


def page_bytes(slots: int) -> int:
    """The size of a page of ``slots`` slots and its held ring."""
    return 8 * (ring_start(slots) + HELD_ENTRY_FLOATS * HELD_RING)
