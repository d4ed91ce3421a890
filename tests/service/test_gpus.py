"""GPUs: status without NVML says why; a GPU fault makes only the groups on it UNHEALTHY."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import anyio
import pytest

import watchdogd_client as wd
from watchdogd.linux.gpus import read_gpus
from watchdogd_client.groups import GroupSpec, GroupState

from ..conftest import running_daemon, wait_for

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


def test_gpu_listing_maps_processes_to_group_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    # NVML needs a driver and a GPU: stand in for the library (not the OS) to check the mapping.
    fake = types.ModuleType("pynvml")
    process = types.SimpleNamespace(pid=4242, usedGpuMemory=3 << 30)
    stranger = types.SimpleNamespace(pid=99, usedGpuMemory=None)

    class NVMLError(Exception):
        pass

    fake.NVMLError = NVMLError  # type: ignore[attr-defined]
    fake.NVML_TEMPERATURE_GPU = 0  # type: ignore[attr-defined]
    fake.nvmlInit = lambda: None  # type: ignore[attr-defined]
    fake.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    fake.nvmlDeviceGetCount = lambda: 1  # type: ignore[attr-defined]
    fake.nvmlDeviceGetHandleByIndex = lambda i: i  # type: ignore[attr-defined]
    fake.nvmlDeviceGetName = lambda h: b"NVIDIA H200"  # type: ignore[attr-defined]
    fake.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(  # type: ignore[attr-defined]
        used=10 << 30, total=141 << 30
    )
    fake.nvmlDeviceGetTemperature = lambda h, kind: 41  # type: ignore[attr-defined]
    fake.nvmlDeviceGetComputeRunningProcesses = lambda h: [process, stranger]  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    (gpu,), note = read_gpus({4242: ("llama", 3)})
    assert note is None
    assert (gpu.name, gpu.memory_used_mib, gpu.memory_total_mib) == ("NVIDIA H200", 10240, 144384)
    assert [(p.pid, p.used_mib, p.group, p.rank) for p in gpu.processes] == [
        (4242, 3072, "llama", 3),
        (99, None, None, None),
    ]
