"""Stack dumps: :mod:`faulthandler` writing into a file the daemon handed over.

Connected from the main thread, the client also installs a Python handler
for the stack signal, which faulthandler chains to once its dump is
written: the handler appends :data:`~watchdogd_client.protocol.DUMP_MARKER`,
and the daemon signals the process as soon as it reads it. A main thread
stuck in C code runs no Python handler; the daemon then waits until the
file stops growing, as it does for clients that write no marker.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal as _signal
import threading

from . import protocol as p

__all__ = ["StackDumpFile", "can_mark"]

# stack signal -> the faulthandler file its dump marker goes to (the last one registered).
_marker_fds: dict[int, int] = {}


def _write_dump_marker(signum: int, frame: object) -> None:
    """Chained to by faulthandler's handler, so it runs once the dump is written."""
    fd = _marker_fds.get(signum, -1)
    if fd >= 0:
        with contextlib.suppress(OSError):
            os.write(fd, p.DUMP_MARKER)


def can_mark(signum: int) -> bool:
    """Whether this thread can have a dump marker written after faulthandler's output."""
    return (
        _signal.getsignal(signum) is _write_dump_marker
        or threading.current_thread() is threading.main_thread()
    )


class StackDumpFile:
    """One client's faulthandler registration on ``signal`` (None: the client wants none)."""

    def __init__(self, signal: int | None) -> None:
        self.signal = signal
        self._fd = -1

    def free_signal(self) -> int | None:
        """The stack signal, if nobody else handles it (or we registered it ourselves)."""
        if self.signal is None:
            return None
        handler = _signal.getsignal(self.signal)
        if self._fd < 0 and handler not in (_signal.SIG_DFL, _write_dump_marker):
            return None
        return self.signal

    def register(self, signal: int, fd: int, marker: bool) -> None:
        """Dump into ``fd`` (now owned here) on ``signal``; ``marker``: then write the marker."""
        if marker:
            _marker_fds[signal] = fd
            if _signal.getsignal(signal) is not _write_dump_marker:
                # faulthandler chains to the handler it found when first registered:
                # ours must be there first (a registration without it is redone).
                faulthandler.unregister(signal)
                _signal.signal(signal, _write_dump_marker)
        faulthandler.register(signal, file=fd, all_threads=True, chain=marker)
        if self._fd >= 0:
            os.close(self._fd)  # the previous daemon's file
        self._fd = fd

    def forget(self) -> None:
        """Undo the registration (a forked child must not dump into its parent's file)."""
        if self._fd < 0 or self.signal is None:
            return
        faulthandler.unregister(self.signal)
        if _signal.getsignal(self.signal) is _write_dump_marker:
            with contextlib.suppress(ValueError):
                _signal.signal(self.signal, _signal.SIG_DFL)
        _marker_fds.pop(self.signal, None)
        os.close(self._fd)
        self._fd = -1
