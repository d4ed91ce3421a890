"""Hostile input against the limits: oversized, malformed and out-of-range requests.

The rule under test (DESIGN, "Rules of the house"): bad input gets a clear
error and costs nothing else - no crash, no lost timer, and the requests
around it are served. Most tests run the daemon in-process
(``running_daemon``) and watch ``daemon.emit``; the ones whose bad frame
once crashed the daemon run ``watchdogd serve`` as a subprocess, reached
by a client that connected as ``nobody``.
"""

from __future__ import annotations

import gc
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import anyio
import msgspec
import pytest

import watchdogd_client as wd
from watchdogd.core.config import Limits
from watchdogd_client import protocol as p

from ..conftest import fifo_line, fifo_write, running_daemon, wait_for
from ..hostile import (
    NOBODY,
    NobodyDialer,
    arm_error,
    call,
    capture_events,
    needs_root,
    nobody_dialer,
    serve,
    sleepers,
    sleepers_off_loop,
)
from ..wire import HELLO, encode, exchange, greeted, parse_replies, raw_connect, receive

pytestmark = needs_root


# -- limits ----------------------------------------------------------------------------

SMALL = Limits(
    max_scope_len=16,
    max_timers_per_pid=3,
    max_timers=5,
    max_connections=3,
    max_frame=256,
    max_line=128,
)


@pytest.mark.anyio
async def test_scope_id_longer_than_max_scope_len_is_refused(short_dir: Path) -> None:
    """A scope_id one past max_scope_len is limit_exceeded by socket and FIFO; at it, armed."""
    async with running_daemon(short_dir, limits=SMALL) as daemon:
        events = capture_events(daemon)
        async with sleepers_off_loop(None) as (victim,):
            later = time.time() + 60
            assert await call(arm_error, daemon.socket_path, victim.pid, "s" * 16, later) is None
            error = await call(arm_error, daemon.socket_path, victim.pid, "s" * 17, later)
            assert error is not None and error.code == "limit_exceeded"
            assert "max_scope_len" in error.message
            fifo_write(daemon.fifo_path, fifo_line(victim.pid, "f" * 17, later))
            await anyio.sleep(0.1)
            refused = [m for name, m in events if name == "request_refused"]
            assert [(m["via"], m["code"]) for m in refused] == [
                ("socket", "limit_exceeded"),
                ("fifo", "limit_exceeded"),
            ]
            assert [t.scope_id for t in daemon.timers.table] == ["s" * 16]


@pytest.mark.anyio
async def test_timer_count_limits_refuse_new_timers_only(short_dir: Path) -> None:
    """max_timers_per_pid and max_timers refuse new timers; re-arming and freed room still work."""
    async with (
        running_daemon(short_dir, limits=SMALL) as daemon,
        sleepers_off_loop(None, None) as (a, b),
    ):
        later = time.time() + 60
        path = daemon.socket_path
        for i in range(3):
            assert await call(arm_error, path, a.pid, f"a{i}", later) is None
        error = await call(arm_error, path, a.pid, "a3", later)
        assert error is not None and error.code == "limit_exceeded"
        assert "max_timers_per_pid" in error.message
        # Re-arming an existing timer at the limit is not a new timer.
        assert await call(arm_error, path, a.pid, "a0", later + 1) is None
        for i in range(2):
            assert await call(arm_error, path, b.pid, f"b{i}", later) is None
        error = await call(arm_error, path, b.pid, "b2", later)
        assert error is not None and error.code == "limit_exceeded"
        assert "max_timers" in error.message and "per_pid" not in error.message
        assert len(daemon.timers.table) == 5
        with wd.SocketTimerClient(path) as c:
            await call(c.release_for, b.pid, "b0")
            await call(c.sync)
        assert await call(arm_error, path, b.pid, "b2", later) is None
        assert daemon.stats.refused == 2


