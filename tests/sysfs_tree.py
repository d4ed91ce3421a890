"""Build the parts of a sysfs tree that NUMA binding reads, for machines this one is not."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from watchdogd.core.numa import Gpu, format_cpulist


class CpuSpec:
    """One logical CPU: its socket, its core's hyperthreads, the CPUs sharing its L3."""

    def __init__(self, package: int, siblings: set[int], l3: set[int]) -> None:
        self.package = package
        self.siblings = siblings
        self.l3 = l3


def build(
    root: Path,
    *,
    nodes: Mapping[int, str],
    cpus: Mapping[int, CpuSpec],
    gpu_nodes: Mapping[str, int | None],
) -> Path:
    """Write ``root`` as sysfs: node cpulists, CPU topology and caches, GPU ``numa_node``.

    A GPU whose node is None gets a PCI device directory without ``numa_node``.
    """
    (root / "devices/system/node").mkdir(parents=True)
    (root / "devices/system/node/possible").write_text(format_cpulist(nodes) + "\n")
    for node, cpulist in nodes.items():
        path = root / f"devices/system/node/node{node}"
        path.mkdir()
        (path / "cpulist").write_text(cpulist + "\n")
    for cpu, spec in cpus.items():
        base = root / f"devices/system/cpu/cpu{cpu}"
        (base / "topology").mkdir(parents=True)
        (base / "topology/physical_package_id").write_text(f"{spec.package}\n")
        (base / "topology/thread_siblings_list").write_text(format_cpulist(spec.siblings) + "\n")
        caches = [
            ("Data", 1, {cpu}),
            ("Instruction", 1, {cpu}),
            ("Unified", 2, spec.siblings),
            ("Unified", 3, spec.l3),
        ]
        for index, (kind, level, shared) in enumerate(caches):
            cache = base / f"cache/index{index}"
            cache.mkdir(parents=True)
            (cache / "type").write_text(kind + "\n")
            (cache / "level").write_text(f"{level}\n")
            (cache / "shared_cpu_list").write_text(format_cpulist(shared) + "\n")
    for bus_id, node in gpu_nodes.items():
        device = root / "bus/pci/devices" / bus_id
        device.mkdir(parents=True)
        if node is not None:
            (device / "numa_node").write_text(f"{node}\n")
    return root


def gpus(*bus_ids: str, name: str = "NVIDIA H100 80GB HBM3") -> list[Gpu]:
    """NVML's list for these bus ids (NVML numbers GPUs in PCI order)."""
    return [
        Gpu(index=i, uuid=f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}", bus_id=bus, name=name)
        for i, bus in enumerate(sorted(bus_ids))
    ]
