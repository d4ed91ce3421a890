"""The thin client on its own: scopes, configuration, the FIFO's full-pipe wait, imports."""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import msgspec
import pytest

import watchdogd_client as wd
from watchdogd_client import _timer
from watchdogd_client import protocol as p
from watchdogd_client.framing import FrameSplitter

from ..conftest import wait_until


class Recorder(wd.TimerClient):
    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        self.calls.append(("acquire", scope_id))

    def release(self, scope_id: str) -> None:
        self.calls.append(("release", scope_id))


def test_default_scope_is_the_callers_line() -> None:
    recorder = Recorder()
    with wd.expires(after=5, client=recorder):
        line = sys._getframe().f_lineno - 1
    assert recorder.calls == [
        ("acquire", f"{__file__}:{line}"),
        ("release", f"{__file__}:{line}"),
    ]


def test_nested_scopeless_timers_do_not_collide() -> None:
    recorder = Recorder()
    with wd.expires(after=5, client=recorder), wd.expires(after=1, client=recorder):
        pass
    with wd.expires(after=5, client=recorder):  # noqa: SIM117 - two lines, two scopes
        with wd.expires(after=1, client=recorder):
            pass
    acquired = [scope for op, scope in recorder.calls if op == "acquire"]
    # Same line → the same scope is fine for siblings; nested on two lines must differ.
    assert acquired[2] != acquired[3]
    assert all(scope.startswith(__file__) for scope in acquired)


def test_torch_default_scope_collides_where_ours_does_not() -> None:
    timer_api = pytest.importorskip("torch.distributed.elastic.timer.api")
    recorder = Recorder()
    with timer_api.expires(after=5, client=recorder):  # noqa: SIM117
        with timer_api.expires(after=1, client=recorder):
            pass
    outer, inner = (scope for op, scope in recorder.calls if op == "acquire")
    assert outer == inner  # both resolve inside contextlib: the bug we fix
    assert "contextlib" in outer


def test_decorator_arms_around_each_call() -> None:
    recorder = Recorder()

    @wd.expires(after=5, scope="step", client=recorder)
    def step(x: int) -> int:
        return x * 2

    assert step(2) == 4
    assert step(3) == 6
    assert recorder.calls == [("acquire", "step"), ("release", "step")] * 2


def test_release_runs_when_the_block_raises() -> None:
    recorder = Recorder()
    with pytest.raises(ZeroDivisionError), wd.expires(after=5, scope="s", client=recorder):
        _ = 1 / 0
    assert recorder.calls == [("acquire", "s"), ("release", "s")]


def run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in ("WATCHDOGD_SOCKET",)}
    clean.pop("TORCHELASTIC_TIMER_FILE", None)
    return subprocess.run(
        [sys.executable, "-c", code], env={**clean, **env}, capture_output=True, text=True
    )


def test_expires_configures_itself_from_the_environment(tmp_path: Path) -> None:
    code = "import watchdogd_client as wd; c = wd.get_client(); print(type(c).__name__, c.path if hasattr(c, 'path') else c.file_path)"  # noqa: E501
    out = run_python(code, {"WATCHDOGD_SOCKET": "/x.sock", "TORCHELASTIC_TIMER_FILE": "/y"})
    assert out.stdout.split() == ["SocketTimerClient", "/x.sock"]
    out = run_python(code, {"TORCHELASTIC_TIMER_FILE": "/y.fifo"})
    assert out.stdout.split() == ["FileTimerClient", "/y.fifo"]
    out = run_python("import watchdogd_client as wd\nwith wd.expires(after=1): pass", {})
    assert out.returncode == 1
    assert "NotConfiguredError" in out.stderr
    assert "WATCHDOGD_SOCKET" in out.stderr and "configure(" in out.stderr
    assert "no daemon listens at " in out.stderr  # the default socket, named


