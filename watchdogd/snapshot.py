"""Timers that outlive the daemon: a snapshot file, written atomically.

The daemon may crash, be upgraded or be restarted by systemd while trainers
keep running; their armed timers must not be forgotten. The snapshot holds
every live timer with the identity of its process (pid and start time, read
when the timer was armed) and its deadline on the wall clock (the monotonic
clock is per boot, and a timer never needs to outlive a boot: its process
does not).

Writes go to a temporary file that is fsync'ed and renamed over the old one,
so a crash mid-write leaves the previous snapshot whole.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Literal

import msgspec

__all__ = [
    "FORMAT_VERSION",
    "SNAPSHOT_NAME",
    "Snapshot",
    "SnapshotTimer",
    "read_snapshot",
    "write_snapshot",
]

SNAPSHOT_NAME = "timers.snapshot"
FORMAT_VERSION = 1


class SnapshotTimer(msgspec.Struct, array_like=True, gc=False):
    pid: int
    start_time: int
    scope_id: str
    expiration_time: float
    signal: int
    source: Literal["fifo", "socket"]
    uid: int


class Snapshot(msgspec.Struct):
    version: int
    written_at: float
    timers: list[SnapshotTimer]


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Snapshot)


def write_snapshot(path: Path, snapshot: Snapshot) -> None:
    """Replace ``path`` with ``snapshot``, atomically."""
    data = _encoder.encode(snapshot)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(temporary, path)


def read_snapshot(path: Path) -> Snapshot | None:
    """The snapshot at ``path``; None when there is none or it cannot be read."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        snapshot = _decoder.decode(data)
    except msgspec.DecodeError:
        with contextlib.suppress(OSError):
            path.rename(path.with_suffix(".corrupt"))
        return None
    if snapshot.version != FORMAT_VERSION:
        return None
    return snapshot
