"""NUMA binding: the CPUs each worker may run on, near its GPU. Pure.

Rules (torch's, ``torch/numa/binding.py`` at 2.13)
--------------------------------------------------
- Local rank *i* binds near GPU *i* of the group's devices, in CUDA's order
  under ``CUDA_VISIBLE_DEVICES`` (with ``virtual_local_rank``, the one device
  that worker sees is that same GPU). A rank without a GPU is an error.
- A GPU's NUMA node is its PCI device's ``numa_node``; ``-1`` (what a
  machine with a single node often says) counts as node 0.
- Only CPUs the launcher itself may use (its own affinity) are handed out.
- ``node``: every CPU of the GPU's node.
- ``socket``: every CPU of every node on the GPU's socket; a node's socket
  is the ``physical_package_id`` of its lowest CPU. Nodes without a usable
  CPU (memory-only nodes) belong to no socket (torch fails on them).
- ``exclusive``: the node's physical cores (a core's hyperthreads kept
  together), lowest first, split evenly between the GPUs on that node; when
  the split is uneven the lowest GPUs get one core more. Fewer cores than
  GPUs is an error.
- ``core-complex``: one group of CPUs that share the node's highest-level
  cache (L3) per GPU, the largest groups first, round robin when the node
  has more GPUs than groups.
- An empty set is an error: a binding that was asked for is applied, or the
  launch fails naming the rank and the reason.

Which GPU is CUDA's device *i*
------------------------------
NVML numbers GPUs in PCI bus order. CUDA does so too under
``CUDA_DEVICE_ORDER=PCI_BUS_ID``; its default, ``FASTEST_FIRST``, puts the
fastest devices first, which on a node of one GPU model is PCI order again.
A node of mixed models under ``FASTEST_FIRST`` cannot be ordered without
CUDA itself, so an integer ``CUDA_VISIBLE_DEVICES`` there is an error that
says to set ``PCI_BUS_ID`` (UUIDs need no order). Entries are indices in
that order or UUIDs (``GPU-…``, a unique prefix will do); as in CUDA, the
list ends at the first entry that names no device, or names one twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Literal, get_args

import msgspec

__all__ = [
    "AFFINITY_MODES",
    "AffinityMode",
    "Cpu",
    "Gpu",
    "NumaError",
    "Topology",
    "bind",
    "cuda_devices",
    "format_cpulist",
    "parse_cpulist",
    "sysfs_bus_id",
]

AffinityMode = Literal["node", "socket", "exclusive", "core-complex"]
AFFINITY_MODES: tuple[AffinityMode, ...] = get_args(AffinityMode)


class NumaError(Exception):
    """A binding that cannot be applied; the message says for which rank and why."""


class Gpu(msgspec.Struct, frozen=True):
    """A GPU as NVML lists it."""

    index: int
    """NVML's index: PCI bus order."""
    uuid: str
    bus_id: str
    """The PCI address as sysfs spells it: ``0000:17:00.0``."""
    name: str


class Cpu(msgspec.Struct, frozen=True, kw_only=True):
    """What sysfs says of one logical CPU (None: it says nothing)."""

    package: int | None = None
    """``physical_package_id``: the socket."""
    siblings: frozenset[int] | None = None
    """``thread_siblings_list``: the logical CPUs of its physical core."""
    cache: frozenset[int] | None = None
    """The CPUs sharing its highest-level data or unified cache (L3, a core complex)."""


class Topology(msgspec.Struct, frozen=True, kw_only=True):
    nodes: Mapping[int, frozenset[int]]
    """NUMA node → its CPUs (``cpulist``)."""
    cpus: Mapping[int, Cpu]
    gpu_nodes: Mapping[str, int | None]
    """GPU bus id → its PCI device's ``numa_node`` (None: sysfs has none)."""
    allowed: frozenset[int]
    """The CPUs the launcher may use; nothing outside them is handed out."""


def parse_cpulist(text: str) -> frozenset[int]:
    """A sysfs CPU list, ``0-3,8,10-11``."""
    cpus: set[int] = set()
    for item in text.strip().split(","):
        if not item:
            continue
        low, _, high = item.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return frozenset(cpus)


def format_cpulist(cpus: Iterable[int]) -> str:
    """The sysfs form of a CPU set, as ``/proc/PID/status`` prints ``Cpus_allowed_list``."""
    ranges: list[list[int]] = []
    for cpu in sorted(cpus):
        if ranges and cpu == ranges[-1][1] + 1:
            ranges[-1][1] = cpu
        else:
            ranges.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in ranges)


def sysfs_bus_id(nvml_bus_id: str) -> str:
    """NVML's ``00000000:17:00.0`` as sysfs names the device: ``0000:17:00.0``."""
    parts = nvml_bus_id.strip().lower().split(":")
    if len(parts) == 2:  # no domain: domain 0
        parts.insert(0, "0")
    domain, bus, device = parts
    return f"{int(domain, 16):04x}:{int(bus, 16):02x}:{device}"


