"""The two systemd protocols the daemon speaks, without libsystemd.

``sd_notify``: datagrams of ``KEY=value`` lines to ``$NOTIFY_SOCKET``
(``READY=1``, ``RELOADING=1``, ``STOPPING=1``, ``STATUS=…``, ``WATCHDOG=1``).
Outside systemd there is no such socket and every call is a no-op.

Socket activation: systemd passes already-open endpoints as descriptors
3, 4, … and says so in ``$LISTEN_FDS``/``$LISTEN_PID``/``$LISTEN_FDNAMES``.
The daemon adopts a listening Unix socket and a FIFO from them, so requests
sent while it restarts wait in the kernel instead of failing.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat

__all__ = ["Notifier", "listen_fds"]

_FIRST_FD = 3


class Notifier:
    """Sends ``sd_notify`` messages; silent when not run by systemd."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET", "")
        if address.startswith("@"):
            address = "\0" + address[1:]  # abstract namespace
        self._address = address
        self._socket: socket.socket | None = None
        if address:
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        usec = env.get("WATCHDOG_USEC", "")
        watchdog_pid = env.get("WATCHDOG_PID", "")
        for_us = not watchdog_pid or watchdog_pid == str(os.getpid())
        self.watchdog_interval = int(usec) / 1e6 / 2 if usec.isdigit() and for_us else None
        """Half of systemd's ``WatchdogSec=``, as sd_watchdog_enabled() advises; None: off."""

    @property
    def enabled(self) -> bool:
        return self._socket is not None

    def notify(self, *assignments: str) -> None:
        if self._socket is None:
            return
        # A full or vanished socket must never take the daemon down.
        with contextlib.suppress(OSError):
            self._socket.sendto("\n".join(assignments).encode(), self._address)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def listen_fds(environ: dict[str, str] | None = None) -> list[int]:
    """Descriptors passed by socket activation (and forget them, like ``sd_listen_fds(1)``)."""
    env = os.environ if environ is None else environ
    count = env.get("LISTEN_FDS", "")
    pid = env.get("LISTEN_PID", "")
    for key in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"):
        env.pop(key, None)
    if not count.isdigit() or pid != str(os.getpid()):
        return []
    fds = list(range(_FIRST_FD, _FIRST_FD + int(count)))
    for fd in fds:
        os.set_inheritable(fd, False)
    return fds


def is_listening_unix_socket(fd: int) -> bool:
    if not stat.S_ISSOCK(os.fstat(fd).st_mode):
        return False
    probe = socket.socket(fileno=os.dup(fd))
    try:
        return probe.family == socket.AF_UNIX and bool(
            probe.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        )
    finally:
        probe.close()


def is_fifo(fd: int) -> bool:
    return stat.S_ISFIFO(os.fstat(fd).st_mode)
