"""Timers that outlive the daemon: a snapshot file, written atomically.

The daemon may crash, be upgraded or be restarted by systemd while trainers
keep running; their armed timers must not be forgotten. The snapshot holds
every live timer with the identity of its process (pid and start time, read
when the timer was armed) and its deadline on the wall clock (the monotonic
clock is per boot, and a timer never needs to outlive a boot: its process
does not).

Writes go to a temporary file that is fsync'ed and renamed over the old one,
so a crash mid-write leaves the previous snapshot whole. The file is written
in chunks (a header, then frames of a few thousand timers), so that the
daemon never stalls on, or doubles its memory for, a large table.
"""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile
from pathlib import Path
from typing import Literal

import msgspec

from watchdogd_client.framing import FrameSplitter, frame

__all__ = [
    "SNAPSHOT_NAME",
    "SnapshotHeader",
    "SnapshotTimer",
    "SnapshotWriter",
    "UntrustedSnapshotError",
    "read_own_file",
    "read_snapshot",
    "write_atomically",
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


class SnapshotHeader(msgspec.Struct):
    version: int
    written_at: float


_encoder = msgspec.msgpack.Encoder()
_header_decoder = msgspec.msgpack.Decoder(SnapshotHeader)
_chunk_decoder = msgspec.msgpack.Decoder(list[SnapshotTimer])


class SnapshotWriter:
    """Writes a snapshot chunk by chunk, so no copy of a large table is ever built.

    The file is a header frame then chunk frames, each a 4-byte length and
    msgpack. It becomes the snapshot only on :meth:`commit` (fsync, rename).
    """

    def __init__(self, path: Path, written_at: float) -> None:
        self.path = path
        # mkstemp: a fresh name, O_EXCL, 0600 — nothing planted there is followed.
        self._fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
        self.temporary = Path(temporary)
        self._frame(_encoder.encode(SnapshotHeader(FORMAT_VERSION, written_at)))

    def write(self, timers: list[SnapshotTimer]) -> None:
        if timers:
            self._frame(_encoder.encode(timers))

    def _frame(self, payload: bytes) -> None:
        data = frame(payload)
        while data:
            data = data[os.write(self._fd, data) :]

    def commit(self) -> None:
        try:
            os.fsync(self._fd)
        finally:
            os.close(self._fd)
        os.replace(self.temporary, self.path)

    def abort(self) -> None:
        os.close(self._fd)
        with contextlib.suppress(FileNotFoundError):
            self.temporary.unlink()


class UntrustedSnapshotError(Exception):
    """The snapshot file is not one this daemon wrote: someone else could have."""


def read_own_file(path: Path) -> bytes | None:
    """The bytes of ``path``, a file only this uid can have written; None when missing.

    Raises :class:`UntrustedSnapshotError` for a symlink, a file of another
    owner, or one writable by others.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        raise UntrustedSnapshotError(f"{path}: {e.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise UntrustedSnapshotError(f"{path} is not a file owned by uid {os.geteuid()}")
        if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UntrustedSnapshotError(f"{path} is writable by others")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def write_atomically(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` whole, or what it held before (a crash mid-write)."""
    fd, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise


def read_snapshot(path: Path) -> tuple[SnapshotHeader, list[SnapshotTimer]] | None:
    """The snapshot at ``path``; None when there is none or it cannot be read.

    Raises :class:`UntrustedSnapshotError` for a file that is not ours alone (a
    symlink, another owner, writable by others): restoring it would let its
    writer aim timers at any process.
    """
    data = read_own_file(path)
    if data is None:
        return None
    try:
        splitter = FrameSplitter(len(data))
        frames = list(splitter.feed(data))
        if splitter.pending:
            raise msgspec.DecodeError("the snapshot ends inside a frame")
        header = _header_decoder.decode(frames[0])
        timers = [timer for frame in frames[1:] for timer in _chunk_decoder.decode(frame)]
    except (msgspec.DecodeError, IndexError):
        with contextlib.suppress(OSError):
            path.rename(path.with_suffix(".corrupt"))
        return None
    if header.version != FORMAT_VERSION:
        return None
    return header, timers
