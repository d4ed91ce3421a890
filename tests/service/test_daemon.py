"""The daemon end to end: real socket, real FIFO, real child processes and signals."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import msgspec
import pytest

import watchdogd_client as wd
from watchdogd.core.config import Limits
from watchdogd.daemon import Daemon
from watchdogd.linux import procs
from watchdogd.linux.endpoints import EndpointError, open_socket
from watchdogd.linux.procs import ProcessHandle
from watchdogd.service import process_watch
from watchdogd_client import protocol as p

from ..conftest import exit_code, fifo_line, fifo_write, python, running_daemon, wait_for

pytestmark = pytest.mark.anyio

SLEEPER = "import time; time.sleep(60)"


@asynccontextmanager
async def sleeper() -> AsyncIterator[int]:
    """A live child process to arm timers on (the test process is the daemon)."""
    child = python(SLEEPER)
    try:
        yield child.pid
    finally:
        child.kill()
        await exit_code(child)


_open_clients: list[wd.SocketTimerClient] = []


def client(daemon: Daemon) -> wd.SocketTimerClient:
    opened = wd.SocketTimerClient(daemon.socket_path, name="test")
    _open_clients.append(opened)
    return opened


@pytest.fixture(autouse=True)
def _close_clients() -> Iterator[None]:
    yield
    while _open_clients:
        _open_clients.pop().close()


async def call(fn, *args):  # type: ignore[no-untyped-def]
    """Run a blocking client call off the event loop the daemon runs on."""
    return await anyio.to_thread.run_sync(partial(fn, *args))


# -- expiry and kill ---------------------------------------------------------------


@pytest.mark.parametrize("transport", ["socket", "fifo"])
async def test_hung_process_is_killed_with_the_requested_signal(
    short_dir: Path, transport: str
) -> None:
    async with running_daemon(short_dir) as daemon:
        endpoint = daemon.socket_path if transport == "socket" else daemon.fifo_path
        child = python(
            f"""
            import signal, time, watchdogd_client as wd
            cls = wd.SocketTimerClient if {transport!r} == "socket" else wd.FileTimerClient
            wd.configure(cls({str(endpoint)!r}, signal=signal.SIGTERM))
            with wd.expires(after=0.3):
                time.sleep(60)
            """
        )
        assert await exit_code(child) == -signal.SIGTERM
        assert daemon.stats.signalled == 1
        assert len(daemon.timers.table) == 0


def _pending_signals(pid: int) -> int:
    """The process's pending-signal mask (``ShdPnd`` in ``/proc/PID/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("ShdPnd:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no ShdPnd for pid {pid}")


def _children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


async def test_timers_due_together_are_all_signalled_before_any_is_recorded(
    short_dir: Path,
) -> None:
    """Twenty timers overdue at once: the twentieth signal does not wait for nineteen events."""
    count = 20
    parent = python(
        f"""
        import os, signal, sys, time
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR1])  # stays pending: visible
        for _ in range({count}):
            if os.fork() == 0:
                time.sleep(60)
                os._exit(0)
        print("forked", flush=True)
        time.sleep(60)
        """,
        stdout=subprocess.PIPE,
    )
    victims: list[int] = []
    try:
        assert parent.stdout is not None
        assert parent.stdout.readline() == "forked\n"
        victims = _children(parent.pid)
        assert len(victims) == count
        # The test blocks the loop on purpose, so that all twenty are overdue at once.
        async with running_daemon(short_dir, stack_dumps="off", max_stall=None) as daemon:
            reaper = daemon.reaper
            emit = reaper.events.emit
            pending_at_first_event: list[int] = []

            def spy(name: str, /, **metadata: Any) -> None:
                if name == "timer_expired" and not pending_at_first_event:
                    mask = 1 << (signal.SIGUSR1 - 1)
                    pending_at_first_event.extend(
                        pid for pid in victims if _pending_signals(pid) & mask
                    )
                emit(name, **metadata)

            reaper.events.emit = spy  # type: ignore[method-assign]
            c = client(daemon)
            deadline = time.time() + 0.3
            for pid in victims:
                await call(c.acquire_for, pid, "step", deadline, signal.SIGUSR1)
            await call(c.sync)
            assert len(daemon.timers.table) == count
            time.sleep(max(0.0, deadline - time.time()) + 0.05)  # noqa: ASYNC251
            await wait_for(lambda: daemon.stats.signalled == count)
        assert sorted(pending_at_first_event) == sorted(victims)
    finally:
        for pid in victims:
            os.kill(pid, signal.SIGKILL)
        parent.kill()
        parent.communicate()


