"""Making a rank's flight recorder dump, and reading the dump: blocking calls, for a thread.

An NCCL rank is poked through its pipe; a rank whose pipe nobody reads
(gloo: torch listens there only for NCCL) is asked through its worker
servers instead (:mod:`watchdogd.linux.worker_server`).

The paths come from a worker's environment, so neither is trusted: a
symlink planted at either is never followed (``O_NOFOLLOW``, the pipe
opened by ``O_PATH`` and checked before anything is written to it), a pipe
or trace that is not the worker's own (another owner, not a FIFO, not a
regular file) is skipped, and a trace larger than :data:`MAX_TRACE` is
not read. torch opens the trace path following links, as the worker's
uid: where a link or someone else's file sits there, the rank is not
asked to dump at all. Opening the pipe ``O_WRONLY|O_NONBLOCK`` fails at once when no
rank reads it (``ENXIO``), so a rank without a recorder costs nothing.
"""

from __future__ import annotations

import errno
import os
import stat
import time

import msgspec

from watchdogd.core.flight_recorder import Recorder
from watchdogd.linux.worker_server import fetch_trace

__all__ = ["MAX_TRACE", "Collected", "collect"]

# Well under the client's largest reply (64 MiB), which must carry it whole.
MAX_TRACE = 32 * 1024 * 1024
_POLL = 0.02
# Any byte will do: torch's monitor reads up to 128 and dumps if it got one.
_POKE = b"1"


class Collected(msgspec.Struct, kw_only=True):
    """What one rank gave: its trace (empty if none), and what went wrong, if anything."""

    data: bytes = b""
    problem: str = ""


def _identity(path: str) -> os.stat_result | None:
    """The trace already there (not followed), so that a new one can be told apart."""
    try:
        return os.stat(path, follow_symlinks=False)
    except OSError:
        return None


def _same(a: os.stat_result | None, b: os.stat_result | None) -> bool:
    if a is None or b is None:
        return a is b
    return (a.st_ino, a.st_mtime_ns, a.st_size) == (b.st_ino, b.st_mtime_ns, b.st_size)


def _unsafe_target(recorder: Recorder, existing: os.stat_result | None) -> str:
    """Why the rank must not be made to dump: torch opens the trace path following links,
    as the worker's uid, so a link or another's file there would be written over."""
    if existing is None:
        return ""
    if stat.S_ISLNK(existing.st_mode):
        return f"{recorder.trace} is a symlink: not followed, and the rank not asked to write"
    if not stat.S_ISREG(existing.st_mode):
        return f"{recorder.trace} is not a regular file: the rank not asked to write"
    if existing.st_uid != recorder.uid:
        return f"{recorder.trace} belongs to uid {existing.st_uid}: the rank not asked to write"
    return ""


def _poke(recorder: Recorder) -> str:
    """Write to the rank's pipe; "" when done, else why not."""
    try:
        fd = os.open(recorder.pipe, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return f"no pipe {recorder.pipe}: the rank has no flight recorder listening"
    except OSError as e:
        return f"pipe {recorder.pipe}: {e.strerror}"
    try:
        st = os.fstat(fd)
        if stat.S_ISLNK(st.st_mode):
            return f"{recorder.pipe} is a symlink: not followed"
        if not stat.S_ISFIFO(st.st_mode):
            return f"{recorder.pipe} is not a FIFO"
        if st.st_uid != recorder.uid:
            return f"{recorder.pipe} belongs to uid {st.st_uid}, not the worker's"
        try:
            # Reopened through the descriptor: the very FIFO just checked, not the path again.
            writer = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.ENXIO:
                return f"nobody reads {recorder.pipe}: the rank's recorder is not running"
            return f"pipe {recorder.pipe}: {e.strerror}"
        try:
            os.write(writer, _POKE)
        except BlockingIOError:
            pass  # full of earlier pokes: it will dump once it reads them
        finally:
            os.close(writer)
    finally:
        os.close(fd)
    return ""


def _read(recorder: Recorder) -> tuple[bytes | None, str]:
    """The trace file's bytes (None: not there), or why it cannot be read."""
    path = recorder.trace
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None, ""
    except OSError as e:
        if e.errno == errno.ELOOP:
            return None, f"{path} is a symlink: not followed"
        return None, f"{path}: {e.strerror}"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None, f"{path} is not a regular file"
        if st.st_uid != recorder.uid:
            return None, f"{path} belongs to uid {st.st_uid}, not the worker's"
        if st.st_size > MAX_TRACE:
            return None, f"{path} holds {st.st_size} bytes, over {MAX_TRACE}: not read"
        return os.pread(fd, st.st_size, 0), ""
    finally:
        os.close(fd)


def _complete(data: bytes) -> bool:
    # A pickle (torch's format) ends with its STOP opcode; anything else is taken as is.
    return data[:1] != b"\x80" or data.endswith(b".")


def collect(recorder: Recorder, deadline: float) -> Collected:
    """The rank's trace by the first way that gives one: its NCCL pipe, then each of its
    worker servers; else every way's reason, until ``deadline`` (monotonic)."""
    problems = []
    if recorder.pipe:
        collected = _collect_from_pipe(recorder, deadline)
        if collected.data:
            return collected
        problems.append(collected.problem)
    for server in recorder.servers:
        data, problem = fetch_trace(server, recorder.pid, recorder.uid, MAX_TRACE, deadline)
        if not problem:
            return Collected(data=data)
        problems.append(problem)
    return Collected(problem="; ".join(problems))


def _collect_from_pipe(recorder: Recorder, deadline: float) -> Collected:
    """Poke the rank's pipe and wait, until ``deadline``, for a new, whole trace.

    torch writes the file in place, so a trace is taken once it is new
    (another inode, time or size than before the poke), ends as a pickle
    ends, and kept its size for one poll. At the deadline, a trace still
    being written is kept as it is, and said to be incomplete.
    """
    before = _identity(recorder.trace)
    problem = _unsafe_target(recorder, before) or _poke(recorder)
    if problem:
        return Collected(problem=problem)
    last: bytes | None = None
    while True:
        now = time.monotonic()
        if now >= deadline:
            break
        time.sleep(min(_POLL, deadline - now))
        if _same(_identity(recorder.trace), before):
            continue
        data, problem = _read(recorder)
        if problem:
            return Collected(problem=problem)
        if data and data == last and _complete(data):
            return Collected(data=data)
        last = data
    if last:
        return Collected(data=last, problem="still being written at the deadline: incomplete")
    return Collected(problem=f"no trace in {recorder.trace} before the deadline")
