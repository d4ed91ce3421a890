"""Where a hung process was stuck: its Python stacks, captured before it is killed.

Two ways, tried in order, each bounded in time so that one slow capture
never delays another expiry:

``faulthandler``
    The client registers :func:`faulthandler.register` on a signal (default
    SIGUSR2), writing into a file the daemon opened for that pid and passed
    over the socket (``SCM_RIGHTS``). To capture, the daemon sends the signal
    and reads what was appended, up to the client's end-of-dump marker (or,
    without one, until the file stops growing). Works for any user, needs no
    privilege.
``py-spy``
    ``py-spy dump --pid PID`` when installed and permitted (root, or
    ``CAP_SYS_PTRACE``). Works on processes that registered nothing, even
    ones stuck in C code.

Each dump is a text file under ``<state dir>/dumps/`` whose first line is a
header naming the pid, scope and method; the newest ``keep`` are kept
(:meth:`StackStore.prune`). A kill waits for neither: the signal goes out
once the dump is read; the ``timer_expired`` event that names the dump is
recorded once it is saved. The
NCCL flight-recorder traces of the hung process's group, when its ranks
record them (:mod:`watchdogd.linux.flight_recorder`), are kept beside it
as they were written, ``<id>.rank<N>.trace``, and listed in its header.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from subprocess import DEVNULL, PIPE

import anyio
import msgspec

from watchdogd.linux.procs import ProcessHandle
from watchdogd_client.protocol import DUMP_MARKER, DumpInfo, TraceInfo

__all__ = ["DumpInfo", "FaulthandlerCaptures", "StackStore", "TraceInfo", "capture_pyspy"]

_HEADER = "# watchdogd stack dump "
# How often pending captures are checked (the loop's timers have a 1 ms grain).
_TICK = 0.001
# faulthandler writes the whole dump from its signal handler at once; a file
# that stopped growing for this long holds all of it (the bound for clients
# that write no marker).
_QUIET = 0.008


class StackStore:
    """The dumps directory: faulthandler files per pid, and saved dumps."""

    def __init__(self, directory: Path, keep: int = 100) -> None:
        self.directory = directory
        self.keep = keep

    def prepare(self) -> None:
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)

    def faulthandler_file(self, pid: int, start_time: int) -> int:
        """Open (for the client to write into) the faulthandler file of one process."""
        return os.open(
            self.live_path(pid, start_time),
            os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC,
            0o600,
        )

    def live_path(self, pid: int, start_time: int) -> Path:
        return self.directory / f"live-{pid}-{start_time}.faulthandler"

    def save(
        self,
        pid: int,
        scope_id: str,
        method: str,
        text: str,
        traces: Sequence[tuple[TraceInfo, bytes]] = (),
    ) -> DumpInfo:
        now = time.time()
        info = DumpInfo(
            id=f"{int(now * 1000)}-{pid}",
            pid=pid,
            scope_id=scope_id,
            method=method,
            timestamp=now,
            size=len(text),
            traces=[trace for trace, _ in traces],
        )
        for trace, data in traces:
            if data:
                self._trace_path(info.id, trace.rank).write_bytes(data)
        header = _HEADER + msgspec.json.encode(info).decode()
        (self.directory / f"{info.id}.txt").write_text(f"{header}\n{text}")
        return info

    def _trace_path(self, dump_id: str, rank: int) -> Path:
        return self.directory / f"{dump_id}.rank{rank}.trace"

    def list(self) -> list[DumpInfo]:
        dumps = []
        for path in self.directory.glob("*.txt"):
            with contextlib.suppress(OSError, msgspec.DecodeError), path.open() as f:
                first = f.readline()
                if first.startswith(_HEADER):
                    dumps.append(msgspec.json.decode(first[len(_HEADER) :], type=DumpInfo))
        return sorted(dumps, key=lambda d: d.timestamp)

    def read(self, dump_id: str) -> tuple[DumpInfo, str] | None:
        if not dump_id.replace("-", "").isdigit():
            return None  # never a path: ids are digits and dashes
        try:
            header, _, text = (self.directory / f"{dump_id}.txt").read_text().partition("\n")
        except FileNotFoundError:
            return None
        if not header.startswith(_HEADER):
            return None
        return msgspec.json.decode(header[len(_HEADER) :], type=DumpInfo), text

    def read_trace(self, dump_id: str, rank: int) -> tuple[DumpInfo, bytes] | str:
        """A dump's trace of global rank ``rank``, or why there is none."""
        found = self.read(dump_id)
        if found is None:
            return f"no stack dump {dump_id!r}"
        info = found[0]
        trace = next((t for t in info.traces if t.rank == rank), None)
        if trace is None:
            return f"dump {dump_id} has no trace of rank {rank}"
        if not trace.size:
            return f"dump {dump_id} has no trace of rank {rank}: {trace.problem}"
        return info, self._trace_path(dump_id, rank).read_bytes()

    def forget_process(self, pid: int, start_time: int) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.live_path(pid, start_time).unlink()

    def prune(self) -> None:
        """Remove all but the newest ``keep`` dumps (reads every header: not before a kill)."""
        dumps = self.list()
        for old in dumps[: max(0, len(dumps) - self.keep)]:
            paths = [self._trace_path(old.id, t.rank) for t in old.traces if t.size]
            for path in [self.directory / f"{old.id}.txt", *paths]:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()