@pytest.mark.anyio
async def test_connection_beyond_max_connections_gets_an_error_with_seq_minus_one(
    short_dir: Path,
) -> None:
    """The connection past max_connections gets Error(-1, limit_exceeded) and is closed."""
    async with running_daemon(short_dir, limits=SMALL) as daemon:
        held = [await call(greeted, daemon.socket_path) for _ in range(3)]
        try:
            extra = await call(raw_connect, daemon.socket_path)
            with extra:
                reply = await call(receive, extra)
                assert isinstance(reply, p.Error)
                assert (reply.seq, reply.code) == (-1, "limit_exceeded")
                assert "max_connections" in reply.message
                assert await call(receive, extra) is None  # closed
            assert daemon.stats.connections == 3
            held.pop().close()
            await anyio.sleep(0.1)
            with wd.SocketTimerClient(daemon.socket_path) as c:
                status = await call(c.status)
            assert status.connections == 3
        finally:
            for sock in held:
                sock.close()


def greet(sock: socket.socket) -> None:
    sock.settimeout(5)
    sock.sendall(HELLO)
    assert isinstance(receive(sock), p.Welcome)


@pytest.mark.anyio
async def test_connections_past_max_connections_per_uid_are_refused_and_root_is_not_held(
    short_dir: Path,
) -> None:
    """nobody's third connection (cap 2) gets Error(-1, limit_exceeded) and an event; root
    opens more than the cap; a closed connection frees its place."""
    os.chmod(short_dir, 0o755)  # nobody must reach the socket
    limits = Limits(max_connections_per_uid=2)
    async with running_daemon(short_dir, socket_mode=0o666, limits=limits) as daemon:
        events = capture_events(daemon)
        dialer = await call(NobodyDialer, daemon.socket_path)
        held: list[socket.socket] = []
        try:
            for _ in range(2):
                held.append(await call(dialer.connect))
                await call(greet, held[-1])
            with await call(dialer.connect) as extra:
                extra.settimeout(5)
                reply = await call(receive, extra)
                assert isinstance(reply, p.Error)
                assert (reply.seq, reply.code) == (-1, "limit_exceeded")
                assert f"uid {NOBODY}" in reply.message
                assert "max_connections_per_uid 2" in reply.message
                assert await call(receive, extra) is None  # closed
            for _ in range(3):  # root: past the per-uid cap
                held.append(await call(greeted, daemon.socket_path))
            assert daemon.socket_front.per_uid == {NOBODY: 2, 0: 3}
            held.pop(0).close()
            await wait_for(lambda: daemon.socket_front.per_uid[NOBODY] == 1)
            held.append(await call(dialer.connect))
            await call(greet, held[-1])
            status = await call(wd.status, str(daemon.socket_path))
            table = await call(watchdogctl_status, daemon.socket_path)
        finally:
            for sock in held:
                sock.close()
            await call(dialer.close)
    assert status.connections_refused == {"max_connections_per_uid": 1}
    assert re.search(r"^connections refused max_connections_per_uid +1$", table, re.M), table
    refused = [m for name, m in events if name == "connection_refused"]
    assert [(m["uid"], m["limit"]) for m in refused] == [(NOBODY, "max_connections_per_uid")]
    assert daemon.stats.connections_refused == {"max_connections_per_uid": 1}


def watchdogctl_status(socket_path: Path) -> str:
    ctl = [sys.executable, "-m", "watchdogd.cli.ctl", "--socket", str(socket_path), "status"]
    return subprocess.run(ctl, capture_output=True, text=True, check=True, timeout=30).stdout


RATE = 5


def junk_burst(dialer: NobodyDialer, frames: int) -> int:
    """``frames`` empty frames (each a bad_request) from nobody; the error replies it got."""
    conn = dialer.connect()
    with conn:
        (output,) = exchange([(conn, HELLO + b"\0\0\0\0" * frames)])
    return sum(isinstance(r, p.Error) for r in parse_replies(output))


