"""Processes by identity, not by number.

A pid is only a number: once its process exits and is reaped, the kernel
hands it to the next process that starts. The daemon therefore opens a
pidfd when it first arms a timer for a pid and signals through that pidfd
(``pidfd_send_signal``), which can only ever reach the process it was opened
on. The pidfd also becomes readable when that process exits, which is how
the daemon drops an exited process's timers without polling.
"""

from __future__ import annotations

import errno
import os

import msgspec

from watchdogd_client._proc import PinnedProcess, stat_fields

__all__ = [
    "ProcessHandle",
    "RunQueueClock",
    "ancestors",
    "catches_signal",
    "open_process",
    "read_rss",
    "read_stat",
    "still_runs",
]

_PF_KTHREAD = 0x00200000
_PID_MAX = 2**22  # the kernel's ceiling (PID_MAX_LIMIT); anything above is no process


class Stat(msgspec.Struct, frozen=True):
    state: str
    ppid: int
    flags: int
    start_time: int
    session: int


class ProcessHandle(PinnedProcess):
    """A timer's target: pinned by its pidfd, with who it is (read once, at pinning)."""

    __slots__ = ("kernel_thread", "start_time", "uid")

    def __init__(
        self, pid: int, pidfd: int, uid: int, start_time: int, kernel_thread: bool
    ) -> None:
        super().__init__(pid, pidfd)
        self.uid = uid
        self.start_time = start_time
        self.kernel_thread = kernel_thread

    def duplicate(self) -> ProcessHandle:
        """An independent handle on the same process (its own pidfd)."""
        return ProcessHandle(
            self.pid, os.dup(self.pidfd), self.uid, self.start_time, self.kernel_thread
        )


def read_rss(pid: int) -> int | None:
    """Resident memory of ``pid`` in bytes (``/proc/PID/statm``); None once it is gone."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            resident = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return resident * os.sysconf("SC_PAGE_SIZE")


def read_stat(pid: int) -> Stat:
    """Fields of ``/proc/PID/stat``; ProcessLookupError if there is no such process."""
    fields = stat_fields(pid)
    return Stat(fields[0].decode(), int(fields[1]), int(fields[6]), int(fields[19]), int(fields[3]))


def still_runs(pid: int, start_time: int) -> bool:
    """Whether the process ``pid`` that started at ``start_time`` (``/proc/PID/stat``
    field 22) still runs: not a zombie, and not a later process given its number."""
    try:
        now = read_stat(pid)
    except ProcessLookupError:
        return False
    return now.start_time == start_time and now.state not in ("Z", "X")


def catches_signal(pid: int, signum: int) -> bool:
    """Whether ``pid`` has a handler for ``signum`` (``SigCgt`` in ``/proc/PID/status``)."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"SigCgt:"):
                    return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except OSError:
        pass
    return False


def _read_uid(pid: int) -> int:
    """The real uid of process ``pid``; ProcessLookupError if there is no such process."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"Uid:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    raise ProcessLookupError(pid)


def open_process(pid: int, pidfd: int | None = None) -> ProcessHandle:
    """Pin process ``pid`` by a pidfd and read who it is; ProcessLookupError if none.

    ``pidfd``, when given, already pins it (``SO_PEERPIDFD``): it is adopted.
    """
    if not 0 < pid <= _PID_MAX:
        # 0: a peer in another pid namespace. An adopted pidfd is ours to close.
        if pidfd is not None:
            os.close(pidfd)
        raise ProcessLookupError(pid)
    if pidfd is None:
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            raise
        except OSError as e:
            if e.errno in (errno.ESRCH, errno.EINVAL):
                raise ProcessLookupError(pid) from e
            raise  # EMFILE and the like: a resource problem, not a missing process
    try:
        stat = read_stat(pid)
        uid = _read_uid(pid)
        handle = ProcessHandle(
            pid, pidfd, uid, stat.start_time, bool(stat.flags & _PF_KTHREAD) or stat.ppid == 2
        )
        # Read after the pidfd was open: if the process is still alive now,
        # /proc/PID described it and not a successor that reused the number.
        if handle.exited() or stat.state in ("Z", "X"):
            raise ProcessLookupError(pid)
    except BaseException:
        os.close(pidfd)
        raise
    return handle


def ancestors(pid: int) -> list[int]:
    """``pid``'s parent, grandparent, … up to (not including) pid 0."""
    chain = []
    while pid > 1:
        try:
            pid = read_stat(pid).ppid
        except ProcessLookupError:
            break
        if pid > 0:
            chain.append(pid)
    return chain


class RunQueueClock:
    """How long the calling thread has waited for a CPU (``/proc/thread-self/schedstat``).

    Time spent runnable but not running is the machine's doing, not the
    thread's: the loop monitor subtracts it from a late tick. Reads 0
    where the kernel does not keep schedstats.
    """

    def __init__(self) -> None:
        try:
            self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            self._fd = -1

    def waited(self) -> float:
        """Seconds this thread has spent on a run queue, waiting to run."""
        if self._fd < 0:
            return 0.0
        fields = os.pread(self._fd, 128, 0).split()
        return int(fields[1]) / 1e9 if len(fields) > 1 else 0.0

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
