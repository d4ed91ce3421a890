"""Where a hung process was stuck: its Python stacks, captured before it is killed.

Two ways, tried in order, each bounded in time so that one slow capture
never delays another expiry:

``faulthandler``
    The client registers :func:`faulthandler.register` on a signal (default
    SIGUSR2), writing into a file the daemon opened for that pid and passed
    over the socket (``SCM_RIGHTS``). To capture, the daemon sends the signal
    and reads what was appended. Works for any user, needs no privilege.
``py-spy``
    ``py-spy dump --pid PID`` when installed and permitted (root, or
    ``CAP_SYS_PTRACE``). Works on processes that registered nothing, even
    ones stuck in C code.

Each dump is a text file under ``<state dir>/dumps/`` whose first line is a
header naming the pid, scope and method; the newest ``keep`` are kept. The
NCCL flight-recorder traces of the hung process's group, when its ranks
record them (:mod:`watchdogd.linux.flight_recorder`), are kept beside it
as they were written, ``<id>.rank<N>.trace``, and listed in its header.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Sequence
from pathlib import Path

import anyio
import msgspec

from watchdogd.linux.procs import ProcessHandle
from watchdogd_client.protocol import DumpInfo, TraceInfo

__all__ = ["DumpInfo", "StackStore", "TraceInfo", "capture_faulthandler", "capture_pyspy"]

_HEADER = "# watchdogd stack dump "
_POLL = 0.002
# faulthandler writes the whole dump from its signal handler at once; a file
# that stopped growing for this long holds all of it.
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
        self._prune()
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

    def _prune(self) -> None:
        dumps = self.list()
        for old in dumps[: max(0, len(dumps) - self.keep)]:
            paths = [self._trace_path(old.id, t.rank) for t in old.traces if t.size]
            for path in [self.directory / f"{old.id}.txt", *paths]:
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()


async def capture_faulthandler(handle: ProcessHandle, path: Path, signal: int) -> str | None:
    """Signal the process to dump into ``path``; what it appended, or None.

    The dump is complete once the file stops growing. Cancelled (the
    caller's time bound), it returns nothing: run it under ``move_on_after``
    and fall back to another method.
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
        size, stable_since = offset, time.monotonic()
        while size == offset or time.monotonic() - stable_since < _QUIET:
            await anyio.sleep(_POLL)
            current = os.fstat(fd).st_size
            if current != size:
                size, stable_since = current, time.monotonic()
        return os.pread(fd, size - offset, offset).decode(errors="replace")
    finally:
        os.close(fd)


async def capture_pyspy(pid: int) -> str | None:
    """``py-spy dump`` of ``pid``; None if py-spy is missing or refused. Bound it by cancelling."""
    pyspy = shutil.which("py-spy")
    if pyspy is None:
        return None
    result = await anyio.run_process([pyspy, "dump", "--pid", str(pid)], check=False)
    return result.stdout.decode(errors="replace") if result.returncode == 0 else None
