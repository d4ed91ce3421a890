"""The daemon's own log output, written by a thread: a stuck console or disk never holds the loop.

A :class:`LogSink` is the stdlib's ``QueueHandler`` → ``QueueListener``
pair with a bounded queue. :attr:`LogSink.handler` is what loggers get: it
formats the record in the caller (as ``QueueHandler`` does) and queues it
without waiting. When the queue is full it drops records, counting them,
until the listener's thread has written all it held; then the thread
reports the gap through the real handlers, where it was (``notice(count)``,
by default ``N log records dropped: …``), and queueing resumes — the way
:class:`~watchdogd.groups.worker_logs.ConsoleWriter` marks a gap in worker
output. Closing writes out what is queued, within a time bound.

:func:`stderr_logging` is ``logging.basicConfig(level=…, format=…)`` through
a sink, for ``watchdogd serve`` and ``watchdogd run``. Its target is a
:class:`DescriptorHandler` on fd 2 rather than a ``StreamHandler`` on
``sys.stderr``: at exit ``logging.shutdown()`` takes every handler's lock
and flushes its stream, and with a thread stuck writing into a pipe nobody
reads (journald stalled, a frozen terminal) a stream's buffer lock or the
handler's own would hang the exit. Each record goes out in one ``write(2)``
where the kernel allows, so on a pipe it never lands inside a worker's
line (:mod:`watchdogd.groups.worker_logs` writes whole lines too).
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import queue
import select
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = [
    "CAPACITY",
    "CLOSE_TIMEOUT",
    "DescriptorHandler",
    "LogSink",
    "stderr_logging",
    "write_all",
]

# Records waiting for a slow output, at most (a few MiB of memory).
CAPACITY = 10_000
# How long closing waits for the output to take what is queued.
CLOSE_TIMEOUT = 2.0


def write_all(fd: int, data: bytes | memoryview) -> None:
    """Write all of ``data`` to ``fd``, waiting for room as long as it takes (for threads)."""
    view = memoryview(data)
    while view:
        try:
            view = view[os.write(fd, view) :]
        except BlockingIOError:
            # Someone else made a shared descriptor non-blocking: wait for room.
            select.select((), (fd,), ())


def _dropped_notice(count: int) -> str:
    return f"{count} log records dropped: the log output did not keep up"


class _Front(logging.handlers.QueueHandler):
    def __init__(self, capacity: int) -> None:
        self.records: queue.Queue[logging.LogRecord | None] = queue.Queue(capacity)
        super().__init__(self.records)
        self.dropped = 0

    def enqueue(self, record: logging.LogRecord) -> None:
        # Under the handler's lock (Handler.handle holds it around emit). Once
        # dropping, keep dropping until the thread has caught up, so that one
        # notice marks the gap exactly where it is.
        if self.dropped:
            self.dropped += 1
            return
        try:
            self.records.put_nowait(record)
        except queue.Full:
            self.dropped = 1

    def take_dropped(self) -> int:
        self.acquire()
        try:
            dropped, self.dropped = self.dropped, 0
        finally:
            self.release()
        return dropped


class _Listener(logging.handlers.QueueListener):
    def __init__(
        self, front: _Front, targets: tuple[logging.Handler, ...], notice: Callable[[int], str]
    ) -> None:
        super().__init__(front.records, *targets, respect_handler_level=True)
        self.front = front
        self.notice = notice

    def handle(self, record: logging.LogRecord) -> None:
        super().handle(record)
        if self.front.records.empty():
            self.report_dropped()

    def report_dropped(self) -> None:
        """Once all that was queued before a gap is written: how many records it lost."""
        dropped = self.front.take_dropped()
        if dropped:
            notice = logging.makeLogRecord(
                {
                    "name": "watchdogd",
                    "levelno": logging.WARNING,
                    "levelname": "WARNING",
                    "msg": self.notice(dropped),
                }
            )
            super().handle(notice)


class LogSink:
    """Records for ``targets``: queued by :attr:`handler` (never waits), written by a thread."""

    def __init__(
        self,
        *targets: logging.Handler,
        capacity: int = CAPACITY,
        notice: Callable[[int], str] = _dropped_notice,
    ) -> None:
        self._front = _Front(capacity)
        self.handler: logging.Handler = self._front
        self._listener = _Listener(self._front, targets, notice)

    def start(self) -> None:
        self._listener.start()

    def close(self, timeout: float = CLOSE_TIMEOUT) -> bool:
        """Write out what is queued, waiting at most ``timeout``; False if that was not enough.

        Blocks: call it from a thread, or where nothing else waits. A thread
        still stuck writing is left to finish on its own (it is a daemon
        thread, and does not keep the process from exiting).
        """
        thread = self._listener._thread
        if thread is None:
            return True
        deadline = time.monotonic() + timeout
        try:
            # None is the stdlib listener's sentinel; its enqueue_sentinel() uses
            # put_nowait, which fails on a full queue: wait for room, boundedly.
            self._front.records.put(None, timeout=timeout)
        except queue.Full:
            return False
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            return False
        self._listener._thread = None
        self._listener.report_dropped()  # a gap just before the end
        return True


class DescriptorHandler(logging.Handler):
    """Formatted records to a file descriptor: no stream, no lock held while writing.

    For a :class:`LogSink`'s thread only, the one writer, which is why
    :meth:`handle` takes no lock.
    """

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd

    def handle(self, record: logging.LogRecord) -> bool:
        # Handler.handle holds the handler's lock around emit, and logging.shutdown()
        # takes it at exit: a write stuck in a full pipe would hang the exit.
        if not self.filter(record):
            return False
        self.emit(record)
        return True

    def emit(self, record: logging.LogRecord) -> None:
        try:
            write_all(self.fd, (self.format(record) + "\n").encode(errors="backslashreplace"))
        except Exception:
            self.handleError(record)


@contextmanager
def stderr_logging(level: int | str, fmt: str) -> Iterator[None]:
    """``logging.basicConfig(level=level, format=fmt)``, through a sink, until the block ends."""
    target = DescriptorHandler(sys.stderr.fileno())
    target.setFormatter(logging.Formatter(fmt))
    sink = LogSink(target)
    root = logging.getLogger()
    root.setLevel(level)
    root.addHandler(sink.handler)
    sink.start()
    try:
        yield
    finally:
        # Later records find no handler and go to logging.lastResort, directly.
        root.removeHandler(sink.handler)
        sink.close()
