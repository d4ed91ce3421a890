"""Stack dumps before the kill: the end-of-dump marker, and many captures at once.

Real processes, real faulthandler files, real signals; the daemon in-process.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from functools import partial
from pathlib import Path

import anyio
import pytest

from watchdogd.linux.stacks import _Capture
from watchdogd_client.protocol import DUMP_MARKER

from ..conftest import big_heap, exit_code, python, running_daemon, wait_for

pytestmark = pytest.mark.anyio

# A parent that forks N hung children (plus, last, one that blocks the stack
# signal, so its dump never comes), has them all arm a timer expiring at the
# same instant, then reaps them and prints {pid: how it ended, ...} as JSON.
MANY_HUNG = """
import json, os, signal, sys, time
import watchdogd_client as wd

sock, count = sys.argv[1], int(sys.argv[2])
pipes, pids = [], []
for i in range(count + 1):
    go_r, go_w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(go_w)
        os.close(ready_r)
        client = wd.SocketTimerClient(sock)
        client.sync()  # connected: hello, faulthandler registered
        if i == count:  # the slow one: its capture waits out stack_dump_timeout
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
        os.write(ready_w, b"c")
        expiration = float(os.read(go_r, 64))
        client.acquire("step", expiration)
        client.sync()
        os.write(ready_w, b"a")
        exec(f"def hung_{i}():\\n    time.sleep(3600)\\nhung_{i}()")
        os._exit(0)
    os.close(go_r)
    os.close(ready_w)
    pipes.append((go_w, ready_r))
    pids.append(pid)
for _, ready_r in pipes:
    assert os.read(ready_r, 1) == b"c"
expiration = repr(time.time() + 1.0).encode()  # one instant for all of them
for go_w, _ in pipes:
    os.write(go_w, expiration)
for _, ready_r in pipes:
    assert os.read(ready_r, 1) == b"a"
ended = {}
for pid in pids:
    _, status = os.waitpid(pid, 0)
    ended[pid] = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
