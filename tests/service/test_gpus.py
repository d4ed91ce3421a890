"""GPUs in status and GPU faults.

Status without NVML says why, and never waits for NVML (a cache read in a
worker thread); a GPU fault makes only the groups on that GPU UNHEALTHY.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import anyio
import anyio.to_thread
import pytest

import watchdogd_client as wd
from watchdogd.linux.gpus import read_gpus
from watchdogd.service.gpu_status import GpuStatus
from watchdogd_client import protocol as p
from watchdogd_client.groups import GroupSpec, GroupState
from watchdogd_client.protocol import GpuInfo

from ..conftest import running_daemon, wait_for
from ..hostile import nobody_dialer, sleepers
from ..wire import HELLO, encode, raw_connect, receive

SLEEP = [sys.executable, "-c", "import time; time.sleep(600)"]


@pytest.mark.anyio
async def test_status_without_nvml_says_why(short_dir: Path) -> None:
    async with running_daemon(short_dir) as daemon:
        status = await anyio.to_thread.run_sync(wd.status, str(daemon.socket_path))
    assert status.gpus == []
    assert status.gpu_note is not None
    assert "nvidia-ml-py" in status.gpu_note or "NVML" in status.gpu_note


@pytest.mark.anyio
async def test_gpu_fault_makes_the_groups_on_that_gpu_unhealthy(short_dir: Path) -> None:
    on_01 = GroupSpec(name="on01", entrypoint=SLEEP, nproc=2, gpus=[0, 1], max_restarts=3)
    on_2 = GroupSpec(name="on2", entrypoint=SLEEP, nproc=1, gpus=[2], max_restarts=3)
    async with running_daemon(short_dir, groups=[on_01, on_2]) as daemon:
        first = daemon.supervisor.get("on01")
        second = daemon.supervisor.get("on2")
        await wait_for(lambda: len(first.workers) == 2 and len(second.workers) == 1)
        daemon.supervisor.gpu_fault(1, "XID 79")
        await wait_for(lambda: first.finished.is_set())
        assert first.state is GroupState.UNHEALTHY
        assert first.machine.restarts_left == 3  # no restart on a broken GPU
        assert second.state is GroupState.HEALTHY
        names = [e.name for e in daemon.events.since()]
        assert "gpu_fault" in names


class NVMLError(Exception):
    pass


def fake_pynvml(
    processes: list[list[SimpleNamespace]], init: Callable[[], None] = lambda: None
) -> types.ModuleType:
    """NVML needs a driver and a GPU: a stand-in for the library (not the OS).

    One H200 per entry of ``processes``, running those processes.
    """
    fake = types.ModuleType("pynvml")
    fake.__dict__.update(
        NVMLError=NVMLError,
        NVML_TEMPERATURE_GPU=0,
        nvmlInit=init,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: len(processes),
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetName=lambda handle: b"NVIDIA H200",
        nvmlDeviceGetMemoryInfo=lambda handle: SimpleNamespace(used=10 << 30, total=141 << 30),
        nvmlDeviceGetTemperature=lambda handle, kind: 41,
        nvmlDeviceGetComputeRunningProcesses=lambda handle: processes[handle],
    )
    return fake


def test_gpu_listing_maps_processes_to_group_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    process = SimpleNamespace(pid=4242, usedGpuMemory=3 << 30)
    stranger = SimpleNamespace(pid=99, usedGpuMemory=None)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml([[process, stranger]]))
    (gpu,), note = read_gpus({4242: ("llama", 3)})
    assert note is None
    assert (gpu.name, gpu.memory_used_mib, gpu.memory_total_mib) == ("NVIDIA H200", 10240, 144384)
    assert [(p.pid, p.used_mib, p.group, p.rank) for p in gpu.processes] == [
        (4242, 3072, "llama", 3),
        (99, None, None, None),
    ]


# -- the cache in front of NVML ----------------------------------------------------

READING = "GPU information is being read (NVML); ask again"
GPU = GpuInfo(
    index=0, name="H200", memory_used_mib=1, memory_total_mib=2, temperature_c=40, processes=[]
)


def no_workers() -> dict[int, tuple[str, int]]:
    return {}


class HeldReader:
    """A GPU reader that answers only once let go, like NVML initialising or a sick GPU."""

    def __init__(self) -> None:
        self.calls = 0
        self.go = threading.Event()

    def __call__(self, workers: dict[int, tuple[str, int]]) -> tuple[list[GpuInfo], str | None]:
        self.calls += 1
        self.go.wait(30)
        return [GPU], None


@pytest.mark.anyio
async def test_gpu_status_answers_at_once_and_reads_in_the_background() -> None:
    reader = HeldReader()
    status = GpuStatus(reader, max_age=60)
    try:
        async with anyio.create_task_group() as tg:
            status.attach(tg)
            assert status.current(no_workers) == ([], READING)  # while the reader is held
            await wait_for(lambda: reader.calls == 1)
            assert status.current(no_workers) == ([], READING)
            reader.go.set()
            await wait_for(lambda: status.current(no_workers) == ([GPU], None))
            assert reader.calls == 1  # fresh for max_age: no second reading
    finally:
        reader.go.set()


@pytest.mark.anyio
async def test_a_hung_reader_is_given_up_and_no_second_one_starts_while_it_hangs() -> None:
    reader = HeldReader()
    status = GpuStatus(reader, max_age=0, timeout=0.1)

    def asked() -> tuple[list[GpuInfo], str | None]:
        return status.current(no_workers)

    try:
        async with anyio.create_task_group() as tg:
            status.attach(tg)
            assert asked() == ([], READING)
            await wait_for(lambda: asked() == ([], "NVML did not answer within 0.1 s"))
            for _ in range(10):  # each reading is stale at once (max_age 0)
                asked()
                await anyio.sleep(0.02)
            assert reader.calls == 1
            reader.go.set()  # the hung thread finishes: the next ask may start another
            await wait_for(lambda: asked() == ([GPU], None))
            assert reader.calls == 2
    finally:
        reader.go.set()


# -- NVML never on the loop ----------------------------------------------------------

VICTIMS = 20
MAX_LATE_MS = 50.0
MAX_STATUS_S = 0.05


@contextmanager
def non_admin(socket_path: Path) -> Iterator[Callable[[], socket.socket]]:
    """Connections from a peer that is neither root nor in the admin group."""
    if os.geteuid() == 0:
        with nobody_dialer(socket_path) as dialer:
            yield dialer.connect
    else:
        yield lambda: raw_connect(socket_path)


def poll_status(
    connect: Callable[[], socket.socket],
    stop: threading.Event,
    answers: list[tuple[float, p.StatusInfo]],
) -> None:
    """Ask for the status on one connection, again and again, until ``stop``."""
    with connect() as conn:
        conn.settimeout(10)
        conn.sendall(HELLO)
        assert isinstance(receive(conn), p.Welcome)
        request = encode(p.GetStatus())
        while not stop.is_set():
            asked = time.monotonic()
            conn.sendall(request)
            reply = receive(conn)
            assert isinstance(reply, p.StatusInfo), reply
            answers.append((time.monotonic() - asked, reply))
            time.sleep(0.01)


def arm(socket_path: Path, deadlines: list[tuple[int, float]]) -> None:
    with wd.SocketTimerClient(socket_path, stack_signal=None) as client:
        for pid, deadline in deadlines:
            client.acquire_for(pid, "hung", deadline, signal.SIGKILL)
        client.sync()


@pytest.mark.anyio
async def test_kills_stay_on_time_while_a_non_admin_polls_status_against_a_slow_nvml(
    short_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    inits: list[float] = []

    def slow_init() -> None:  # GPUs without persistence mode: NVML takes a second to start
        inits.append(time.monotonic())
        time.sleep(1.0)

    on_gpus = [
        [SimpleNamespace(pid=4242, usedGpuMemory=1 << 30)],
        [SimpleNamespace(pid=4243, usedGpuMemory=None)],
    ]
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(on_gpus, init=slow_init))
    os.chmod(short_dir, 0o755)  # the non-admin peer must reach the socket
    answers: list[tuple[float, p.StatusInfo]] = []
    stop = threading.Event()
    # Both started before the daemon: a fork from its loop would stall it.
    with (
        sleepers(*[None] * VICTIMS) as victims,
        non_admin(short_dir / "watchdogd.sock") as connect,
    ):
        async with running_daemon(short_dir, socket_mode=0o666, stack_dumps="off") as daemon:
            daemon.gpus.max_age = 0.0  # a new reading as soon as the last is in: NVML always busy
            async with anyio.create_task_group() as tg:
                tg.start_soon(anyio.to_thread.run_sync, poll_status, connect, stop, answers)
                try:
                    await wait_for(lambda: bool(answers))
                    first = time.time() + 0.3
                    deadlines = [(v.pid, first + i * 0.05) for i, v in enumerate(victims)]
                    await anyio.to_thread.run_sync(arm, daemon.socket_path, deadlines)
                    for victim in victims:
                        assert await anyio.to_thread.run_sync(victim.wait, 10) == -signal.SIGKILL
                    await wait_for(lambda: any(reply.gpus for _, reply in answers))
                finally:
                    stop.set()
            admin_view = await anyio.to_thread.run_sync(wd.status, str(daemon.socket_path))
            kills = [e.metadata for e in daemon.events.since() if e.name == "timer_expired"]
    # running_daemon checked too that the loop never stalled for over 50 ms.
    assert len(kills) == VICTIMS and all(kill["action"] == "signalled" for kill in kills)
    late = [float(kill["late_ms"] or 0) for kill in kills]
    assert max(late) < MAX_LATE_MS, late
    took = [seconds for seconds, _ in answers]
    assert max(took) < MAX_STATUS_S, max(took)
    assert len(inits) >= 2  # NVML was being read, back to back, while the timers expired
    assert (answers[0][1].gpus, answers[0][1].gpu_note) == ([], READING)
    seen = next(reply for _, reply in answers if reply.gpus)
    # Non-admins see the GPUs, not who runs on them; root sees everything.
    assert [(gpu.index, gpu.processes) for gpu in seen.gpus] == [(0, []), (1, [])]
    if os.geteuid() == 0:
        assert [[proc.pid for proc in gpu.processes] for gpu in admin_view.gpus] == [[4242], [4243]]
