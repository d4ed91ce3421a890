"""GPU memory given back before a restart: the next attempt waits for the last one's.

This machine has no GPU: a stand-in of the ``Hardware`` port plays NVML's
per-process lists (its other calls are never made here). Attempt 0's worker
writes its pid and exits 1; the stand-in says that pid still holds memory on
GPU 0 for a while (a CUDA context the driver has not torn down yet), and
says all along that another process, not of the group, holds memory on GPU 1.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pytest

from watchdogd.core.numa import Gpu, Topology
from watchdogd.core.ports import GpuHolder
from watchdogd.groups.gpu_release import belongs_to_attempt
from watchdogd.linux.gpus import gpu_holders
from watchdogd.linux.numa import NodeHardware
from watchdogd_client.groups import GroupSpec, GroupState

from ..conftest import running_daemon, wait_for

WORKER = """
import os, pathlib, sys, time
out = pathlib.Path(sys.argv[1])
attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
(out / f"start-{attempt}").write_text(repr(time.monotonic()))
if attempt == "0":
    (out / "pid").write_text(str(os.getpid()))
    sys.exit(1)
"""


class HeldGpus:
    """NVML as the test tells it: attempt 0's worker holds 512 MiB on GPU 0 until
    ``release_after`` seconds after it was first asked (None: for ever)."""

    def __init__(self, out: Path, release_after: float | None) -> None:
        self.out = out
        self.release_after = release_after
        self.first_asked: float | None = None
        self.released_at: float | None = None

    def gpu_holders(self) -> tuple[list[GpuHolder], str | None]:
        now = time.monotonic()
        if self.first_asked is None:
            self.first_asked = now
        stranger = GpuHolder(1, os.getpid(), 4096)  # not the group's: never waited for
        worker = GpuHolder(0, int((self.out / "pid").read_text()), 512)
        if self.release_after is not None and now - self.first_asked >= self.release_after:
            self.released_at = self.released_at or now
            return [stranger], None
        return [worker, stranger], None

    def gpus(self) -> list[Gpu]:
        raise AssertionError("no NUMA binding here")

    def topology(self, bus_ids: Sequence[str]) -> Topology:
        raise AssertionError("no NUMA binding here")


def spec(out: Path, gpu_release_timeout: float = 30.0, name: str = "g") -> GroupSpec:
    entrypoint = [sys.executable, "-c", WORKER, str(out)]
    return GroupSpec(
        name=name,
        entrypoint=entrypoint,
        max_restarts=1,
        gpu_release_timeout=gpu_release_timeout,
    )


@pytest.mark.anyio
async def test_memory_held_by_the_last_attempt_delays_the_next_until_released(
    short_dir: Path, tmp_path: Path
) -> None:
    gpus = HeldGpus(tmp_path, release_after=1.5)
    async with running_daemon(short_dir) as daemon:
        daemon.supervisor.hardware = gpus
        runner = daemon.supervisor.submit(spec(tmp_path))
        await wait_for(lambda: runner.finished.is_set(), timeout=30)
    assert runner.state is GroupState.SUCCEEDED, runner.failures.last
    assert gpus.first_asked is not None and gpus.released_at is not None
    restarted = float((tmp_path / "start-1").read_text())
    assert restarted >= gpus.released_at >= gpus.first_asked + 1.5
    (released,) = [e for e in daemon.events.since() if e.name == "gpu_memory_released"]
    assert released.metadata["group"] == "g"
    assert 1.5 <= released.metadata["waited_s"] < 5  # type: ignore[operator]
    assert not [e for e in daemon.events.since() if e.name == "gpu_memory_held"]


@pytest.mark.anyio
async def test_a_holder_that_never_lets_go_is_named_and_the_restart_goes_on_after_the_bound(
    short_dir: Path, tmp_path: Path
) -> None:
    gpus = HeldGpus(tmp_path, release_after=None)
    async with running_daemon(short_dir) as daemon:
        daemon.supervisor.hardware = gpus
        runner = daemon.supervisor.submit(spec(tmp_path, gpu_release_timeout=1.0))
        await wait_for(lambda: runner.finished.is_set(), timeout=30)
    assert runner.state is GroupState.SUCCEEDED, runner.failures.last
    assert gpus.first_asked is not None
    assert float((tmp_path / "start-1").read_text()) >= gpus.first_asked + 1.0
    pid = int((tmp_path / "pid").read_text())
    (held,) = [e for e in daemon.events.since() if e.name == "gpu_memory_held"]
    assert held.metadata["pid"] == pid
    assert held.metadata["used_mib"] == 512
    assert held.metadata["held"] == f"pid {pid} on GPU 0: 512 MiB"  # not the stranger's
    assert 1.0 <= held.metadata["waited_s"] < 3  # type: ignore[operator]


@pytest.mark.anyio
async def test_no_wait_when_turned_off_or_without_nvml(short_dir: Path, tmp_path: Path) -> None:
    gpus = HeldGpus(tmp_path, release_after=None)
    async with running_daemon(short_dir) as daemon:
        daemon.supervisor.hardware = gpus
        runner = daemon.supervisor.submit(spec(tmp_path, gpu_release_timeout=0))
        await wait_for(lambda: runner.finished.is_set(), timeout=30)
        assert runner.state is GroupState.SUCCEEDED, runner.failures.last
        assert gpus.first_asked is None  # never asked
        # The real port on this machine, which has no NVML: asked, no wait, no event.
        daemon.supervisor.hardware = NodeHardware()
        runner = daemon.supervisor.submit(spec(tmp_path, name="real"))
        await wait_for(lambda: runner.finished.is_set(), timeout=30)
    assert runner.state is GroupState.SUCCEEDED, runner.failures.last
    names = {e.name for e in daemon.events.since()}
    assert not names & {"gpu_memory_held", "gpu_memory_released"}
    assert gpu_holders()[1] is not None  # this machine's NVML says why it cannot answer


def test_a_child_in_a_workers_session_is_the_attempts_and_a_stranger_is_not() -> None:
    # A worker leads a session of its own; a child that did not leave it is its attempt's.
    leader = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; "
         "p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    with leader:
        try:
            assert leader.stdout is not None
            child = int(leader.stdout.readline())
            assert belongs_to_attempt(GpuHolder(0, child, 1), {leader.pid})
            assert belongs_to_attempt(GpuHolder(0, leader.pid, 1), {leader.pid})
            assert not belongs_to_attempt(GpuHolder(0, os.getpid(), 1), {leader.pid})
        finally:
            os.killpg(leader.pid, signal.SIGKILL)