@pytest.mark.anyio
async def test_a_flood_of_bad_frames_yields_rate_events_a_second_and_a_summary_of_the_rest(
    short_dir: Path,
) -> None:
    """Bursts of junk over ~2 s: at most RATE bad_input events and one bad_input_suppressed
    in any second; the summaries' counts and the events add up to every frame, all counted."""
    os.chmod(short_dir, 0o755)
    limits = Limits(max_noisy_events_per_s=RATE)
    async with running_daemon(short_dir, socket_mode=0o666, limits=limits) as daemon:
        dialer = await call(NobodyDialer, daemon.socket_path)
        try:
            errors = 0
            for pause in (0.0, 0.4, 0.8, 0.4):
                await anyio.sleep(pause)
                errors += await call(junk_burst, dialer, 300)
        finally:
            await call(dialer.close)
        assert errors == 1200  # every frame still answered
        await anyio.sleep(1.2)  # the last summary is due
        noisy = [
            e
            for e in daemon.events.since()
            if e.name in ("bad_input", "bad_input_suppressed") and e.metadata["uid"] == NOBODY
        ]
        assert daemon.stats.bad_input == 1200
        status = await call(wd.status, str(daemon.socket_path))
    recorded = [e for e in noisy if e.name == "bad_input"]
    summaries = [e for e in noisy if e.name == "bad_input_suppressed"]
    assert len(recorded) + sum(int(e.metadata["count"]) for e in summaries) == 1200
    assert len(summaries) >= 2  # the bursts span more than one window
    assert all(e.metadata["via"] == "socket" for e in summaries)
    assert daemon.stats.suppressed["bad_input"] == 1200 - len(recorded)
    assert status.suppressed == {"bad_input": 1200 - len(recorded)}
    for first in noisy:
        window = [e for e in noisy if first.timestamp <= e.timestamp < first.timestamp + 1000]
        assert sum(e.name == "bad_input" for e in window) <= RATE
        assert len(window) <= RATE + 1, [(e.name, e.timestamp) for e in window]


@pytest.mark.anyio
async def test_a_fifo_flood_is_summarised_too_and_root_socket_events_are_not_held_back(
    short_dir: Path,
) -> None:
    """The FIFO is one source (it has no uid); another source's events are still recorded."""
    limits = Limits(max_noisy_events_per_s=RATE)
    async with running_daemon(short_dir, limits=limits) as daemon:
        fifo_write(daemon.fifo_path, b"x\n" * 500)
        await wait_for(lambda: daemon.stats.bad_input == 500)
        with wd.SocketTimerClient(daemon.socket_path) as c, pytest.raises(wd.RequestError):
            await call(c.acquire_for, 1, "protected", time.time() + 60, 9)
            await call(c.sync)
        await wait_for(
            lambda: any(e.name == "bad_input_suppressed" for e in daemon.events.since()), 3
        )
        events = daemon.events.since()
    fifo = [e for e in events if e.name.startswith("bad_input")]
    assert [e.name for e in fifo].count("bad_input") == RATE
    (summary,) = (e for e in fifo if e.name == "bad_input_suppressed")
    assert summary.metadata == {"via": "fifo", "uid": None, "count": 500 - RATE, "window_s": 1.0}
    (refused,) = (e for e in events if e.name == "request_refused")
    assert (refused.metadata["uid"], refused.metadata["pid"]) == (0, 1)


@pytest.mark.anyio
async def test_bad_input_leaves_no_cyclic_garbage(short_dir: Path) -> None:
    """A bad line or frame frees what it made at once: an exception kept past its except
    block makes a cycle with its traceback, and a flood of them ran the collector ~4 times
    a second at ~2 ms a pause, on the loop."""
    async with running_daemon(short_dir) as daemon:
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            fifo_write(daemon.fifo_path, b"x\n" * 200 + b'{"version": 1}\n' * 200)
            with await call(raw_connect, daemon.socket_path) as sock:
                (output,) = await call(exchange, [(sock, HELLO + b"\0\0\0\0" * 200)])
            await wait_for(lambda: daemon.stats.bad_input == 600)
            gc.collect()
            errors = [o for o in gc.garbage if isinstance(o, BaseException)]
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert len(parse_replies(output)) == 201
    assert errors == []


