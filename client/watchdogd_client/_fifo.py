"""The FIFO client: torch's wire format, without torch's failure modes.

torch's ``FileTimerClient`` opens the FIFO for every request and raises
``BlockingIOError`` when the pipe is momentarily full — after which the
request may or may not have been delivered. This one keeps one descriptor
open, and when the pipe is full it waits (bounded) for room. Each request is
one ``write`` of at most ``PIPE_BUF`` bytes, which the kernel delivers whole
or not at all, so a request reported as failed was not delivered.
"""

from __future__ import annotations

import errno
import os
import select
import signal as _signal
import time
import weakref

import msgspec

from . import protocol as p
from ._errors import DaemonUnavailableError, FifoFullError
from ._timer import TimerClient

__all__ = ["FileTimerClient"]

_encoder = msgspec.json.Encoder()
_live_clients: weakref.WeakSet[FileTimerClient] = weakref.WeakSet()


class FileTimerClient(TimerClient):
    """Write torch-format timer requests to the FIFO at ``file_path``.

    ``signal`` is sent to this process when one of its timers expires
    (``<= 0``: record the expiry only). ``full_timeout`` bounds the wait for
    room in a full pipe before :class:`FifoFullError` is raised.
    """

    def __init__(
        self,
        file_path: str | os.PathLike[str],
        signal: int = _signal.SIGKILL,
        *,
        full_timeout: float = 5.0,
    ) -> None:
        self.file_path = os.fspath(file_path)
        self.signal = int(signal)
        self.full_timeout = full_timeout
        self._fd = -1
        self._pid = os.getpid()
        _live_clients.add(self)

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        self._write(p.FileTimerRequest(1, self._pid, scope_id, expiration_time, self.signal))

    def release(self, scope_id: str) -> None:
        self._write(p.FileTimerRequest(1, self._pid, scope_id, -1, 0))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> FileTimerClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _open(self) -> int:
        try:
            # O_NONBLOCK: fail now (ENXIO) rather than hang when no daemon reads.
            self._fd = os.open(self.file_path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError as e:
            raise DaemonUnavailableError(self.file_path, e.strerror or str(e)) from None
        return self._fd

    def _write(self, request: p.FileTimerRequest) -> None:
        line = _encoder.encode(request) + b"\n"
        if len(line) > select.PIPE_BUF:
            raise ValueError(
                f"timer request of {len(line)} bytes exceeds PIPE_BUF ({select.PIPE_BUF}), "
                f"the largest write a FIFO delivers whole: shorten scope_id {request.scope_id!r}"
            )
        fd = self._fd if self._fd >= 0 else self._open()
        try:
            os.write(fd, line)
        except BlockingIOError:
            self._write_when_room(fd, line)
        except BrokenPipeError:
            # The reader went away (daemon restarted): reopen once.
            self.close()
            os.write(self._open(), line)

    def _write_when_room(self, fd: int, line: bytes) -> None:
        poller = select.poll()
        poller.register(fd, select.POLLOUT)
        deadline = time.monotonic() + self.full_timeout
        while (left := deadline - time.monotonic()) > 0:
            poller.poll(left * 1000)
            try:
                os.write(fd, line)
                return
            except BlockingIOError:
                continue
            except OSError as e:
                if e.errno != errno.EINTR:
                    raise
        raise FifoFullError(
            errno.EAGAIN,
            f"FIFO {self.file_path} stayed full for {self.full_timeout}s; request not delivered",
        )


def _refresh_pid_after_fork() -> None:
    pid = os.getpid()
    for client in list(_live_clients):
        client._pid = pid


os.register_at_fork(after_in_child=_refresh_pid_after_fork)
