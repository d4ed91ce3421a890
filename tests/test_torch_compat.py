"""torch's own timer client and ``expires()`` against the daemon, unchanged."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from .conftest import exit_code, python, running_daemon, wait_for

pytest.importorskip("torch.distributed.elastic.timer")

pytestmark = pytest.mark.anyio


async def test_torch_file_timer_client_arms_and_releases(short_dir: Path) -> None:
    async with running_daemon(short_dir) as daemon:
        child = python(
            f"""
            import sys, time
            from torch.distributed.elastic.timer import FileTimerClient
            client = FileTimerClient({str(daemon.fifo_path)!r})
            client.acquire("torch-scope", time.time() + 60)
            print("armed", flush=True)
            sys.stdin.readline()
            client.release("torch-scope")
            print("released", flush=True)
            sys.stdin.readline()
            """,
            stdin=-1,
            stdout=-1,
        )
        assert child.stdin is not None and child.stdout is not None
        with child:
            try:
                await wait_for(lambda: len(daemon.table) == 1, timeout=30)
                (timer,) = daemon.table
                assert (timer.pid, timer.scope_id, timer.source) == (
                    child.pid,
                    "torch-scope",
                    "fifo",
                )
                assert timer.signal == signal.SIGKILL
                child.stdin.write("release\n")
                child.stdin.flush()
                await wait_for(lambda: len(daemon.table) == 0)
            finally:
                child.kill()


@pytest.mark.parametrize("client", ["torch FileTimerClient", "our SocketTimerClient"])
async def test_torch_expires_gets_a_hung_worker_killed(short_dir: Path, client: str) -> None:
    async with running_daemon(short_dir) as daemon:
        make_client = (
            f"FileTimerClient({str(daemon.fifo_path)!r})"
            if client.startswith("torch")
            else f"SocketTimerClient({str(daemon.socket_path)!r})"
        )
        child = python(
            f"""
            import time
            from torch.distributed.elastic import timer
            from torch.distributed.elastic.timer import FileTimerClient
            from watchdogd_client import SocketTimerClient
            timer.configure({make_client})
            with timer.expires(after=1):
                pass  # released in time: must not be killed
            with timer.expires(after=0.5):
                time.sleep(120)  # hung
            """
        )
        assert await exit_code(child, 60) == -signal.SIGKILL
        assert daemon.counts["signalled"] == 1
        assert daemon.counts["expired"] == 1