@pytest.mark.anyio
async def test_frame_larger_than_max_frame_is_bad_frame_and_closes(short_dir: Path) -> None:
    """A max_frame payload is served; one byte more is bad_frame, counted, and closes."""
    async with running_daemon(short_dir, limits=SMALL) as daemon:

        def converse() -> list[p.Reply | None]:
            with greeted(daemon.socket_path) as sock:
                # Exactly max_frame is still a frame (unknown fields are ignored).
                (payload,) = (
                    encoded
                    for n in range(256)
                    if len(encoded := msgspec.msgpack.encode({"op": "sync", "pad": "x" * n})) == 256
                )
                sock.sendall(p.frame(payload))
                replies = [receive(sock)]
                sock.sendall((257).to_bytes(4, "big") + b"\x80" * 257)
                replies += [receive(sock), receive(sock)]
                return replies

        synced, error, closed = await call(converse)
        assert isinstance(synced, p.Synced)
        assert isinstance(error, p.Error) and error.code == "bad_frame"
        assert "257" in error.message
        assert closed is None
        assert daemon.stats.bad_input == 1
        with wd.SocketTimerClient(daemon.socket_path) as c:
            await call(c.sync)


@pytest.mark.anyio
async def test_fifo_line_longer_than_max_line_is_dropped_and_counted(short_dir: Path) -> None:
    """FIFO lines past max_line are dropped and counted; the lines around them are armed."""
    async with running_daemon(short_dir, limits=SMALL) as daemon:
        events = capture_events(daemon)
        async with sleepers_off_loop(None) as (victim,):
            later = time.time() + 60

            def padded(scope: str, length: int) -> bytes:
                line = fifo_line(victim.pid, scope, later).rstrip(b"\n")
                return line[:-1] + b" " * (length - len(line)) + b"}\n"

            exact, over = padded("exact", 128), padded("over", 129)
            assert (len(exact), len(over)) == (129, 130)  # with their newlines
            fifo_write(
                daemon.fifo_path, exact + over + b"y" * 10_000 + b"\n" + padded("after", 100)
            )
            await anyio.sleep(0.2)
            assert sorted(t.scope_id for t in daemon.timers.table) == ["after", "exact"]
            assert daemon.stats.bad_input == 2
            reasons = [m["reason"] for name, m in events if name == "bad_input"]
            assert reasons == ["line longer than max_line (128)"] * 2


# -- known daemon bugs -------------------------------------------------------------------


def send_as_nobody(runtime_dir: Path, stream: bytes) -> tuple[list[p.Reply], p.StatusInfo]:
    """``stream`` from nobody to a fresh ``watchdogd serve``: its replies and then its status.

    The daemon must outlive the stream.
    """
    with (
        nobody_dialer(runtime_dir / "watchdogd.sock") as dialer,
        serve(runtime_dir, "socket_mode = 0o666\n") as served,
    ):
        conn = dialer.connect()
        (output,) = exchange([(conn, stream)])
        conn.close()
        replies = parse_replies(output)
        time.sleep(0.2)
        assert served.alive(), "a nobody client crashed the daemon with one frame"
        with wd.SocketTimerClient(served.socket) as c:
            return replies, c.status()


async def fifo_between_good_lines(
    runtime_dir: Path, bad: Callable[[int, float], bytes]
) -> tuple[list[str], dict[str, int]]:
    """``bad(pid, expiration)`` on the FIFO between two good lines: the scopes armed, the counts."""
    async with running_daemon(runtime_dir) as daemon, sleepers_off_loop(None) as (victim,):
        later = time.time() + 60
        fifo_write(
            daemon.fifo_path,
            fifo_line(victim.pid, "before", later)
            + bad(victim.pid, later)
            + fifo_line(victim.pid, "after", later),
        )
        await anyio.sleep(0.3)
        return sorted(t.scope_id for t in daemon.timers.table), {
            "refused": daemon.stats.refused,
            "bad_input": daemon.stats.bad_input,
        }


