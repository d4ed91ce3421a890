"""The node's CPU topology from sysfs, and binding what a thread forks to CPUs.

:func:`read_topology` reads what :mod:`watchdogd.core.numa` decides from:
each NUMA node's ``cpulist``, each usable CPU's socket, hyperthread siblings
and highest-level cache, and each GPU's PCI ``numa_node``. A file sysfs
lacks is left out, and the core says why when a mode needs it.

:func:`bound_to` applies a binding without ``numactl`` and without a
``preexec_fn`` (which is unsafe in a process with threads): on Linux
``sched_setaffinity(0, …)`` sets the calling thread's mask, and a child
forked from that thread starts with it and keeps it across ``exec``. So the
thread that calls ``Popen`` narrows its own mask for the call and restores
it right after; other threads and the rest of the daemon are untouched.

:class:`NodeHardware` is the supervisor's ``Hardware`` port: NVML for the
GPUs and the processes holding their memory, this module for the rest;
tests hand it their own GPU list and sysfs.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from watchdogd.core.numa import Cpu, Gpu, Topology, parse_cpulist
from watchdogd.core.ports import GpuHolder
from watchdogd.linux.gpus import gpu_holders, pci_gpus

__all__ = ["NodeHardware", "bound_to", "read_topology"]

SYSFS = Path("/sys")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _int(path: Path) -> int | None:
    text = _read(path)
    return int(text) if text is not None and text.lstrip("-").isdigit() else None


def _cpulist(path: Path) -> frozenset[int] | None:
    text = _read(path)
    return parse_cpulist(text) if text is not None else None


def _largest_cache(cache_dir: Path) -> frozenset[int] | None:
    """The CPUs sharing this CPU's highest-level data or unified cache (as torch picks it)."""
    best: tuple[int, frozenset[int]] | None = None
    entries = [e for e in cache_dir.glob("index*") if e.name[5:].isdigit()]
    for entry in sorted(entries, key=lambda e: int(e.name[5:])):
        level = _int(entry / "level")
        shared = _cpulist(entry / "shared_cpu_list")
        if _read(entry / "type") not in ("Unified", "Data") or level is None or shared is None:
            continue  # instruction caches say nothing about where data lives
        if best is None or level > best[0]:
            best = (level, shared)
    return best[1] if best is not None else None


def read_topology(
    bus_ids: Sequence[str], *, sysfs: Path = SYSFS, allowed: frozenset[int] | None = None
) -> Topology:
    """What sysfs under ``sysfs`` says of the NUMA nodes, their CPUs and these GPUs.

    ``allowed`` defaults to this process's affinity (its main thread's).
    """
    if allowed is None:
        allowed = frozenset(os.sched_getaffinity(os.getpid()))
    nodes = {}
    for entry in (sysfs / "devices/system/node").glob("node*"):
        if entry.name[4:].isdigit():
            nodes[int(entry.name[4:])] = _cpulist(entry / "cpulist") or frozenset()
    cpus = {}
    for cpu in frozenset().union(*nodes.values()) & allowed:
        base = sysfs / f"devices/system/cpu/cpu{cpu}"
        cpus[cpu] = Cpu(
            package=_int(base / "topology/physical_package_id"),
            siblings=_cpulist(base / "topology/thread_siblings_list"),
            cache=_largest_cache(base / "cache"),
        )
    gpu_nodes = {bus: _int(sysfs / "bus/pci/devices" / bus / "numa_node") for bus in bus_ids}
    return Topology(nodes=nodes, cpus=cpus, gpu_nodes=gpu_nodes, allowed=allowed)


@contextmanager
def bound_to(cpus: frozenset[int] | None) -> Iterator[None]:
    """Run the block with the calling thread bound to ``cpus``: what it forks stays bound.

    None: as it is.
    """
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


class NodeHardware:
    """The ``Hardware`` port: GPUs and their processes from NVML, topology from ``sysfs``."""

    def __init__(self, *, sysfs: Path = SYSFS, gpus: Callable[[], list[Gpu]] = pci_gpus) -> None:
        self.sysfs = sysfs
        self._gpus = gpus

    def gpu_holders(self) -> tuple[list[GpuHolder], str | None]:
        return gpu_holders()

    def gpus(self) -> list[Gpu]:
        return self._gpus()

    def topology(self, bus_ids: Sequence[str]) -> Topology:
        return read_topology(bus_ids, sysfs=self.sysfs)
