"""One owner per pidfd: a pinned process and a started child close once, on every path."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import anyio
import pytest

from watchdogd.groups.child import ChildProcess
from watchdogd.linux import aio
from watchdogd_client._proc import PinnedProcess


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True
    )


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_a_pinned_process_closes_once_and_is_then_gone_for_good() -> None:
    popen = sleeper()
    try:
        pinned = PinnedProcess(popen.pid)
        fd = pinned.pidfd
        assert not pinned.exited()
        pinned.close()
        pinned.close()  # again: nothing to do, and no other descriptor closed by mistake
        assert pinned.pidfd == -1 and not is_open(fd)
        assert pinned.exited()  # closed: nothing is sent to a number that may be reused
        with pytest.raises(ProcessLookupError):
            pinned.send_signal(signal.SIGKILL)
        assert popen.poll() is None  # and nothing was sent
    finally:
        popen.kill()
        popen.wait()


@pytest.mark.anyio
async def test_a_child_is_reaped_through_its_pidfd_and_signals_after_its_exit_go_nowhere() -> None:
    child = ChildProcess(sleeper())
    exited = anyio.Event()
    child.watch(exited.set)
    child.send_signal(signal.SIGTERM)
    with anyio.fail_after(10):
        await exited.wait()
    assert child.wait() == -signal.SIGTERM
    assert child.pidfd == -1
    child.send_signal(signal.SIGKILL)  # reaped: its pid may be someone else's, so no signal
    child.close()


@pytest.mark.anyio
async def test_a_child_closes_its_pidfd_even_when_the_loop_refuses_the_unwatch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    child = ChildProcess(sleeper())
    try:
        child.watch(lambda: None)
        fd = child.pidfd
        aio.unwatch(fd)  # the loop must not poll a closed descriptor (uvloop aborts)

        def refuse(fd: int) -> None:
            raise RuntimeError("no running event loop")

        monkeypatch.setattr(aio, "unwatch", refuse)
        with pytest.raises(RuntimeError):
            child.close()
        assert child.pidfd == -1 and not is_open(fd)
        child.close()  # and again, quietly
    finally:
        child.kill_group()
        child.process.wait()
