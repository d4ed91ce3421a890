"""The FIFO client: torch's wire format, without torch's failure modes.

torch's ``FileTimerClient`` opens the FIFO for every request and raises
``BlockingIOError`` when the pipe is momentarily full — after which the
request may or may not have been delivered. This one waits (bounded) for
room instead. Each request is one ``write`` of at most ``PIPE_BUF`` bytes,
which the kernel delivers whole or not at all, so a request reported as
failed was not delivered.

Rules for the descriptor:

- torch's own ``FileTimerServer`` reads with a blocking ``readline()`` and
  checks its deadlines only between lines, so it needs every writer to close
  after each request: a writer that stays open stalls its expiry for every
  rank on the node. Against any reader but watchdogd, each request is
  open, write, close — what torch's client does.
- The descriptor stays open (the fast path: one ``write`` per request) only
  when the FIFO is provably watchdogd's: ``PATH.lock`` beside it, owned by
  root or by the FIFO's owner, names the inode that was opened and a daemon
  that still runs (pid and start time). The inode cannot be reused while
  that daemon holds the FIFO open, and torch recreates its FIFO (a new
  inode) at start, so neither a stale lock file nor an inherited
  environment can make this client hold torch's FIFO open.
"""

from __future__ import annotations

import errno
import os
import select
import signal as _signal
import stat
import time
import weakref

import msgspec

from . import _faults
from . import protocol as p
from ._errors import DaemonUnavailableError, FifoFullError
from ._proc import stat_fields
from ._timer_client import TimerClient

__all__ = ["FileTimerClient"]

# torch's FileTimerClient tries to open the FIFO this many times, this far
# apart, before it gives up: a server that is starting gets that long.
_OPEN_ATTEMPTS = 10
_OPEN_RETRY_DELAY = 0.1

_encoder = msgspec.json.Encoder()
_owner_decoder = msgspec.json.Decoder(p.EndpointOwner)
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
        # (st_dev, st_ino) of the last FIFO found not to be watchdogd's, so
        # that open-write-close against torch's server checks it only once.
        self._foreign: tuple[int, int] | None = None
        self._pid = os.getpid()
        _live_clients.add(self)
        _faults.install()  # only where the daemon offers fault injection

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        self._write(p.FileTimerRequest(1, self._pid, scope_id, expiration_time, self.signal))

    def release(self, scope_id: str) -> None:
        if _faults.active is not None:
            _faults.hang_if_injected()
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
        """Open the FIFO; the descriptor is kept only when watchdogd serves it."""
        for attempt in range(_OPEN_ATTEMPTS):
            try:
                # O_NONBLOCK: fail (ENXIO) rather than hang when no server reads.
                fd = os.open(self.file_path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
                break
            except OSError as e:
                if attempt == _OPEN_ATTEMPTS - 1:
                    raise DaemonUnavailableError(
                        self.file_path, f"{e.strerror or e} (tried for ~1 s)"
                    ) from None
                time.sleep(_OPEN_RETRY_DELAY)
        info = os.fstat(fd)
        inode = (info.st_dev, info.st_ino)
        if inode != self._foreign and _served_by_watchdogd(self.file_path, info):
            self._fd = fd
        else:
            self._foreign = inode
        return fd

    def _write(self, request: p.FileTimerRequest) -> None:
        line = _encoder.encode(request) + b"\n"
        if len(line) > select.PIPE_BUF:
            raise ValueError(
                f"timer request of {len(line)} bytes exceeds PIPE_BUF ({select.PIPE_BUF}), "
                f"the largest write a FIFO delivers whole: shorten scope_id {request.scope_id!r}"
            )
        fd = self._fd
        if fd >= 0:
            try:
                os.write(fd, line)
                return
            except BlockingIOError:
                self._write_when_room(fd, line)
                return
            except BrokenPipeError:
                # The reader went away (daemon restarted): open again.
                self.close()
        fd = self._open()
        try:
            # A fresh descriptor: polling first costs one syscall beside open and close.
            self._write_when_room(fd, line)
        finally:
            if fd != self._fd:
                os.close(fd)  # not watchdogd's FIFO: close, as torch's reader needs

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


def _served_by_watchdogd(fifo_path: str, fifo: os.stat_result) -> bool:
    """Whether the FIFO opened as ``fifo`` is the one a running watchdogd holds open."""
    try:
        fd = os.open(f"{fifo_path}.lock", os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        lock = os.fstat(fd)
        if not stat.S_ISREG(lock.st_mode) or lock.st_uid not in (0, fifo.st_uid):
            return False
        owner = _owner_decoder.decode(os.read(fd, 4096))
    except (OSError, msgspec.DecodeError, msgspec.ValidationError):
        return False
    finally:
        os.close(fd)
    if (owner.dev, owner.ino) != (fifo.st_dev, fifo.st_ino):
        return False
    try:
        return int(stat_fields(owner.pid)[19]) == owner.start_time
    except (ProcessLookupError, IndexError, ValueError):
        return False


def _refresh_pid_after_fork() -> None:
    pid = os.getpid()
    for client in list(_live_clients):
        client._pid = pid


os.register_at_fork(after_in_child=_refresh_pid_after_fork)
