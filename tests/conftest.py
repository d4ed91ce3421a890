"""Shared harness: a real daemon in-process, real child processes, short paths."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import pytest

from watchdogd.core.config import Config
from watchdogd.daemon import Daemon

REPO = Path(__file__).resolve().parent.parent

# The real etcd server fixtures (etcd, private_etcd) for the multi-node tests.
pytest_plugins = ["tests.etcd"]


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, Any]]:
    return "asyncio", {"use_uvloop": True}


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A fresh directory with a short path (Unix socket paths stop at 108 bytes)."""
    path = Path(tempfile.mkdtemp(prefix="wd-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def pid_namespace() -> list[str]:
    """The ``unshare`` command line for a fresh pid namespace where ns_last_pid is writable.

    Skips when pid namespaces are unavailable (no unshare(1), not root).
    """
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("unshare(1) is not installed: cannot force pid reuse")
    if os.geteuid() != 0:
        pytest.skip("forcing pid reuse needs root (a pid namespace and ns_last_pid)")
    command = [unshare, "--pid", "--fork", "--mount-proc"]
    probe = subprocess.run(
        [*command, "sh", "-c", "echo 100 > /proc/sys/kernel/ns_last_pid"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    if probe.returncode != 0:
        pytest.skip(f"cannot create a pid namespace or write ns_last_pid: {probe.stderr.strip()}")
    return command


@contextlib.contextmanager
def big_heap(mib: int) -> Iterator[None]:
    """``mib`` MiB of private memory, touched, in this process: a big daemon's.

    A fork copies the page tables of such memory (what makes forking a big
    process slow); unmapped at the end, unlike freed small objects.
    """
    with mmap.mmap(-1, mib << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS) as ballast:
        for offset in range(0, len(ballast), mmap.PAGESIZE):
            ballast[offset] = 1
        yield


# The daemon fires every deadline on the node from one loop: a test fails if
# the loop stalled longer than this while it ran (its LoopMonitor ticks fast;
# time the loop's thread only waited for a CPU on a busy machine is not a stall).
MAX_LOOP_STALL = 0.05
_TEST_LOOP_TICK = 0.005


@asynccontextmanager
async def running_daemon(
    runtime_dir: Path, *, max_stall: float | None = MAX_LOOP_STALL, **settings: Any
) -> AsyncIterator[Daemon]:
    """Run a daemon in this event loop until the block ends (stopped by an event).

    Fails the test if the loop stalled for more than ``max_stall`` seconds
    meanwhile (None: the test blocks the loop on purpose).
    """
    daemon = Daemon(Config(runtime_dir=str(runtime_dir), **settings), loop_tick=_TEST_LOOP_TICK)
    stop = anyio.Event()
    try:
        async with anyio.create_task_group() as tg:
            await tg.start(partial(daemon.serve, shutdown_trigger=stop.wait))
            try:
                yield daemon
            finally:
                stop.set()
    except BaseExceptionGroup as group:
        raise _sole_exception(group) from None
    stall = daemon.loop_monitor.max_stall
    if max_stall is not None:
        assert stall <= max_stall, f"the event loop stalled for {stall * 1000:.0f} ms"


def _sole_exception(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one exception a task group wrapped (so tests can ``pytest.raises`` it)."""
    if len(group.exceptions) != 1:
        return group
    inner = group.exceptions[0]
    return _sole_exception(inner) if isinstance(inner, BaseExceptionGroup) else inner


def python(
    code: str, *args: str, env: dict[str, str] | None = None, **popen: Any
) -> subprocess.Popen[str]:
    """Start ``python -c code args…`` as a child process."""
    full_env = {**os.environ, **(env or {})}
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        env=full_env,
        text=True,
        **popen,
    )


def fifo_write(path: Path, data: bytes) -> None:
    """Write ``data`` to the FIFO at ``path`` in one ``write``, as a client would."""
    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def fifo_line(pid: int, scope: str, expiration: float, sig: int = 9, version: int = 1) -> bytes:
    """One request in torch's FIFO wire format."""
    request = {"version": version, "pid": pid, "scope_id": scope, "expiration_time": expiration}
    return json.dumps({**request, "signal": sig}).encode() + b"\n"


async def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait (without blocking the loop) until ``predicate()`` holds."""
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.01)


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not met in time")
        time.sleep(0.01)


async def exit_code(proc: subprocess.Popen[str], timeout: float = 15.0) -> int:
    return await anyio.to_thread.run_sync(partial(proc.wait, timeout))


def run_log_dir(log_dir: Path) -> Path:
    """The one run's directory ``watchdogd run --log-dir LOG_DIR`` made in it, as torchrun
    makes one: ``<run id>_<random>``."""
    (made,) = log_dir.iterdir()
    return made


def kept_dumps(stderr: str) -> Path:
    """Where ``watchdogd run`` says it kept the stack dumps of hung workers (its
    private run directory's ``dumps``: remove that directory once read)."""
    said = "watchdogd run: stacks of hung workers in "
    (line,) = [line for line in stderr.splitlines() if line.startswith(said)]
    return Path(line.removeprefix(said))


def watchdogd_run(
    *args: str, env: dict[str, str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``watchdogd run ARGS`` to its end, its output captured."""
    return subprocess.run(
        ["watchdogd", "run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


def children(pid: int) -> list[int]:
    """The children of process ``pid``, from every one of its threads, but the daemon's
    own helpers: its containment keeper (``watchdogd/linux/keeper.py``) and its torch
    helper (``watchdogd.groups.torch_helper``), which are not the job's."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(child) for child in (task / "children").read_text().split()]
    return [child for child in found if not _is_own_helper(child)]


def _is_own_helper(pid: int) -> bool:
    try:
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"keeper.py" in command or b"watchdogd.groups.torch_helper" in command


def kill_nodes(started: list[subprocess.Popen[str]]) -> None:
    """Kill the launchers a test left running (it failed midway, or cut a node off),
    and their workers with them."""
    while started:
        with started.pop() as proc:
            workers = children(proc.pid) if proc.poll() is None else []
            proc.kill()
            for pid in workers:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
