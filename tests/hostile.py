"""What the hostile-input tests share: victims, a nobody dialer, a served daemon.

The tests run as root and aim timers at real processes, so every helper
that connects as an unprivileged user drops to ``nobody`` *before*
``connect()`` (``SO_PEERCRED`` records the credentials then).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest

import watchdogd_client as wd
from watchdogd.daemon import Daemon

NOBODY = 65534
OTHER_UID = 65533
SLEEP = ["sleep", "300"]

needs_root = pytest.mark.skipif(
    os.geteuid() != 0, reason="needs root: the tests drop to nobody and start other-uid processes"
)


# -- processes -------------------------------------------------------------------


def sleeper(
    uid: int | None = None, extra_groups: list[int] | None = None
) -> subprocess.Popen[bytes]:
    """A process to aim timers at: root's, or ``uid``'s (``sleep`` needs no Python)."""
    if uid is None:
        return subprocess.Popen(SLEEP)
    return subprocess.Popen(SLEEP, user=uid, group=uid, extra_groups=extra_groups or [])


@contextmanager
def sleepers(*uids: int | None) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [sleeper(uid) for uid in uids]
    try:
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


@asynccontextmanager
async def sleepers_off_loop(*uids: int | None) -> AsyncIterator[list[subprocess.Popen[bytes]]]:
    """:func:`sleepers` started and reaped in a worker thread, for tests running a daemon in
    their own event loop: forking a test process grown large blocks the loop for tens of ms."""
    started = sleepers(*uids)
    procs = await anyio.to_thread.run_sync(started.__enter__)
    try:
        yield procs
    finally:
        await anyio.to_thread.run_sync(started.__exit__, None, None, None)


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


# Dropping privileges happens after the imports: nobody cannot read this
# interpreter's installation, but needs nothing more from it once started.
DIALER = r"""
import os, socket, sys
channel = socket.socket(fileno=int(sys.argv[1]))
path = sys.argv[2]
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
while channel.recv(1):
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    socket.send_fds(channel, [b"c"], [conn.fileno()])
    conn.close()
"""


class NobodyDialer:
    """A process running as nobody that connects to the socket whenever asked.

    Each connection's ``SO_PEERCRED`` is nobody's (and this process's pid); we
    get the connected descriptor and speak on it.
    """

    def __init__(self, socket_path: Path) -> None:
        self._channel, theirs = socket.socketpair()
        self._channel.settimeout(10)
        self.proc = subprocess.Popen(
            [sys.executable, "-c", DIALER, str(theirs.fileno()), str(socket_path)],
            pass_fds=[theirs.fileno()],
        )
        theirs.close()
        self.pid = self.proc.pid

    def connect(self) -> socket.socket:
        self._channel.sendall(b"c")
        _, fds, _, _ = socket.recv_fds(self._channel, 16, 1)
        assert fds, "the nobody dialer died"
        return socket.socket(fileno=fds[0])

    def close(self) -> None:
        self._channel.close()
        self.proc.wait(10)


@contextmanager
def nobody_dialer(socket_path: Path) -> Iterator[NobodyDialer]:
    dialer = NobodyDialer(socket_path)
    try:
        yield dialer
    finally:
        dialer.close()


# -- the daemon as a subprocess ----------------------------------------------------


class Served:
    """A ``watchdogd serve`` subprocess and what it left behind."""

    def __init__(self, proc: subprocess.Popen[str], runtime_dir: Path) -> None:
        self.proc = proc
        self.pid = proc.pid
        self.socket = runtime_dir / "watchdogd.sock"
        self.fifo = runtime_dir / "timer.fifo"
        self.event_log = runtime_dir / "events.jsonl"
        self._event_offset = 0

    def events(self) -> list[dict[str, Any]]:
        with open(self.event_log) as f:
            return [json.loads(line) for line in f if line.strip()]

    def new_events(self) -> list[dict[str, Any]]:
        """Events appended since the last call."""
        with open(self.event_log, "rb") as f:
            f.seek(self._event_offset)
            data = f.read()
        complete = data[: data.rfind(b"\n") + 1]
        self._event_offset += len(complete)
        return [json.loads(line) for line in complete.splitlines() if line.strip()]

    def rss_kib(self) -> int:
        return rss_kib(self.pid)

    def alive(self) -> bool:
        return self.proc.poll() is None


@contextmanager
def serve(runtime_dir: Path, config: str, env: dict[str, str] | None = None) -> Iterator[Served]:
    """Run ``watchdogd serve`` with ``config`` (TOML); it must stop cleanly at the end."""
    runtime_dir.chmod(0o755)  # nobody must reach the socket
    config_path = runtime_dir / "watchdogd.toml"
    config_path.write_text(config)
    with open(runtime_dir / "daemon.err", "w") as err:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "watchdogd.cli.main",
                "serve",
                "--config",
                str(config_path),
                "--runtime-dir",
                str(runtime_dir),
                "--event-log",
                str(runtime_dir / "events.jsonl"),
                "--log-level",
                "warning",
            ],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, **(env or {})},
        )
    assert proc.stdout is not None
    try:
        banner = proc.stdout.readline()
        if "serving" not in banner:  # not an AssertionError: xfail(raises=...) must not hide it
            raise RuntimeError(
                "watchdogd serve failed:\n" + (runtime_dir / "daemon.err").read_text()
            )
        try:
            yield Served(proc, runtime_dir)
        except BaseException:
            if proc.poll() is not None:  # shown with the failure: why the daemon died
                print(f"watchdogd exited {proc.returncode}; its stderr:", file=sys.stderr)
                print((runtime_dir / "daemon.err").read_text()[-4000:], file=sys.stderr)
            raise
        assert proc.poll() is None, "the daemon died:\n" + (runtime_dir / "daemon.err").read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()


# -- in-process helpers ---------------------------------------------------------


def capture_events(daemon: Daemon) -> list[tuple[str, dict[str, Any]]]:
    """Record every event an in-process daemon emits (it still logs them as usual)."""
    seen: list[tuple[str, dict[str, Any]]] = []
    original = daemon.events.emit

    def emit(name: str, **metadata: Any) -> None:
        seen.append((name, metadata))
        original(name, **metadata)

    daemon.events.emit = emit  # type: ignore[method-assign]
    return seen


async def call(fn: Callable[..., Any], *args: Any) -> Any:
    """Run a blocking call off the event loop the in-process daemon runs on."""
    return await anyio.to_thread.run_sync(partial(fn, *args))


def arm_error(path: Path, pid: int, scope: str, expiration: float) -> wd.RequestError | None:
    with wd.SocketTimerClient(path) as c:
        try:
            c.acquire_for(pid, scope, expiration, 9)
            c.sync()
        except wd.RequestError as e:
            return e
    return None


def assert_untouched(target: Path, content: str | None) -> None:
    """``target`` is still the 0600 file holding ``content``, or still absent (None)."""
    if content is None:
        assert not os.path.lexists(target)  # not created through the link
        return
    info = target.lstat()
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
    assert target.read_bytes() == content.encode()
