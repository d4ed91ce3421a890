"""The node's GPUs through NVML (the optional ``nvidia-ml-py`` extra).

``read_gpus`` lists each GPU with its memory, temperature and the processes
on it, mapped to the worker groups and ranks this daemon supervises. Without
NVML (no package, no driver, no GPU) it says why instead, and nothing else
in the daemon notices.

``pci_gpus`` lists the GPUs with their PCI bus ids, for NUMA binding, and
``gpu_holders`` the processes holding memory on them (NVML's per-process
lists), for the wait before a group's next attempt.

``XidWatcher`` waits, in a thread of its own, for NVML's critical events —
XID errors and double-bit ECC errors — and reports each to the event loop,
where the groups on that GPU can be marked UNHEALTHY.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from watchdogd.core.numa import Gpu, NumaError, sysfs_bus_id
from watchdogd.core.ports import GpuHolder
from watchdogd_client.protocol import GpuInfo, GpuProcess

__all__ = ["XidWatcher", "gpu_holders", "pci_gpus", "read_gpus"]

_MIB = 1 << 20


def _nvml() -> tuple[Any, str | None]:
    """The initialised ``pynvml`` module, or None and the reason it is unusable."""
    try:
        import pynvml  # the optional extra: imported only when GPUs are asked about
    except ImportError:
        return None, "nvidia-ml-py is not installed (pip install 'watchdogd[gpu]')"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        return None, f"NVML unavailable: {e}"
    return pynvml, None


def read_gpus(workers: dict[int, tuple[str, int]]) -> tuple[list[GpuInfo], str | None]:
    """Every GPU, its processes labelled with ``workers[pid] = (group, rank)``; or why not."""
    nvml, reason = _nvml()
    if nvml is None:
        return [], reason
    try:
        gpus = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            memory = nvml.nvmlDeviceGetMemoryInfo(handle)
            processes = []
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                group, rank = workers.get(proc.pid, (None, None))
                used = proc.usedGpuMemory
                processes.append(
                    GpuProcess(
                        pid=proc.pid,
                        used_mib=used // _MIB if isinstance(used, int) else None,
                        group=group,
                        rank=rank,
                    )
                )
            gpus.append(
                GpuInfo(
                    index=index,
                    name=_text(nvml.nvmlDeviceGetName(handle)),
                    memory_used_mib=memory.used // _MIB,
                    memory_total_mib=memory.total // _MIB,
                    temperature_c=nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
                    processes=processes,
                )
            )
        return gpus, None
    except nvml.NVMLError as e:
        return [], f"NVML query failed: {e}"
    finally:
        nvml.nvmlShutdown()


def gpu_holders() -> tuple[list[GpuHolder], str | None]:
    """Every process with memory on a GPU, by NVML index; or why that is unknown."""
    gpus, reason = read_gpus({})
    holders = [GpuHolder(gpu.index, p.pid, p.used_mib) for gpu in gpus for p in gpu.processes]
    return holders, reason


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def pci_gpus() -> list[Gpu]:
    """Every GPU in NVML's order (PCI bus order) with its bus id; NumaError when NVML can't say."""
    nvml, reason = _nvml()
    if nvml is None:
        raise NumaError(f"no GPU list: {reason}")
    try:
        gpus = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            gpus.append(
                Gpu(
                    index=index,
                    uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                    bus_id=sysfs_bus_id(_text(nvml.nvmlDeviceGetPciInfo(handle).busId)),
                    name=_text(nvml.nvmlDeviceGetName(handle)),
                )
            )
        return gpus
    except nvml.NVMLError as e:
        raise NumaError(f"NVML query failed: {e}") from None
    finally:
        nvml.nvmlShutdown()


class XidWatcher:
    """Reports NVML critical events as ``on_fault(gpu_index, description)``, from a thread."""

    def __init__(self, on_fault: Callable[[int, str], None]) -> None:
        self.on_fault = on_fault
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="watchdogd-xid", daemon=True)
        self.unavailable: str | None = None

    def start(self) -> bool:
        nvml, reason = _nvml()
        if nvml is None:
            self.unavailable = reason
            return False
        self._nvml = nvml
        self._thread.start()
        return True

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _watch(self) -> None:
        nvml = self._nvml
        kinds = nvml.nvmlEventTypeXidCriticalError | nvml.nvmlEventTypeDoubleBitEccError
        events = nvml.nvmlEventSetCreate()
        try:
            for index in range(nvml.nvmlDeviceGetCount()):
                handle = nvml.nvmlDeviceGetHandleByIndex(index)
                try:
                    nvml.nvmlDeviceRegisterEvents(handle, kinds, events)
                except nvml.NVMLError as e:
                    self.on_fault(-1, f"GPU {index}: cannot watch for XID errors: {e}")
            while not self._stop.is_set():
                try:
                    data = nvml.nvmlEventSetWait_v2(events, 1000)
                except nvml.NVMLError_Timeout:
                    continue
                index = nvml.nvmlDeviceGetIndex(data.device)
                if data.eventType == nvml.nvmlEventTypeXidCriticalError:
                    self.on_fault(index, f"XID {data.eventData}")
                else:
                    self.on_fault(index, "double-bit ECC error")
        finally:
            nvml.nvmlEventSetFree(events)
            nvml.nvmlShutdown()
