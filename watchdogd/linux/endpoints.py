"""Creating the socket and the FIFO safely, and owning them exclusively.

Each endpoint is guarded by an ``flock`` on ``PATH.lock``: a second daemon
pointed at the same path fails to take the lock and refuses to start,
naming the pid that holds it, instead of silently stealing the endpoint.
Holding the lock also proves that a socket file left at the path is stale.
The lock file is world-readable and holds an :class:`EndpointOwner` record
(the daemon's pid and start time, the endpoint's inode): how a FIFO client
tells the daemon's FIFO from torch's at the same path.

Nothing here follows a symlink planted at an endpoint path, and a path that
holds something else (a regular file where the FIFO should be) is refused,
never deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import grp
import os
import socket
import stat
from pathlib import Path

import msgspec

from watchdogd.linux.procs import read_stat
from watchdogd_client.protocol import EndpointOwner

__all__ = [
    "EndpointError",
    "Lock",
    "enlarge_pipe",
    "group_id",
    "open_fifo",
    "open_socket",
    "prepare_dir",
]

_PIPE_MAX_SIZE = Path("/proc/sys/fs/pipe-max-size")


class EndpointError(Exception):
    """An endpoint cannot be created or is owned by another daemon."""


_owner_decoder = msgspec.json.Decoder(EndpointOwner)


class Lock:
    """An exclusive ``flock`` on ``PATH.lock`` holding the owner's :class:`EndpointOwner`."""

    def __init__(self, endpoint: Path) -> None:
        self.path = endpoint.with_name(endpoint.name + ".lock")
        try:
            self._fd = os.open(
                self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644
            )
        except OSError as e:
            raise EndpointError(f"cannot open lock file {self.path}: {e.strerror}") from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = str(_owner_decoder.decode(os.pread(self._fd, 4096, 0)).pid)
            except (msgspec.DecodeError, msgspec.ValidationError):
                holder = "?"
            os.close(self._fd)
            raise EndpointError(
                f"another watchdogd (pid {holder}) already serves {endpoint}; "
                "stop it first or choose another path"
            ) from None
        self.publish(None)

    def publish(self, endpoint_fd: int | None) -> None:
        """Record this daemon, and the inode of ``endpoint_fd`` once it is open."""
        pid = os.getpid()
        owner = EndpointOwner(pid, read_stat(pid).start_time)
        if endpoint_fd is not None:
            info = os.fstat(endpoint_fd)
            owner = msgspec.structs.replace(owner, dev=info.st_dev, ino=info.st_ino)
        os.ftruncate(self._fd, 0)
        os.pwrite(self._fd, msgspec.json.encode(owner) + b"\n", 0)

    def release(self) -> None:
        if self._fd >= 0:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
            os.close(self._fd)
            self._fd = -1


def prepare_dir(path: Path) -> None:
    """Create ``path`` (0755) if missing; refuse a symlink or a world-writable dir."""
    try:
        path.mkdir(mode=0o755, parents=True, exist_ok=True)
        info = path.lstat()
    except OSError as e:
        raise EndpointError(f"cannot create runtime directory {path}: {e.strerror}") from None
    if not stat.S_ISDIR(info.st_mode):
        raise EndpointError(f"{path} is not a directory (a symlink is refused)")
    if info.st_uid not in (os.geteuid(), 0):
        raise EndpointError(
            f"{path} belongs to uid {info.st_uid}, who could replace the endpoints in it"
        )
    if info.st_mode & stat.S_IWOTH and not info.st_mode & stat.S_ISVTX:
        raise EndpointError(f"{path} is world-writable: anyone could replace the endpoints")


def group_id(name: str | None) -> int:
    """The gid of group ``name``, or the daemon's own gid when there is none."""
    if name is not None:
        with contextlib.suppress(KeyError):
            return grp.getgrnam(name).gr_gid
    return os.getegid()


def open_socket(path: Path, mode: int = 0o660, gid: int = -1) -> socket.socket:
    """Bind and listen on a Unix socket at ``path``; a stale socket file is replaced."""
    with contextlib.suppress(FileNotFoundError):
        info = path.lstat()
        if not stat.S_ISSOCK(info.st_mode):
            raise EndpointError(f"{path} exists and is not a socket; refusing to remove it")
        path.unlink()  # stale: our lock proves no daemon serves it
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(os.fspath(path))
        # We just created it in a directory only we may write: no race to fear.
        os.chown(path, -1, gid)
        os.chmod(path, mode)
        sock.listen(1024)
    except OSError as e:
        sock.close()
        # A path over the 107 bytes sockaddr_un holds fails without an errno.
        why = e.strerror or f"{e}: {len(os.fsencode(path))} bytes, 107 at most"
        raise EndpointError(f"cannot listen on {path}: {why}") from None
    sock.setblocking(False)
    return sock


def open_fifo(path: Path, mode: int = 0o620, gid: int = -1, pipe_size: int = 1 << 20) -> int:
    """Open (creating if needed) the FIFO at ``path`` read-write, non-blocking.

    Read-write so that the daemon is always a reader (writers never fail
    with ENXIO while it runs) and never sees EOF when the last writer closes.
    An existing FIFO is kept: requests written while no daemon ran are read.
    """
    try:
        info = path.lstat()
    except FileNotFoundError:
        try:
            os.mkfifo(path, mode)
        except OSError as e:
            raise EndpointError(f"cannot create FIFO {path}: {e.strerror}") from None
    else:
        if not stat.S_ISFIFO(info.st_mode):
            raise EndpointError(f"{path} exists and is not a FIFO; refusing to use it")
    try:
        fd = os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise EndpointError(f"cannot open FIFO {path}: {e.strerror}") from None
    info = os.fstat(fd)
    if not stat.S_ISFIFO(info.st_mode):
        os.close(fd)
        raise EndpointError(f"{path} exists and is not a FIFO; refusing to use it")
    if info.st_uid != os.geteuid():
        os.close(fd)
        raise EndpointError(
            f"{path} is a FIFO owned by uid {info.st_uid}, not by this daemon; "
            "remove it or choose another path"
        )
    # Through the descriptor: whatever the path holds now, we change what we opened.
    os.fchown(fd, -1, gid)
    os.fchmod(fd, mode)
    enlarge_pipe(fd, pipe_size)
    return fd


def enlarge_pipe(fd: int, size: int) -> None:
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)
    except PermissionError:
        # Unprivileged: the system cap is the most we may ask for.
        with contextlib.suppress(OSError, ValueError):
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, min(size, int(_PIPE_MAX_SIZE.read_text())))