async def test_signal_zero_records_expiry_without_killing(short_dir: Path) -> None:
    async with running_daemon(short_dir) as daemon:
        child = python(SLEEPER)
        try:
            c = client(daemon)
            await call(c.acquire_for, child.pid, "record-only", time.time() + 0.1, 0)
            await call(c.sync)
            await wait_for(lambda: daemon.stats.expired == 1)
            await anyio.sleep(0.2)
            assert child.poll() is None
            assert daemon.stats.signalled == 0
        finally:
            child.kill()
            child.wait()


async def test_a_hung_dump_save_holds_up_neither_the_loop_nor_the_kill(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    disk = threading.Event()  # a dumps disk that does not answer until set
    async with running_daemon(
        short_dir, stack_dumps="faulthandler", stack_dump_timeout=0.5
    ) as daemon:
        save = daemon.stacks.save

        def hung_save(*args: Any) -> p.DumpInfo:
            disk.wait(10)
            return save(*args)

        monkeypatch.setattr(daemon.stacks, "save", hung_save)
        try:
            child = python(
                """
                import sys, time, watchdogd_client as wd
                with wd.expires(after=0.2, client=wd.SocketTimerClient(sys.argv[1])):
                    time.sleep(60)
                """,
                str(daemon.socket_path),
            )
            assert await exit_code(child) == -signal.SIGKILL
            died = time.monotonic()
            assert not [e for e in daemon.events.since() if e.name == "timer_expired"]
            await wait_for(lambda: any(e.name == "timer_expired" for e in daemon.events.since()))
            recorded = time.monotonic()
        finally:
            disk.set()
        (expired,) = [e for e in daemon.events.since() if e.name == "timer_expired"]
        assert expired.metadata["dump"] is None
        assert float(expired.metadata["late_ms"] or 0) < 400  # the kill did not wait for the save
        assert recorded - died > 0.2  # its event did, within the bound
    assert any("left to finish on its own" in r.getMessage() for r in caplog.records)


async def test_earlier_timer_wakes_the_sleeping_loop(short_dir: Path) -> None:
    async with running_daemon(short_dir) as daemon:
        child = python(SLEEPER)
        c = client(daemon)
        await call(c.acquire_for, child.pid, "late", time.time() + 3600, 9)
        await call(c.sync)
        await anyio.sleep(0.1)  # the expiry loop is now asleep until the late deadline
        armed = time.monotonic()
        await call(c.acquire_for, child.pid, "soon", time.time() + 0.1, 9)
        assert await exit_code(child) == -signal.SIGKILL
        # Nowhere near the hour the loop was sleeping for.
        assert time.monotonic() - armed < 10


async def test_timers_of_an_exited_process_are_dropped_and_nothing_is_signalled(
    short_dir: Path,
) -> None:
    async with running_daemon(short_dir) as daemon:
        child = python("import sys; sys.stdin.read()", stdin=subprocess.PIPE)
        c = client(daemon)
        await call(c.acquire_for, child.pid, "a", time.time() + 0.5, 9)
        await call(c.acquire_for, child.pid, "b", time.time() + 0.5, 9)
        await call(c.sync)
        assert len(daemon.timers.table) == 2
        assert child.stdin is not None
        child.stdin.close()
        assert await exit_code(child) == 0
        await wait_for(lambda: len(daemon.timers.table) == 0)
        assert daemon.stats.dropped == 2
        await anyio.sleep(0.7)
        assert daemon.stats.signalled == 0
        assert daemon.watch.process(child.pid) is None


async def test_release_disarms(short_dir: Path) -> None:
    async with running_daemon(short_dir) as daemon:
        child = python(
            f"""
            import time, watchdogd_client as wd
            c = wd.SocketTimerClient({str(daemon.socket_path)!r})
            for _ in range(50):
                with wd.expires(after=0.3, client=c):
                    pass
            c.sync()
            time.sleep(0.6)
            """
        )
        assert await exit_code(child) == 0
        assert daemon.stats.expired == 0


# -- the socket protocol ------------------------------------------------------------


async def test_list_timers_shows_what_was_armed(short_dir: Path) -> None:
    async with running_daemon(short_dir) as daemon, sleeper() as pid:
        c = client(daemon)
        await call(c.acquire_for, pid, "socket-scope", time.time() + 60, 9)
        fifo_write(daemon.fifo_path, fifo_line(pid, "fifo-scope", time.time() + 30))
        await wait_for(lambda: len(daemon.timers.table) == 2)
        timers = await call(wd.list_timers, str(daemon.socket_path))
        assert [(t.scope_id, t.source, t.pid) for t in timers] == [
            ("fifo-scope", "fifo", pid),
            ("socket-scope", "socket", pid),
        ]
        assert 25 < timers[0].remaining_s <= 30
        assert timers[1].uid == os.geteuid()
        assert timers[0].uid is None
        await call(c.release_all, pid)
        await call(c.sync)
        assert len(daemon.timers.table) == 0


async def test_errors_surface_by_the_next_call_and_on_sync(short_dir: Path) -> None:
    async with running_daemon(short_dir) as daemon, sleeper() as pid:
        c = client(daemon)

        def refused_then_sync() -> None:
            c.acquire_for(1, "init", time.time() + 60, 9)
            c.sync()

        with pytest.raises(wd.RequestError) as caught:
            await call(refused_then_sync)
        assert caught.value.code == "refused"
        assert "protected" in caught.value.message

        raised_by: list[str] = []

        def ghost_then_fine() -> None:
            # The error may beat the first call's own check; by the next it must be raised.
            raised_by.append("ghost")
            c.acquire_for(999_999_999, "ghost", time.time() + 60, 9)
            time.sleep(0.2)
            raised_by.append("fine")
            c.acquire_for(pid, "fine", time.time() + 60, 9)
            raised_by.append("none")

        with pytest.raises(wd.RequestError) as caught:
            await call(ghost_then_fine)
        assert caught.value.code == "no_such_process"
        assert raised_by[-1] in ("ghost", "fine")
        if raised_by[-1] == "fine":
            await call(c.sync)  # the call that raised was still delivered
            assert [t.scope_id for t in daemon.timers.table] == ["fine"]
        assert daemon.stats.signalled == 0


async def test_a_refusal_surfaces_while_calls_come_back_to_back(short_dir: Path) -> None:
    # acquire/release look for answers at most every millisecond: a client that
    # never pauses still gets the error, from a call made that long after it came.
    async with running_daemon(short_dir) as daemon, sleeper() as pid:
        c = client(daemon)

        def refused_then_busy() -> None:
            c.acquire_for(1, "init", time.time() + 60, 9)
            give_up = time.monotonic() + 10
            while time.monotonic() < give_up:
                c.acquire_for(pid, "busy", time.time() + 60, 9)
                c.release_for(pid, "busy")

        with pytest.raises(wd.RequestError) as caught:
            await call(refused_then_busy)
        assert caught.value.code == "refused"
        await call(c.sync)  # the call that raised was still delivered
        assert [t.scope_id for t in daemon.timers.table] in ([], ["busy"])


async def test_the_daemon_gets_each_acquire_as_sent(short_dir: Path) -> None:
    # Frames are cached per (scope, signal): a new signal, scope or deadline is sent as such.
    async with running_daemon(short_dir) as daemon:
        child = python(
            f"""
            import json, signal, time, watchdogd_client as wd
            c = wd.SocketTimerClient({str(daemon.socket_path)!r})
            now = 2e9
            c.acquire("a", now + 30)
            c.acquire("b", now + 40)
            c.signal = signal.SIGTERM
            c.acquire("a", now + 50)
            c.acquire("c", int(now) + 60)
            c.release("b")
            print(json.dumps([(t.scope_id, t.signal, t.expiration_time) for t in c.list_timers()]))
            """,
            stdout=subprocess.PIPE,
        )
        out, _ = await anyio.to_thread.run_sync(child.communicate)
        assert child.returncode == 0
        assert msgspec.json.decode(out) == [
            ["a", signal.SIGTERM, pytest.approx(2e9 + 50)],
            ["c", signal.SIGTERM, pytest.approx(2e9 + 60)],
        ]
        assert daemon.stats.signalled == 0


async def test_the_daemon_never_targets_itself_nor_opens_a_protected_pid(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    opened: list[int] = []

    def open_process(pid: int) -> ProcessHandle:
        opened.append(pid)
        return procs.open_process(pid)

    monkeypatch.setattr(process_watch, "open_process", open_process)
    async with running_daemon(short_dir) as daemon, sleeper() as pid:
        c = client(daemon)
        await call(c.sync)
        opened.clear()  # the hello's: its stack dumps (in-process, the daemon's own pid)

        def arm_on(protected: int) -> None:
            c.acquire_for(protected, "self", time.time() + 0.01, 9)
            c.sync()

        for protected in (os.getpid(), 1):
            with pytest.raises(wd.RequestError, match="protected"):
                await call(arm_on, protected)
        await call(c.acquire_for, pid, "fine", time.time() + 60, 9)
        await call(c.sync)
        assert len(daemon.timers.table) == 1
    assert opened == [pid]  # a flood of protected pids costs no pidfd


def raw_connect(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(str(path))
    return sock


def send(sock: socket.socket, message: object) -> None:
    sock.sendall(p.frame(msgspec.msgpack.encode(message)))


def receive(sock: socket.socket) -> p.Reply:
    header = b""
    while len(header) < 4:
        chunk = sock.recv(4 - len(header))
        assert chunk, "daemon closed the connection"
        header += chunk
    size = int.from_bytes(header, "big")
    body = b""
    while len(body) < size:
        body += sock.recv(size - len(body))
    return msgspec.msgpack.decode(body, type=p.Reply)


async def test_bad_frames_get_errors_and_cost_nothing_else(short_dir: Path) -> None:
    async with running_daemon(short_dir) as daemon, sleeper() as pid:
        good = client(daemon)
        await call(good.acquire_for, pid, "keep", time.time() + 60, 9)
        await call(good.sync)

        def converse() -> list[p.Reply]:
            with raw_connect(daemon.socket_path) as sock:
                send(sock, {"op": "status"})  # before hello
                send(sock, {"op": "hello", "version": 1})
                sock.sendall(p.frame(b"\xc1\xff garbage"))
                send(sock, {"op": "no_such_op"})
                send(sock, {"op": "acquire", "scope_id": 5, "expiration_time": "soon"})
                send(sock, {"op": "acquire", "scope_id": "x", "expiration_time": float("nan")})
                send(sock, {"op": "hello", "version": 1})
                send(sock, {"op": "sync"})
                return [receive(sock) for _ in range(8)]

        replies = await call(converse)
        codes = [getattr(r, "code", type(r).__name__) for r in replies]
        assert codes == [
            "hello_required",
            "Welcome",
            "bad_request",
            "bad_request",
            "bad_request",
            "bad_request",
            "bad_request",
            "Synced",
        ]
        assert [r.seq for r in replies] == list(range(8))
        assert "op" in replies[3].message  # names the offending field
        assert daemon.stats.bad_input == 3  # the NaN is a refusal, not undecodable
        assert [t.scope_id for t in daemon.timers.table] == ["keep"]
        await call(good.sync)


async def test_absurd_length_and_truncated_frames_close_only_that_connection(
    short_dir: Path,
) -> None:
    async with running_daemon(short_dir) as daemon, sleeper() as pid:
        good = client(daemon)
        await call(good.acquire_for, pid, "keep", time.time() + 60, 9)

        def absurd() -> p.Reply:
            with raw_connect(daemon.socket_path) as sock:
                send(sock, {"op": "hello", "version": 1})
                receive(sock)
                sock.sendall((2**32 - 1).to_bytes(4, "big") + b"x" * 100)
                reply = receive(sock)
                assert sock.recv(1) == b""  # closed
                return reply

        def truncated() -> None:
            with raw_connect(daemon.socket_path) as sock:
                send(sock, {"op": "hello", "version": 1})
                sock.sendall((1000).to_bytes(4, "big") + b"half a frame")

        reply = await call(absurd)
        assert isinstance(reply, p.Error) and reply.code == "bad_frame"
        await call(truncated)
        await call(good.sync)
        assert [t.scope_id for t in daemon.timers.table] == ["keep"]
        assert daemon.stats.connections == 1


async def test_version_mismatch_is_refused_clearly(short_dir: Path) -> None:
    async with running_daemon(short_dir) as daemon:

        def converse() -> p.Reply:
            with raw_connect(daemon.socket_path) as sock:
                send(sock, {"op": "hello", "version": 99})
                return receive(sock)

        reply = await call(converse)
        assert isinstance(reply, p.Error)
        assert reply.code == "version_mismatch"
        assert "99" in reply.message


async def test_client_reconnects_and_rearms_after_daemon_restart(short_dir: Path) -> None:
    trainer = python(
        f"""
        import sys, time, watchdogd_client as wd
        c = wd.SocketTimerClient({str(short_dir / "watchdogd.sock")!r})
        c.acquire("held", time.time() + 60)
        c.acquire("released", time.time() + 60)
        c.release("released")
        c.sync()
        print("armed", flush=True)
        sys.stdin.readline()  # the daemon restarts meanwhile
        c.acquire("new", time.time() + 60)
        c.sync()
        print("rearmed", flush=True)
        sys.stdin.readline()
        """,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    assert trainer.stdin is not None and trainer.stdout is not None
    try:
        async with running_daemon(short_dir) as daemon:
            assert await call(trainer.stdout.readline) == "armed\n"
            assert [t.scope_id for t in daemon.timers.table] == ["held"]
        async with running_daemon(short_dir) as daemon:
            trainer.stdin.write("go\n")
            trainer.stdin.flush()
            assert await call(trainer.stdout.readline) == "rearmed\n"
            assert sorted(t.scope_id for t in daemon.timers.table) == ["held", "new"]
            assert {t.pid for t in daemon.timers.table} == {trainer.pid}
    finally:
        with trainer:
            trainer.kill()


def test_unreachable_daemon_is_torchs_broken_pipe_naming_the_path(short_dir: Path) -> None:
    # torch's FileTimerClient raises BrokenPipeError when no server reads its
    # FIFO; code that catches that catches ours, from either client.
    path = short_dir / "absent.sock"
    with pytest.raises(BrokenPipeError) as caught:
        wd.SocketTimerClient(path).acquire("x", time.time() + 5)
    assert isinstance(caught.value, wd.DaemonUnavailableError)
    assert str(path) in str(caught.value)
    started = time.monotonic()
    with pytest.raises(BrokenPipeError, match=str(short_dir / "absent.fifo")):
        wd.FileTimerClient(short_dir / "absent.fifo").acquire("x", time.time() + 5)
    assert time.monotonic() - started >= 0.85  # torch's 10 tries, 0.1 s apart


def test_fifo_client_waits_for_a_reader_that_comes_late(short_dir: Path) -> None:
    fifo = short_dir / "late.fifo"
    os.mkfifo(fifo)
    readers: list[int] = []
    opener = threading.Timer(
        0.3, lambda: readers.append(os.open(fifo, os.O_RDONLY | os.O_NONBLOCK))
    )
    opener.start()
    try:
        wd.FileTimerClient(fifo).acquire("late", time.time() + 5)
        opener.join()
        assert msgspec.json.decode(os.read(readers[0], 4096))["scope_id"] == "late"
    finally:
        opener.join()
        for fd in readers:
            os.close(fd)


# -- the FIFO -----------------------------------------------------------------------


async def test_malformed_fifo_lines_cost_only_themselves(short_dir: Path) -> None:
    async with running_daemon(short_dir, limits=Limits(max_line=256)) as daemon, sleeper() as pid:
        soon = time.time() + 60
        fifo_write(
            daemon.fifo_path,
            fifo_line(pid, "one", soon)
            + b"this is not json\n"
            + b'{"version": 1, "pid": "nope", "scope_id": 3}\n'
            + b"x" * 1000
            + b"\n"
            + b'{"version": 2, "pid": 1, "scope_id": "v2", "expiration_time": 1, "signal": 9}\n'
            + b'{"half a li'
            + fifo_line(pid, "glued", soon)
            + fifo_line(pid, "two", soon),
        )
        await wait_for(lambda: len(daemon.timers.table) == 3)
        assert sorted(t.scope_id for t in daemon.timers.table) == ["glued", "one", "two"]
        assert daemon.stats.bad_input == 5
        # A release on the FIFO still works after all that.
        fifo_write(daemon.fifo_path, fifo_line(pid, "two", -1, 0))
        await wait_for(lambda: len(daemon.timers.table) == 2)


async def test_fifo_requests_for_missing_or_protected_pids_are_refused(short_dir: Path) -> None:
    async with running_daemon(short_dir) as daemon:
        fifo_write(
            daemon.fifo_path,
            fifo_line(1, "init", time.time() + 0.05)
            + fifo_line(999_999_999, "ghost", time.time() + 0.05)
            + fifo_line(os.getpid(), "daemon", time.time() + 0.05),
        )
        await wait_for(lambda: daemon.stats.refused == 3)
        assert len(daemon.timers.table) == 0
        await anyio.sleep(0.2)
        assert daemon.stats.signalled == 0


async def test_fifo_client_waits_for_room_instead_of_failing(short_dir: Path) -> None:
    async with running_daemon(short_dir) as daemon:
        child = python(
            f"""
            import time, watchdogd_client as wd
            c = wd.FileTimerClient({str(daemon.fifo_path)!r})
            for i in range(20000):
                c.acquire(f"scope-{{i % 50}}", time.time() + 600)
                c.release(f"scope-{{i % 50}}")
            """
        )
        assert await exit_code(child, 60) == 0
        await wait_for(lambda: daemon.stats.requests["fifo"] == 40000)
        assert daemon.stats.bad_input == 0


# -- endpoints ----------------------------------------------------------------------


async def test_second_daemon_refuses_the_same_endpoints(short_dir: Path) -> None:
    async with running_daemon(short_dir) as first:
        with pytest.raises(EndpointError, match=f"pid {os.getpid()}"):
            async with running_daemon(short_dir):
                pass
        c = client(first)
        await call(c.sync)


async def test_stale_socket_is_replaced_but_other_files_are_not(short_dir: Path) -> None:
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(str(short_dir / "watchdogd.sock"))
    stale.close()
    async with running_daemon(short_dir) as daemon:
        await call(client(daemon).sync)
    other = short_dir / "other"
    other.mkdir()
    (other / "timer.fifo").write_text("precious")
    with pytest.raises(EndpointError, match="not a FIFO"):
        async with running_daemon(other):
            pass
    assert (other / "timer.fifo").read_text() == "precious"


def test_a_socket_path_too_long_for_a_unix_socket_is_named_with_why(tmp_path: Path) -> None:
    path = tmp_path / ("x" * 120) / "watchdogd.sock"
    path.parent.mkdir()
    with pytest.raises(EndpointError, match=r"AF_UNIX path too long: \d+ bytes, 107 at most"):
        open_socket(path)
