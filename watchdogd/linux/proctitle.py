"""The command line ``ps`` shows of this process, rewritten in place.

Linux shows a process's command line (``/proc/PID/cmdline``, ``ps``,
``pgrep -f``) from its argv area, the bytes between ``arg_start`` and
``arg_end`` of ``/proc/PID/stat`` (fields 48 and 49). The process may write
over that area, never past it: no privilege is needed, where moving the
area elsewhere (``prctl(PR_SET_MM_ARG_START)``) needs ``CAP_SYS_RESOURCE``.
CPython copied its argv when it started and never reads the area again.

So a process that must show a longer line than it was started with is
started with :func:`room` for it: one last argument of blanks (which ``ps``
shows as nothing). :func:`show_command_line` writes the words NUL-separated
and zeroes the rest of the area, its last byte included, which tells the
kernel to read the area as words, not as one ``setproctitle`` string; ``ps``
and ``pgrep`` drop the trailing NULs.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Sequence

__all__ = ["name_process", "room", "show_command_line"]

_ARG_START = 47  # 0-based field numbers of /proc/PID/stat
_ARG_END = 48


def _encoded(words: Sequence[str]) -> bytes:
    return b"".join(os.fsencode(word) + b"\0" for word in words)


def room(words: Sequence[str]) -> str:
    """An argument that makes a command line long enough to be rewritten as ``words``."""
    return " " * len(_encoded(words))


def _argv_area() -> tuple[int, int] | None:
    """This process's argv area (start, end); None where the kernel does not say."""
    with open("/proc/self/stat", "rb") as f:
        stat = f.read()
    # The name (field 2) may hold spaces and parentheses: count from its closing one.
    fields = stat[stat.rindex(b")") + 2 :].split()
    try:
        start, end = int(fields[_ARG_START - 2]), int(fields[_ARG_END - 2])
    except (IndexError, ValueError):
        return None
    return (start, end) if 0 < start < end else None


def show_command_line(words: Sequence[str]) -> bool:
    """Show ``words`` as this process's command line; False if the area is too short
    (what fits is shown) or unknown (nothing changes)."""
    area = _argv_area()
    if area is None:
        return False
    start, end = area
    line = _encoded(words)
    size = end - start
    ctypes.memmove(start, line[:size].ljust(size, b"\0"), size)
    return len(line) <= size


def name_process(name: str, words: Sequence[str]) -> None:
    """Show this process as ``name`` (``comm``: ``pgrep``, ``pidof``, ``top``; at most
    15 bytes) and ``words`` (its command line: ``ps``, ``pgrep -f``), where allowed."""
    with contextlib.suppress(OSError), open("/proc/self/comm", "w") as f:
        f.write(name)
    show_command_line(words)