class FaulthandlerCaptures:
    """Every faulthandler capture in flight, watched together by one task.

    A capture signals the process and waits until its dump is complete:
    when the client's marker (:data:`DUMP_MARKER`) follows it, at once;
    otherwise (a client that writes none, a main thread stuck in C code that
    runs no Python handler) once the file has stopped growing for
    ``quiet`` seconds. One task checks every pending file each ``tick``,
    however many captures run at the same time: each costs an ``fstat`` per
    tick, and a capture that never completes costs the others nothing.
    :meth:`run` must be running (in the daemon's task group) for captures
    to complete.
    """

    def __init__(self, tick: float = _TICK, quiet: float = _QUIET) -> None:
        self.tick = tick
        self.quiet = quiet
        self._pending: set[_Capture] = set()
        self._work = anyio.Event()

    async def capture(
        self, handle: ProcessHandle, path: Path, signal: int, marker: bool
    ) -> str | None:
        """Signal the process to dump into ``path``; what it appended, or None.

        ``marker``: the client writes :data:`DUMP_MARKER` after the dump.
        Cancelled (the caller's time bound), it returns nothing: run it under
        ``move_on_after`` and fall back to another method.
        """
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        try:
            offset = os.fstat(fd).st_size
            try:
                handle.send_signal(signal)
            except ProcessLookupError:
                return None
            pending = _Capture(fd, offset, marker, time.monotonic())
            self._pending.add(pending)
            self._work.set()
            try:
                await pending.done.wait()
            finally:
                self._pending.discard(pending)
            return pending.text
        finally:
            os.close(fd)

    async def run(self) -> None:
        while True:
            if not self._pending:
                self._work = anyio.Event()
                await self._work.wait()
            await anyio.sleep(self.tick)
            now = time.monotonic()
            for pending in list(self._pending):
                if pending.check(now, self.quiet):
                    self._pending.discard(pending)
                    pending.done.set()


class _Capture:
    """One dump being written: where it starts, how far it was read, when it last grew."""

    __slots__ = ("done", "fd", "grew", "marker", "offset", "scanned", "size", "text")

    def __init__(self, fd: int, offset: int, marker: bool, now: float) -> None:
        self.fd = fd
        self.offset = offset  # where this dump starts
        self.marker = marker
        self.size = offset
        self.scanned = offset  # no marker starts before this
        self.grew = now
        self.text: str | None = None
        self.done = anyio.Event()

    def check(self, now: float, quiet: float) -> bool:
        """Whether the dump is complete (then ``text`` holds it)."""
        size = os.fstat(self.fd).st_size
        if size != self.size:
            self.size, self.grew = size, now
            if self.marker and self._find_marker():
                return True
        if size > self.offset and now - self.grew >= quiet:
            self._take(size)
            return True
        return False

    def _find_marker(self) -> bool:
        data = os.pread(self.fd, self.size - self.scanned, self.scanned)
        start = 0
        while (found := data.find(DUMP_MARKER, start)) >= 0:
            end = self.scanned + found
            if end > self.offset:
                self._take(end)
                return True
            # A marker with no dump before it answers an earlier signal (its
            # dump came before our offset): ours starts after it.
            start = found + len(DUMP_MARKER)
            self.offset = self.scanned + start
        self.scanned = max(self.offset, self.size - len(DUMP_MARKER) + 1)
        return False

    def _take(self, end: int) -> None:
        data = os.pread(self.fd, end - self.offset, self.offset)
        self.text = data.replace(DUMP_MARKER, b"").decode(errors="replace")


async def capture_pyspy(pid: int, give_up_after: float) -> str | None:
    """``py-spy dump`` of ``pid``; None if missing, refused or slower than ``give_up_after`` s.

    Run to its end by a worker thread, which kills it by then, so a
    caller that stops waiting leaves nothing behind. Not by the event
    loop's own spawn: that forks the daemon on the loop's thread and waits
    there for the exec, ~5 ms plus ~0.07 ms per MB the daemon holds (35 ms
    at 400 MB), while ``subprocess`` uses vfork, which costs the same at
    any size.
    """
    pyspy = await anyio.to_thread.run_sync(shutil.which, "py-spy")
    if pyspy is None:
        return None
    command = [pyspy, "dump", "--pid", str(pid)]

    def dump() -> str | None:
        try:
            done = subprocess.run(
                command, stdin=DEVNULL, stdout=PIPE, stderr=DEVNULL, timeout=give_up_after
            )
        except (OSError, subprocess.TimeoutExpired):
            return None
        return done.stdout.decode(errors="replace") if done.returncode == 0 else None

    return await anyio.to_thread.run_sync(dump, abandon_on_cancel=True)