def cuda_devices(
    gpus: Sequence[Gpu], visible: Sequence[str] | None, device_order: str | None
) -> list[Gpu]:
    """The GPUs a process sees as CUDA devices 0, 1, …: ``gpus`` is NVML's list.

    ``visible``: the ``CUDA_VISIBLE_DEVICES`` entries (None: unset, every
    GPU); ``device_order``: ``CUDA_DEVICE_ORDER``.
    """
    physical = sorted(gpus, key=lambda gpu: gpu.bus_id)
    by_index = visible is None or any(token.strip().isdigit() for token in visible)
    models = sorted({gpu.name for gpu in gpus})
    if by_index and (device_order or "").strip().upper() != "PCI_BUS_ID" and len(models) > 1:
        raise NumaError(
            f"CUDA numbers mixed GPU models ({', '.join(models)}) fastest first by default, "
            "an order only CUDA knows: set CUDA_DEVICE_ORDER=PCI_BUS_ID, or name GPUs by UUID"
        )
    if visible is None:
        return physical
    devices: list[Gpu] = []
    for token in visible:
        gpu = _resolve(token.strip(), physical)
        if gpu is None or gpu in devices:
            break  # CUDA ignores the rest of the list
        devices.append(gpu)
    return devices


def _resolve(token: str, physical: Sequence[Gpu]) -> Gpu | None:
    if token.isdigit():
        index = int(token)
        return physical[index] if index < len(physical) else None
    if token.startswith("GPU-"):
        matches = [gpu for gpu in physical if gpu.uuid.startswith(token)]
        return matches[0] if len(matches) == 1 else None
    return None  # MIG-… and anything else: no PCI device of its own here


def bind(
    mode: AffinityMode, devices: Sequence[Gpu], nproc: int, topology: Topology
) -> dict[int, frozenset[int]]:
    """The CPUs of each local rank, ``devices`` being the group's GPUs in CUDA order."""
    plan = {}
    for rank in range(nproc):
        if rank >= len(devices):
            raise NumaError(f"local rank {rank} has no GPU ({len(devices)} visible to the group)")
        try:
            cpus = _CHOOSE[mode](_View(topology, devices), rank)
        except NumaError as e:
            raise NumaError(f"local rank {rank} (GPU {devices[rank].bus_id}): {e}") from None
        if not cpus:
            raise NumaError(f"local rank {rank} (GPU {devices[rank].bus_id}): no CPU to bind to")
        plan[rank] = cpus
    return plan


class _View:
    """Questions about the topology, each failing with the reason sysfs cannot answer it."""

    def __init__(self, topology: Topology, devices: Sequence[Gpu]) -> None:
        self.topology = topology
        self.devices = devices

    def of_gpu(self, rank: int) -> int:
        bus_id = self.devices[rank].bus_id
        node = self.topology.gpu_nodes.get(bus_id)
        if node is None:
            raise NumaError(f"no NUMA information for {bus_id} (no numa_node in sysfs)")
        return max(node, 0)

    def cpus(self, node: int) -> frozenset[int]:
        if node not in self.topology.nodes:
            raise NumaError(f"no NUMA information for node {node} (no cpulist in sysfs)")
        return self.topology.nodes[node] & self.topology.allowed

    def socket(self, node: int) -> int | None:
        cpus = self.cpus(node)
        if not cpus:
            return None
        package = self.topology.cpus.get(min(cpus), Cpu()).package
        if package is None:
            raise NumaError(f"no socket for CPU {min(cpus)} (no physical_package_id in sysfs)")
        return package

    def peers(self, rank: int) -> tuple[int, int, int]:
        """This GPU's NUMA node, its position among the group's GPUs there, and their number."""
        node = self.of_gpu(rank)
        on_node = [other for other in range(len(self.devices)) if self.of_gpu(other) == node]
        return node, on_node.index(rank), len(on_node)

    def grouped(self, node: int, what: Literal["siblings", "cache"]) -> dict[int, frozenset[int]]:
        """The node's usable CPUs by physical core or by shared cache, keyed by the lowest CPU."""
        groups: dict[int, set[int]] = {}
        for cpu in self.cpus(node):
            shared = getattr(self.topology.cpus.get(cpu, Cpu()), what)
            if shared is None:
                source = "thread_siblings_list" if what == "siblings" else "cache/index*"
                raise NumaError(f"no {source} in sysfs for CPU {cpu}")
            groups.setdefault(min(shared), set()).add(cpu)
        return {key: frozenset(cpus) for key, cpus in groups.items()}


def _node_mode(view: _View, rank: int) -> frozenset[int]:
    return view.cpus(view.of_gpu(rank))


def _socket_mode(view: _View, rank: int) -> frozenset[int]:
    socket = view.socket(view.of_gpu(rank))
    if socket is None:
        return frozenset()
    return frozenset().union(
        *(view.cpus(other) for other in view.topology.nodes if view.socket(other) == socket)
    )


def _exclusive_mode(view: _View, rank: int) -> frozenset[int]:
    numa_node, position, on_node = view.peers(rank)
    cores = [cpus for _, cpus in sorted(view.grouped(numa_node, "siblings").items())]
    share, extra = divmod(len(cores), on_node)
    if share < 1:
        raise NumaError(
            f"NUMA node {numa_node} has {len(cores)} physical core(s) for {on_node} GPUs"
        )
    start = position * share + min(position, extra)
    end = start + share + (1 if position < extra else 0)
    return frozenset().union(*cores[start:end])


def _core_complex_mode(view: _View, rank: int) -> frozenset[int]:
    numa_node, position, _ = view.peers(rank)
    complexes = sorted(
        view.grouped(numa_node, "cache").items(), key=lambda item: (-len(item[1]), item[0])
    )
    if not complexes:
        return frozenset()
    return complexes[position % len(complexes)][1]


_CHOOSE = {
    "node": _node_mode,
    "socket": _socket_mode,
    "exclusive": _exclusive_mode,
    "core-complex": _core_complex_mode,
}