def test_out_of_range_pid_over_the_socket_is_an_error_not_a_crash(short_dir: Path) -> None:
    """An acquire for pid 2**31 (from nobody) is no_such_process, and the daemon lives."""
    request = p.Acquire("x", time.time() + 60, 9, 2**31)
    replies, status = send_as_nobody(short_dir, HELLO + encode(request) + encode(p.Sync()))
    assert [type(r).__name__ for r in replies] == ["Welcome", "Error", "Synced"]
    error = replies[1]
    assert isinstance(error, p.Error) and error.code == "no_such_process"
    assert status.refused == 1


@pytest.mark.anyio
async def test_out_of_range_pid_on_the_fifo_costs_only_its_line(short_dir: Path) -> None:
    """A FIFO line for pid 2**31 is refused and counted; the lines around it are armed."""
    armed, counts = await fifo_between_good_lines(
        short_dir, lambda pid, later: fifo_line(2**31, "overflow", later)
    )
    assert armed == ["after", "before"]
    assert counts["refused"] == 1


def test_invalid_utf8_in_a_frame_is_bad_request_not_a_crash(short_dir: Path) -> None:
    """A frame whose string is not UTF-8 is bad_request, and the daemon lives."""
    bad = p.frame(b"\x81\xa2op\xa1\xff")  # {"op": "\xff"}: not UTF-8
    replies, _ = send_as_nobody(short_dir, bad + HELLO + encode(p.Sync()))
    assert [type(r).__name__ for r in replies] == ["Error", "Welcome", "Synced"]
    error = replies[0]
    assert isinstance(error, p.Error) and error.code == "bad_request"


@pytest.mark.anyio
async def test_invalid_utf8_on_the_fifo_costs_only_its_line(short_dir: Path) -> None:
    """A FIFO line whose string is not UTF-8 is bad_input; the lines around it are armed."""
    armed, counts = await fifo_between_good_lines(
        short_dir, lambda pid, later: fifo_line(pid, "bad", later).replace(b'"bad"', b'"\xff"')
    )
    assert armed == ["after", "before"]
    assert counts["bad_input"] == 1


KILLING_PYSPY = """#!/bin/sh
# Stands in for py-spy: the process dies while its stacks are being captured.
kill -9 "$3"
sleep 0.2
exit 1
"""


def test_process_exiting_during_its_stack_capture_does_not_crash_the_daemon(
    short_dir: Path,
) -> None:
    """A hung process that dies while its stacks are captured is 'already gone', not a crash."""
    bindir = short_dir / "bin"
    bindir.mkdir()
    (bindir / "py-spy").write_text(KILLING_PYSPY)
    (bindir / "py-spy").chmod(0o755)
    env = {"PATH": f"{bindir}:{os.environ['PATH']}"}
    with serve(short_dir, 'stack_dumps = "py-spy"\n', env) as served, sleepers(None) as (hung,):
        with wd.SocketTimerClient(served.socket) as c:
            c.acquire_for(hung.pid, "step", time.time() + 0.2, 9)
            c.sync()
        assert hung.wait(5) == -signal.SIGKILL  # by the stand-in py-spy
        time.sleep(0.6)
        assert served.alive(), "the daemon died: " + (short_dir / "daemon.err").read_text()[-300:]
        with wd.SocketTimerClient(served.socket) as c:
            status = c.status()
        assert (status.expired, status.signalled) == (1, 0)
        actions = [e["metadata"]["action"] for e in served.events() if e["name"] == "timer_expired"]
        assert actions == ["process already gone"]
