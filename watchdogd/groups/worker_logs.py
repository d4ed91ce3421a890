"""Worker output that passes through the daemon: prefixed console copies, filtered copies.

A stream that only goes to a file, or only to the console as it is, is
handed to the worker directly and costs the daemon nothing. The others are
pipes the daemon reads from the event loop: every chunk goes to the rank's
log file as is, complete lines go to the console with the rank's prefix and,
if they match a filter, to ``filtered_<stream>.log``. A line still
unterminated when the worker exits is written out too.

The loop only reads and hands bytes on. Threads do every write, because a
console or a disk may stall for as long as it likes, and the loop fires
every deadline on the node.

The console is best effort. One :class:`ConsoleWriter` per daemon stdout or
stderr, shared by every rank shown there, holds whole lines in a buffer
bounded at :data:`CONSOLE_BUFFER`; its thread writes them out with plain
blocking writes, so ranks never interleave within a line. Lines that do not
fit are dropped and counted; once the console has caught up with all it
held, ``[watchdogd: N bytes dropped]`` marks the gap (N counts console
bytes, prefixes included). A console that fails (EPIPE: its reader is gone)
is given up with one warning. Writing from the loop instead would need
``O_NONBLOCK``, a flag of the open file description: a dup shares it, and
so do the parent shell and the daemon's own ``sys.stdout``/``sys.stderr``,
which would then fail with EAGAIN; reopening ``/proc/self/fd/N`` gets a
description of its own but fails on a socket (journald's stdout). So the
console fd is left as it is. Each write is whole lines of at most
``PIPE_BUF`` bytes where the lines allow, so on a pipe the daemon's own log
records on stderr never land inside a worker's line either.

The log files lose nothing. Each copier's thread writes its log file and its
filtered copy, in order. When a stream's backlog reaches its bound
(:data:`FILE_BACKLOG`), the loop stops reading that worker's pipe, so a slow
disk slows the worker (its writes block on the full pipe), until the thread
has written what it holds. ``close()`` stops reading but keeps what the pipe
still holds; ``done`` is set once the thread has written everything up to
the end of the pipe (or ``close()``) and closed the files.
"""

from __future__ import annotations

import logging
import os
import select
import subprocess
import threading
from pathlib import Path
from typing import IO, Literal, NamedTuple

import anyio

from watchdogd.core.workerenv import StreamRoute
from watchdogd.linux import aio as _aio
from watchdogd.linux.logsink import write_all

__all__ = [
    "CONSOLE_BUFFER",
    "FILE_BACKLOG",
    "ConsoleWriter",
    "StreamCopier",
    "Target",
    "child_stream",
    "console",
    "open_log",
    "open_target",
    "start_copier",
]

log = logging.getLogger("watchdogd.worker_logs")

CONSOLE_BUFFER = 1 << 20
FILE_BACKLOG = 1 << 20
_READ = 1 << 16
# The longest line the console and the filters get whole: a line that never
# ends (a progress bar redrawn with \r) is passed on in pieces of this size,
# so what the loop holds and copies per read stays bounded.
MAX_LINE = 1 << 16
# What a pipe can still hold once its worker is gone (the kernel's default pipe-max-size).
_PIPE_MAX = 1 << 20


def open_log(path: str) -> IO[bytes]:
    """``path`` for appending, its directory made if need be (OSError: it cannot be)."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return open(path, "ab")


class Target(NamedTuple):
    """One worker stream, opened: what ``Popen`` gets, and its copier's files when piped."""

    popen: int | IO[bytes] | None
    file: IO[bytes] | None = None
    filtered: IO[bytes] | None = None

    def close(self) -> None:
        """Close what the daemon holds; once the copier has taken the files, they are its."""
        for file in (self.popen, self.file, self.filtered):
            if not isinstance(file, int | None):
                file.close()


