"""Release slots: memory a client shares with the daemon, one page set per connection.

A client re-arms and releases a timer by writing into it (see
:mod:`watchdogd_client.slot_layout`), which costs it no
system call; the daemon reads the slot when it needs to know. The daemon
makes the memfd, so the client cannot hand it a file that shrinks under the
mapping (a read past its end would be SIGBUS in the daemon): it is sealed
at its size before the client gets a descriptor.
"""

from __future__ import annotations

import fcntl
import mmap
import os

from watchdogd_client.slot_layout import page_bytes

__all__ = ["SLOTS", "create_release_slots"]

SLOTS = 256
"""Slots per connection, the header's included."""
_SIZE = page_bytes(SLOTS)  # 32 KiB, the held ring's 24

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL


def create_release_slots() -> tuple[int, memoryview[float]]:
    """A sealed memfd of :data:`SLOTS` zeroed slots and the held ring, and the daemon's
    view of its float64s.

    The descriptor is the caller's to hand on and close; the mapping lives as
    long as the view (and whatever holds it).
    """
    fd = os.memfd_create("watchdogd-release-slots", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, _SIZE)
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
        mapping = mmap.mmap(fd, _SIZE)
    except BaseException:
        os.close(fd)
        raise
    return fd, memoryview(mapping).cast("d")
