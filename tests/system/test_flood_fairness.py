"""A flood from an unprivileged user never delays a kill.

Nobody's connections (and nobody's FIFO writes) send junk and refused
requests as fast as the daemon takes them, while root's timer on a hung
process expires: the kill must still land promptly. Before per-connection
budgets, one read of 64 KiB of 4-byte junk frames was ~16,000 requests
served in one loop callback, and the kill waited seconds behind them.

The daemon runs in-process (``running_daemon``: it also fails the test if
its loop stalled > 50 ms); the flood comes from another process that drops
to nobody before it connects.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import anyio
import msgspec
import pytest

import watchdogd_client as wd
from watchdogd.core.config import PolicyConfig
from watchdogd_client import protocol as p

from ..conftest import fifo_write, running_daemon, wait_for
from ..hostile import NOBODY, call, needs_root, sleeper
from ..wire import HELLO, exchange, parse_replies, raw_connect

pytestmark = needs_root

# Generous for a loaded 2-core CI machine; unfair scheduling was seconds.
KILL_BOUND = 0.25

FLOODER = r"""
import os, selectors, socket, sys
sock_path, fifo_path, conns = sys.argv[1], sys.argv[2], int(sys.argv[3])
hello, frame, line = (bytes.fromhex(a) for a in sys.argv[4:7])
frames, lines = frame * (65536 // len(frame)), line * (65536 // max(1, len(line)))
os.setgroups([])
os.setgid(65534)
os.setuid(65534)
sel = selectors.DefaultSelector()
for _ in range(conns):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sock_path)
    s.sendall(hello)
    s.setblocking(False)
    sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE, frames)
if lines:
    fifo = os.open(fifo_path, os.O_WRONLY | os.O_NONBLOCK)
    sel.register(fifo, selectors.EVENT_WRITE, lines)
print("flooding", flush=True)
while True:
    for key, events in sel.select():
        if key.data is lines:
            try:
                os.write(key.fd, lines)
            except BlockingIOError:
                pass
            continue
        s = key.fileobj
        if events & selectors.EVENT_READ:
            try:
                if not s.recv(1 << 20):
                    sys.exit("the daemon closed a flooding connection")
            except BlockingIOError:
                pass
        if events & selectors.EVENT_WRITE:
            try:
                s.send(frames)
            except BlockingIOError:
                pass
"""

# What each flooding connection sends, over and over, 64 KiB at a time.
# Junk: an empty frame (4 bytes, a decode error answered with an error, and an event).
JUNK = b"\0\0\0\0"
# Valid but refused: arm a timer on pid 1 (protected), answered with an error.
REFUSED = p.frame(msgspec.msgpack.encode(p.Acquire("x", time.time() + 60, 9, 1)))
FIFO_JUNK = b"x\n"


def flooder(runtime: Path, conns: int, frames: bytes, lines: bytes) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            FLOODER,
            str(runtime / "watchdogd.sock"),
            str(runtime / "timer.fifo"),
            str(conns),
            HELLO.hex(),
            frames.hex(),
            lines.hex(),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "flooding"
    return proc


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("conns", "frames", "lines"),
    [(3, JUNK, b""), (3, REFUSED, b""), (1, JUNK, FIFO_JUNK)],
    ids=["junk-frames", "refused-requests", "frames-and-fifo-lines"],
)
async def test_flood_from_nobody_never_delays_a_kill(
    short_dir: Path, conns: int, frames: bytes, lines: bytes
) -> None:
    os.chmod(short_dir, 0o755)  # nobody must reach the socket
    async with running_daemon(
        short_dir,
        socket_mode=0o666,
        fifo_mode=0o666,
        stack_dumps="off",
        policy=PolicyConfig(fifo_allowed_uids=[NOBODY]),
    ) as daemon:
        root = wd.SocketTimerClient(daemon.socket_path)
        await call(root.sync)  # connected before the flood: the kill is what is measured
        flood = await call(flooder, short_dir, conns, frames, lines)
        try:
            await anyio.sleep(0.3)  # the flood is in full swing
            latencies = []
            for _ in range(3):
                victim = sleeper()
                deadline = time.time() + 0.2
                root.acquire_for(victim.pid, "hung", deadline, 9)
                await call(victim.wait, 10)
                latencies.append(time.time() - deadline)
                assert victim.returncode == -9
            assert flood.poll() is None, "the flooder stopped early"
            served = daemon.stats.bad_input + daemon.stats.refused
        finally:
            flood.kill()
            flood.wait()
            assert flood.stdout is not None
            flood.stdout.close()
            root.close()
    assert max(latencies) < KILL_BOUND, [f"{t * 1000:.0f} ms" for t in latencies]
    assert served > 1000, "the flood did not reach the daemon"


@pytest.mark.anyio
async def test_the_fronts_look_for_passed_deadlines_every_16_requests_and_lines(
    short_dir: Path,
) -> None:
    """A kill waits for a few requests of a flood, not for a turn per flooding connection:
    the socket and FIFO fronts expire what is due themselves, within their turns."""
    async with running_daemon(short_dir, stack_dumps="off") as daemon:
        checks = 0
        expire_due = daemon.timers.expire_due

        def counted() -> None:
            nonlocal checks
            checks += 1
            expire_due()

        daemon.timers.expire_due = counted  # type: ignore[method-assign]
        with await call(raw_connect, daemon.socket_path) as sock:
            (output,) = await call(exchange, [(sock, HELLO + JUNK * 1600)])
        assert len(parse_replies(output)) == 1601
        socket_checks, checks = checks, 0
        fifo_write(daemon.fifo_path, FIFO_JUNK * 1600)
        await wait_for(lambda: daemon.stats.bad_input == 3200)
    assert socket_checks >= 1600 // 16
    assert checks >= 1600 // 16
