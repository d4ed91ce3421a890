"""torch's own timer client and ``expires()`` against the daemon, unchanged."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

import watchdogd_client as wd
from watchdogd.linux.procs import read_stat
from watchdogd_client.protocol import EndpointOwner

from ..conftest import exit_code, python, running_daemon, wait_for

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
                await wait_for(lambda: len(daemon.timers.table) == 1, timeout=30)
                (timer,) = daemon.timers.table
                assert (timer.pid, timer.scope_id, timer.source) == (
                    child.pid,
                    "torch-scope",
                    "fifo",
                )
                assert timer.signal == signal.SIGKILL
                child.stdin.write("release\n")
                child.stdin.flush()
                await wait_for(lambda: len(daemon.timers.table) == 0)
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
        assert daemon.stats.signalled == 1
        assert daemon.stats.expired == 1


def fifo_descriptors(pid: int, fifo: Path) -> int:
    """How many descriptors process ``pid`` holds on the FIFO at ``fifo``."""
    target = fifo.stat()
    count = 0
    for entry in Path(f"/proc/{pid}/fd").iterdir():
        try:
            info = entry.stat()
        except FileNotFoundError:
            continue
        count += (info.st_dev, info.st_ino) == (target.st_dev, target.st_ino)
    return count


async def test_our_fifo_client_under_torchs_server_gets_a_hung_child_killed(
    short_dir: Path,
) -> None:
    # torch's server checks deadlines only between lines of a blocking
    # readline(): a client that stays open would stall it for everyone.
    fifo = short_dir / "torch.fifo"
    server = python(
        f"""
        import time
        from torch.distributed.elastic.timer import FileTimerServer
        FileTimerServer({str(fifo)!r}, "run", max_interval=0.01).start()
        print("started", flush=True)
        time.sleep(120)  # torch's server signals its own process after a reap
        """,
        stdout=-1,
    )
    with server:
        assert server.stdout is not None
        assert server.stdout.readline() == "started\n"
        child = python(
            f"""
            import time, watchdogd_client as wd
            client = wd.FileTimerClient({str(fifo)!r})
            wd.configure(client)
            deadline = time.monotonic() + 30
            while True:  # torch's reader thread may not have opened the FIFO yet
                try:
                    with wd.expires(after=5):
                        pass  # released in time: must not be killed
                    break
                except wd.DaemonUnavailableError:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
            with wd.expires(after=0.3):
                time.sleep(20)
            print("NOT KILLED", flush=True)
            """,
            stdout=-1,
        )
        with child:
            assert await exit_code(child, 60) == -signal.SIGKILL
            assert child.stdout is not None and child.stdout.read() == ""
        server.kill()


async def test_fifo_client_holds_watchdogds_fifo_open_and_no_other(short_dir: Path) -> None:
    async with running_daemon(short_dir) as daemon:
        ours = wd.FileTimerClient(daemon.fifo_path)
        ours.acquire("held", time.time() + 60)
        assert fifo_descriptors(os.getpid(), daemon.fifo_path) == 2  # the daemon's and ours
        ours.release("held")
        ours.close()
    foreign = short_dir / "foreign.fifo"
    os.mkfifo(foreign)
    reader = os.open(foreign, os.O_RDONLY | os.O_NONBLOCK)
    lock = short_dir / "foreign.fifo.lock"
    me = os.getpid()
    info = foreign.stat()
    start_time = read_stat(me).start_time
    impostors = {
        "no lock file": None,
        "a dead daemon": EndpointOwner(me, start_time + 1, info.st_dev, info.st_ino),
        "another inode": EndpointOwner(me, start_time, info.st_dev, info.st_ino + 1),
        "a lock owned by someone else": EndpointOwner(me, start_time, info.st_dev, info.st_ino),
    }
    try:
        for case, owner in impostors.items():
            lock.unlink(missing_ok=True)
            if owner is not None:
                lock.write_bytes(msgspec.json.encode(owner))
            if case == "a lock owned by someone else":
                os.chown(lock, 65534, 65534)
            client = wd.FileTimerClient(foreign)
            client.acquire(case, time.time() + 60)
            assert fifo_descriptors(me, foreign) == 1, case  # only the reader
            assert msgspec.json.decode(os.read(reader, 4096))["scope_id"] == case
        # The same record, owned right and naming this live process: held.
        os.chown(lock, os.getuid(), os.getgid())
        client = wd.FileTimerClient(foreign)
        client.acquire("trusted", time.time() + 60)
        assert fifo_descriptors(me, foreign) == 2
        client.close()
    finally:
        os.close(reader)


def test_torchruns_file_timer_kills_a_rank_hung_in_our_expires(tmp_path: Path) -> None:
    script = tmp_path / "hang.py"
    script.write_text(
        "import time, watchdogd_client as wd\n"
        "with wd.expires(after=1):\n"
        "    time.sleep(8)\n"
        "print('NOT KILLED', flush=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WATCHDOGD_", "TORCHELASTIC"))}
    env["TORCHELASTIC_ENABLE_FILE_TIMER"] = "1"
    started = time.monotonic()
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "1",
            "--max-restarts",
            "0",
            str(script),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    took = time.monotonic() - started
    assert "NOT KILLED" not in run.stdout
    # torchrun's server SIGKILLs its own agent after the reap: it dies too (137).
    assert run.returncode != 0
    assert took < 8, run.stderr[-2000:]