print(json.dumps({"pids": pids, "ended": ended}))
"""


async def test_simultaneous_expiries_with_dumps_each_wait_for_their_own_capture_only(
    short_dir: Path,
) -> None:
    count = 100
    async with running_daemon(
        short_dir, stack_dumps="faulthandler", stack_dump_timeout=1.0
    ) as daemon:
        parent = python(MANY_HUNG, str(daemon.socket_path), str(count), stdout=subprocess.PIPE)
        out, _ = await anyio.to_thread.run_sync(partial(parent.communicate, timeout=120))
        assert parent.returncode == 0
        result = json.loads(out)
        await anyio.sleep(0.1)
        events = [e for e in daemon.events.since() if e.name == "timer_expired"]
        dumps = {d.id: d for d in await anyio.to_thread.run_sync(daemon.stacks.list)}
        texts = {
            dump_id: (await anyio.to_thread.run_sync(daemon.stacks.read, dump_id) or ("", ""))[1]
            for dump_id in dumps
        }
    pids, slow = result["pids"][:count], result["pids"][count]
    # Every one of them signalled, once, and killed by it.
    assert set(result["ended"].values()) == {-signal.SIGKILL}
    assert sorted(int(e.metadata["pid"] or 0) for e in events) == sorted([*pids, slow])
    assert {e.metadata["action"] for e in events} == {"signalled"}
    # The slow capture delayed nobody: it is the last signal, and it had no dump.
    assert events[-1].metadata["pid"] == slow
    assert events[-1].metadata["dump"] is None
    # Each of the others was killed after its own complete dump.
    by_pid = {int(e.metadata["pid"] or 0): e for e in events}
    for i, pid in enumerate(pids):
        dump_id = by_pid[pid].metadata["dump"]
        assert isinstance(dump_id, str), f"child {i} (pid {pid}) was killed without a dump"
        assert dumps[dump_id].pid == pid
        assert dumps[dump_id].method == "faulthandler"
        text = texts[dump_id]
        # The whole main thread, from the hung frame down to the module's, marker gone.
        assert f"in hung_{i}" in text and "in <module>" in text, text
        assert "\x00" not in text


def _capture_file(tmp_path: Path, before: bytes = b"") -> tuple[int, int, Path]:
    path = tmp_path / "live.faulthandler"
    path.write_bytes(before)
    fd = os.open(path, os.O_RDONLY)
    return fd, len(before), path


def _append(path: Path, data: bytes) -> None:
    with path.open("ab") as f:
        f.write(data)


def test_a_dump_is_complete_at_its_marker_and_the_marker_is_not_kept(tmp_path: Path) -> None:
    fd, offset, path = _capture_file(tmp_path, b"an older dump\n")
    try:
        capture = _Capture(fd, offset, marker=True, now=0.0)
        assert not capture.check(0.001, quiet=1.0)  # nothing written yet
        _append(path, b'Current thread 0x1 (most recent call first):\n  File "x.py", line 1')
        assert not capture.check(0.002, quiet=1.0)  # growing, no marker: not done
        _append(path, b" in f\n" + DUMP_MARKER[:5])
        assert not capture.check(0.003, quiet=1.0)  # half a marker is no marker
        _append(path, DUMP_MARKER[5:] + b"a later dump\n")
        assert capture.check(0.004, quiet=1.0)  # long before the quiet period
        assert capture.text == (
            'Current thread 0x1 (most recent call first):\n  File "x.py", line 1 in f\n'
        )
    finally:
        os.close(fd)


def test_a_marker_with_no_dump_before_it_answers_an_earlier_signal(tmp_path: Path) -> None:
    fd, offset, path = _capture_file(tmp_path)
    try:
        capture = _Capture(fd, offset, marker=True, now=0.0)
        _append(path, DUMP_MARKER)  # the late handler of a capture that was given up
        assert not capture.check(0.001, quiet=1.0)
        _append(path, b"our dump\n" + DUMP_MARKER)
        assert capture.check(0.002, quiet=1.0)
        assert capture.text == "our dump\n"
    finally:
        os.close(fd)


def test_without_a_marker_a_dump_is_complete_once_the_file_stops_growing(
    tmp_path: Path,
) -> None:
    fd, offset, path = _capture_file(tmp_path)
    try:
        capture = _Capture(fd, offset, marker=False, now=0.0)
        assert not capture.check(5.0, quiet=0.008)  # nothing yet: waits (the caller bounds it)
        _append(path, b"dump\n" + DUMP_MARKER)  # a marker it did not announce still goes
        assert not capture.check(5.001, quiet=0.008)
        assert capture.check(5.01, quiet=0.008)
        assert capture.text == "dump\n"
    finally:
        os.close(fd)


@pytest.mark.parametrize("thread", ["main", "other"])
async def test_a_client_marks_its_dumps_when_connected_from_the_main_thread(
    short_dir: Path, thread: str
) -> None:
    async with running_daemon(short_dir, stack_dumps="faulthandler") as daemon:
        child = python(
            """
            import sys, threading, time, watchdogd_client as wd
            client = wd.SocketTimerClient(sys.argv[1])
            if sys.argv[2] == "main":
                client.sync()
            else:
                t = threading.Thread(target=client.sync)
                t.start()
                t.join()
            print("connected", flush=True)
            def hung_here():
                with wd.expires(after=0.3, scope="s", client=client):
                    time.sleep(60)
            hung_here()
            """,
            str(daemon.socket_path),
            thread,
            stdout=subprocess.PIPE,
        )
        assert child.stdout is not None
        assert await anyio.to_thread.run_sync(child.stdout.readline) == "connected\n"
        _, _, marker = daemon.reaper.faulthandlers[child.pid]
        assert marker is (thread == "main")
        assert await exit_code(child) == -signal.SIGKILL
        child.stdout.close()
        await wait_for(lambda: any(e.name == "timer_expired" for e in daemon.events.since()))
        (expired,) = [e for e in daemon.events.since() if e.name == "timer_expired"]
        dump_id = expired.metadata["dump"]
        assert isinstance(dump_id, str)
        found = await anyio.to_thread.run_sync(daemon.stacks.read, dump_id)
        assert found is not None and "in hung_here" in found[1]


async def test_a_py_spy_capture_does_not_stall_the_loop_of_a_big_daemon(short_dir: Path) -> None:
    # Forking a 400 MB process on the loop's thread (the loop's own spawn)
    # stalled it for ~35 ms; started from a thread, with vfork, ~1 ms.
    with big_heap(400):
        await _expire_with_a_py_spy_dump(short_dir)


async def _expire_with_a_py_spy_dump(short_dir: Path) -> None:
    async with running_daemon(short_dir, stack_dumps="py-spy", max_stall=0.02) as daemon:
        child = python(
            f"""
            import time, watchdogd_client as wd
            wd.configure(wd.FileTimerClient({str(daemon.fifo_path)!r}))
            with wd.expires(after=0.3):
                time.sleep(60)
            """
        )
        assert await exit_code(child) == -signal.SIGKILL
        await wait_for(lambda: any(e.name == "timer_expired" for e in daemon.events.since()))
        (expired,) = [e for e in daemon.events.since() if e.name == "timer_expired"]
        assert expired.metadata["action"] == "signalled"
