"""A helper process that must not outlive the daemon that started it.

The kernel's parent-death signal (``PR_SET_PDEATHSIG``) ends it even when
the daemon dies by SIGKILL and runs no cleanup at all; nothing polls.
"""

from __future__ import annotations

import ctypes
import os
import signal

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """SIGKILL this process when ``parent`` (the pid that started it) dies; now if it has."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    # The signal is armed only now: a parent that died before this goes unseen.
    if os.getppid() != parent:
        os._exit(1)