def open_target(route: StreamRoute) -> Target:
    """Open what this stream is written to, before the worker starts (OSError: it cannot be)."""
    if not route.piped:
        if route.file is not None:
            return Target(open_log(route.file))
        return Target(subprocess.DEVNULL if route.console == "none" else None)
    file = open_log(route.file) if route.file is not None else None
    try:
        filtered = (
            open_log(route.filtered_file)
            if route.filters and route.filtered_file is not None
            else None
        )
    except OSError:
        if file is not None:
            file.close()
        raise
    return Target(subprocess.PIPE, file, filtered)


def child_stream(target: Target, console: int | None) -> tuple[int | None, int | None]:
    """(the daemon's read end, the worker's descriptor) of one stream of a worker started
    without ``Popen``; ``console``: the descriptor a console stream gets (None: inherit)."""
    if target.popen is subprocess.PIPE:
        return os.pipe()
    if target.popen is subprocess.DEVNULL:
        return None, os.open(os.devnull, os.O_WRONLY)
    if target.popen is None:
        return None, None if console is None else os.dup(console)
    assert not isinstance(target.popen, int)
    return None, os.dup(target.popen.fileno())


class ConsoleWriter:
    """A console: whole lines in a bounded buffer, written out by a thread of its own."""

    def __init__(self, fd: int, limit: int = CONSOLE_BUFFER) -> None:
        self.fd = fd
        self.limit = limit
        self._queue: list[bytes] = []
        self._pending = 0  # accepted and not yet written, a marker included
        self._dropped = 0  # since the last marker
        self._broken = False
        self._cond = threading.Condition()
        threading.Thread(target=self._run, name=f"watchdogd console {fd}", daemon=True).start()

    def write(self, lines: bytes) -> None:
        """Queue whole lines, or drop them when the buffer is full; never blocks."""
        with self._cond:
            if self._broken:
                return
            # Once dropping, keep dropping until the console has caught up: one marker per gap.
            if self._dropped or self._pending + len(lines) > self.limit:
                self._dropped += len(lines)
                return
            self._queue.append(lines)
            self._pending += len(lines)
            self._cond.notify_all()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` until all it holds is written (blocks: call it from a thread)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self._broken or not (self._pending or self._dropped), timeout
            )

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._dropped)
                if self._queue:
                    data = b"".join(self._queue)
                    self._queue.clear()
                else:
                    data = b"[watchdogd: %d bytes dropped]\n" % self._dropped
                    self._dropped = 0
                    self._pending += len(data)
            try:
                self._write(data)
            except OSError as e:
                with self._cond:
                    self._broken = True
                    self._cond.notify_all()
                log.warning("console fd %d: %s; worker output goes to log files only", self.fd, e)
                return
            with self._cond:
                self._pending -= len(data)
                self._cond.notify_all()

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        start = 0
        while start < len(data):
            end = data.rfind(b"\n", start, start + select.PIPE_BUF) + 1
            if end <= start:  # a line longer than PIPE_BUF: no single write keeps it whole
                end = data.find(b"\n", start) + 1 or len(data)
            write_all(self.fd, view[start:end])
            start = end


_consoles: dict[str, ConsoleWriter] = {}


def console(name: Literal["stdout", "stderr"]) -> ConsoleWriter:
    """The daemon's own stdout or stderr, one writer for every rank shown there."""
    if name not in _consoles:
        _consoles[name] = ConsoleWriter(1 if name == "stdout" else 2)
    return _consoles[name]


class StreamCopier:
    """One worker stream: read on the loop, written to its files by a thread, shown on a console."""

    def __init__(
        self,
        fd: int,
        route: StreamRoute,
        prefix: bytes,
        console: ConsoleWriter | None,
        *,
        file: IO[bytes] | None = None,
        filtered: IO[bytes] | None = None,
        backlog: int = FILE_BACKLOG,
    ) -> None:
        self.fd = fd
        self.route = route
        self.file = file
        self.filtered = filtered
        self.filters = [f.encode() for f in route.filters]
        self.console = console
        self.prefix = prefix if route.console == "prefixed" else b""
        self.partial = b""
        self.done = anyio.Event()
        self.paused = False  # not reading the pipe until the thread has caught up
        self._limit = backlog
        self._queue: list[tuple[bytes, bytes]] = []  # (chunk for the log, lines for the filtered)
        self._backlog = 0
        self._closed = False
        self._ended = False  # for the thread: nothing more will be queued
        self._write_failed = False
        self._cond = threading.Condition()
        self._call = _aio.loop_caller()
        self._writer: threading.Thread | None = None
        if self.file is not None or self.filtered is not None:
            self._writer = threading.Thread(
                target=self._write_files, name=f"watchdogd {route.name} log", daemon=True
            )
            self._writer.start()
        _aio.watch_readable(fd, self._on_readable)

    def _on_readable(self) -> None:
        try:
            data = os.read(self.fd, _READ)
        except BlockingIOError:
            return
        if not data:
            self.close()
            return
        lines = (self.partial + data).split(b"\n")
        self.partial = lines.pop()
        if len(self.partial) >= MAX_LINE:
            lines.append(self.partial)
            self.partial = b""
        if self._copy(data, lines) >= self._limit:
            with self._cond:
                self.paused = True
            _aio.unwatch(self.fd)

    def _copy(self, data: bytes, lines: list[bytes]) -> int:
        """Show ``lines``, queue ``data`` for the files; the files' backlog after it."""
        if lines and self.console is not None:
            self.console.write(b"".join(self.prefix + line + b"\n" for line in lines))
        if self._writer is None:
            return 0
        chunk = data if self.file is not None else b""
        matching = b""
        if self.filtered is not None:
            matching = b"".join(
                line + b"\n" for line in lines if any(f in line for f in self.filters)
            )
        with self._cond:
            self._queue.append((chunk, matching))
            self._backlog += len(chunk) + len(matching)
            self._cond.notify()
            return self._backlog

    def close(self) -> None:
        """Stop reading; what the pipe still holds and the last unterminated line are kept."""
        if self._closed:
            return
        self._closed = True
        _aio.unwatch(self.fd)
        tail = self._rest_of_pipe()
        os.close(self.fd)
        lines = (self.partial + tail).split(b"\n")
        if not lines[-1]:
            lines.pop()
        self._copy(tail, lines)
        if self._writer is None:
            self.done.set()
            return
        with self._cond:
            self._ended = True
            self._cond.notify()

    def _rest_of_pipe(self) -> bytes:
        # Reading may have been paused when the worker died: its last output is still there.
        chunks: list[bytes] = []
        size = 0
        while size < _PIPE_MAX:
            try:
                chunk = os.read(self.fd, _READ)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        return b"".join(chunks)

    def _resume(self) -> None:
        if not self._closed:
            _aio.watch_readable(self.fd, self._on_readable)

    def _write_files(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._ended)
                batch, self._queue = self._queue, []
            if not batch:
                break
            self._write(batch)
            with self._cond:
                self._backlog -= sum(len(chunk) + len(matching) for chunk, matching in batch)
                resume, self.paused = self.paused, False
            if resume:
                self._call(self._resume)
        for file in (self.file, self.filtered):
            if file is not None:
                try:
                    file.close()
                except OSError as e:
                    self._lost(file, e)
        self._call(self.done.set)

    def _write(self, batch: list[tuple[bytes, bytes]]) -> None:
        for file, data in (
            (self.file, b"".join(chunk for chunk, _ in batch)),
            (self.filtered, b"".join(lines for _, lines in batch)),
        ):
            if file is None or not data:
                continue
            try:
                file.write(data)
                file.flush()
            except OSError as e:
                self._lost(file, e)

    def _lost(self, file: IO[bytes], error: OSError) -> None:
        if not self._write_failed:
            log.warning("cannot write %s: %s; worker output is being lost", file.name, error)
        self._write_failed = True


def start_copier(fd: int, target: Target, route: StreamRoute, prefix: bytes) -> StreamCopier:
    """Copy the read end ``fd`` of a worker's pipe (now the copier's) into ``target``'s files."""
    os.set_blocking(fd, False)
    shown = console(route.name) if route.console != "none" else None
    return StreamCopier(fd, route, prefix, shown, file=target.file, filtered=target.filtered)