def test_with_nothing_configured_the_client_finds_the_default_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    default = tmp_path / "watchdogd.sock"
    for where in ("_paths", "_timer"):
        monkeypatch.setattr(f"watchdogd_client.{where}.default_socket_path", lambda: default)
    monkeypatch.setattr("watchdogd_client._paths.NODE_RUNTIME_DIR", tmp_path / "no-node")
    for name in ("WATCHDOGD_SOCKET", "TORCHELASTIC_TIMER_FILE"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(wd.NotConfiguredError, match=str(default)):
        _timer._client_from_environment()
    with socket.socket(socket.AF_UNIX) as listening:
        listening.bind(str(default))  # where `watchdogd serve` listens for this user
        client = _timer._client_from_environment()
        assert isinstance(client, wd.SocketTimerClient)
        assert client.path == str(default)


def test_client_imports_only_stdlib_and_msgspec() -> None:
    out = run_python(
        "import sys, watchdogd_client\n"
        "heavy = {'anyio', 'uvloop', 'torch', 'tabulate', 'watchdogd'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))",
        {},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@contextmanager
def fifo_with_reader(tmp_path: Path, size: int = 4096) -> Iterator[tuple[Path, int]]:
    """A FIFO with a reader (so writers may open it) whose buffer holds ``size`` bytes."""
    path = tmp_path / "timer.fifo"
    os.mkfifo(path)
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        fcntl.fcntl(reader, fcntl.F_SETPIPE_SZ, size)
        yield path, reader
    finally:
        os.close(reader)


def fill(path: Path) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    try:
        while True:
            os.write(fd, b"x" * 512)
    except BlockingIOError:
        pass
    finally:
        os.close(fd)


def test_fifo_client_waits_for_room_then_delivers(tmp_path: Path) -> None:
    with fifo_with_reader(tmp_path) as (path, reader):
        fill(path)
        client = wd.FileTimerClient(path, full_timeout=10)

        def drain_later() -> None:
            time.sleep(0.3)
            os.read(reader, 1 << 16)

        threading.Thread(target=drain_later).start()
        client.acquire("after-the-wait", 123.0)
        client.close()
        time.sleep(0.05)
        line = os.read(reader, 1 << 16)
        request = msgspec.json.decode(line.rstrip(b"\n"), type=p.FileTimerRequest)
        assert (request.scope_id, request.expiration_time, request.pid) == (
            "after-the-wait",
            123.0,
            os.getpid(),
        )


def test_fifo_client_reports_a_full_pipe_and_delivers_nothing(tmp_path: Path) -> None:
    with fifo_with_reader(tmp_path) as (path, reader):
        fill(path)
        client = wd.FileTimerClient(path, full_timeout=0.2)
        with pytest.raises(wd.FifoFullError) as caught:
            client.acquire("lost", 1.0)
        assert isinstance(caught.value, BlockingIOError)
        client.close()
        drained = b""
        while chunk := os.read(reader, 1 << 16):  # b"" once no writer is left
            drained += chunk
        assert b"lost" not in drained


def test_fifo_client_refuses_lines_longer_than_pipe_buf(tmp_path: Path) -> None:
    with (
        fifo_with_reader(tmp_path, size=1 << 16) as (path, _),
        pytest.raises(ValueError, match="PIPE_BUF"),
    ):
        wd.FileTimerClient(path).acquire("s" * 5000, 1.0)


def test_fifo_client_matches_torchs_wire_format(tmp_path: Path) -> None:
    file_based = pytest.importorskip("torch.distributed.elastic.timer.file_based_local_timer")
    with fifo_with_reader(tmp_path, size=1 << 16) as (path, reader):
        with wd.FileTimerClient(path, signal=15) as ours:
            ours.acquire("scope", 1234.5)
            ours.release("scope")
        theirs = file_based.FileTimerClient(str(path), signal=15)
        theirs.acquire("scope", 1234.5)
        theirs.release("scope")
        lines = os.read(reader, 1 << 16).splitlines()
        decoded = [msgspec.json.decode(line) for line in lines]
        assert decoded[:2] == decoded[2:]
        assert decoded[0] == {
            "version": 1,
            "pid": os.getpid(),
            "scope_id": "scope",
            "expiration_time": 1234.5,
            "signal": 15,
        }


def _open_memfds() -> int:
    return sum(
        os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:")
        for fd in os.listdir("/proc/self/fd")
        if os.path.exists(f"/proc/self/fd/{fd}")
    )


@contextmanager
def recording_daemon(path: str, **welcome: object) -> Iterator[list[p.Request]]:
    """A daemon at ``path`` that records every request of one connection and answers only
    its hello, with ``welcome``'s fields added (and, with ``slot_page``, a memfd beside the
    faulthandler file, as the older daemon it stands for sent)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    received: list[p.Request] = []

    def serve() -> None:
        conn, _ = server.accept()
        with conn:
            splitter = FrameSplitter(p.MAX_FRAME_SIZE)
            decoder = msgspec.msgpack.Decoder(p.Request)
            while True:
                data = conn.recv(1 << 16)
                if not data:
                    return
                for payload in splitter.feed(data):
                    request = decoder.decode(payload)
                    received.append(request)
                    if isinstance(request, p.Hello):
                        reply = {
                            "op": "welcome",
                            "seq": 0,
                            "version": 1,
                            "daemon_pid": 1,
                            "peer_pid": os.getpid(),
                            "peer_uid": os.getuid(),
                            **welcome,
                        }
                        fds = [os.open(os.devnull, os.O_WRONLY)] if "stack_dumps" in welcome else []
                        if "slot_page" in welcome:
                            fds.append(os.memfd_create("slots"))
                        socket.send_fds(conn, [p.frame(msgspec.msgpack.encode(reply))], fds)
                        for fd in fds:
                            os.close(fd)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield received
    finally:
        thread.join(5)
        server.close()


def test_a_page_from_an_older_daemon_is_closed_and_frames_are_used(short_dir: Path) -> None:
    # A daemon from before "frames only" answered hello with a shared-memory page
    # (``slot_page``) after the faulthandler file. The client keeps no such page.
    with recording_daemon(str(short_dir / "old.sock"), stack_dumps=True, slot_page=256) as received:
        before = _open_memfds()
        client = wd.SocketTimerClient(short_dir / "old.sock", stack_signal=None)
        try:
            client.acquire("step", time.time() + 60)
            client.release("step")
            # The stand-in closes its own copy of the page just after sending it.
            wait_until(lambda: _open_memfds() == before, timeout=5)
        finally:
            client.close()
    assert [type(r) for r in received] == [p.Hello, p.Acquire, p.Release]


def test_progress_is_one_frame_on_the_socket_and_nothing_elsewhere(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with recording_daemon(str(short_dir / "d.sock")) as received:
        client = wd.SocketTimerClient(short_dir / "d.sock", stack_signal=None)
        try:
            wd.progress(7, client=client)
            wd.progress(8, client=client)
            with pytest.raises(ValueError, match="step must be >= 0"):
                wd.progress(-1, client=client)
        finally:
            client.close()
    assert received[1:] == [p.Progress(7), p.Progress(8)]
    # torch's FIFO has no such message, and a script run without a daemon has nobody to
    # tell: a trainer's call does nothing, so the script runs under torchrun unchanged.
    wd.progress(1, client=wd.FileTimerClient(str(short_dir / "no.fifo")))
    monkeypatch.delenv("WATCHDOGD_SOCKET", raising=False)
    monkeypatch.delenv("TORCHELASTIC_TIMER_FILE", raising=False)
    monkeypatch.setattr("watchdogd_client._timer._configured", None)
    wd.progress(1)


def test_a_client_dropped_without_close_is_freed_at_once(short_dir: Path) -> None:
    # Trainers often turn the cycle collector off: a client and its connection
    # must not keep each other (and the daemon's connection) alive.
    import gc
    import weakref

    client = wd.SocketTimerClient(short_dir / "no.sock")
    dropped = weakref.ref(client)
    gc.disable()
    try:
        del client
        assert dropped() is None
    finally:
        gc.enable()


def test_releasing_its_own_pid_by_number_leaves_nothing_to_rearm(short_dir: Path) -> None:
    # A reconnect re-arms what the client holds: a timer released with the
    # process's own pid spelt out must not come back at its passed deadline.
    client = wd.SocketTimerClient(short_dir / "no.sock")
    client._held["a"] = (time.time() + 1, 9, False)
    client._held["b"] = (time.time() + 1, 9, False)
    client._conn.send = lambda data: 0  # type: ignore[method-assign]  # no daemon here
    client._conn.raise_pending = lambda: None  # type: ignore[method-assign]
    client.release_for(os.getpid(), "a")
    assert list(client._held) == ["b"]
    client.release_all(os.getpid())
    assert list(client._conn.rearm()) == []
