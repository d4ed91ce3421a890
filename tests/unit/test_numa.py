"""NUMA binding on sysfs trees built here: one socket, two sockets, and what cannot be bound."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from watchdogd.core.numa import (
    Gpu,
    NumaError,
    bind,
    cuda_devices,
    format_cpulist,
    parse_cpulist,
    sysfs_bus_id,
)
from watchdogd.linux.numa import read_topology

from ..sysfs_tree import CpuSpec, build, gpus


def cpus(text: str) -> frozenset[int]:
    return parse_cpulist(text)


def plan(root: Path, mode: str, devices: list[Gpu], nproc: int, **kw: object) -> dict[int, str]:
    topology = read_topology([g.bus_id for g in devices], sysfs=root, **kw)  # type: ignore[arg-type]
    chosen = bind(mode, devices, nproc, topology)  # type: ignore[arg-type]
    return {rank: format_cpulist(c) for rank, c in chosen.items()}


# One socket, one NUMA node (its GPUs say numa_node -1), 4 cores with 2 hyperthreads
# each (0+4, 1+5, 2+6, 3+7), two core complexes sharing an L3 each; three GPUs.
ONE_SOCKET_GPUS = gpus("0000:17:00.0", "0000:65:00.0", "0000:ca:00.0")


@pytest.fixture
def one_socket(tmp_path: Path) -> Path:
    def cpu(n: int) -> CpuSpec:
        core = n % 4
        l3 = {0, 1, 4, 5} if core < 2 else {2, 3, 6, 7}
        return CpuSpec(package=0, siblings={core, core + 4}, l3=l3)

    return build(
        tmp_path,
        nodes={0: "0-7"},
        cpus={n: cpu(n) for n in range(8)},
        gpu_nodes={g.bus_id: -1 for g in ONE_SOCKET_GPUS},
    )


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("node", {0: "0-7", 1: "0-7", 2: "0-7"}),
        ("socket", {0: "0-7", 1: "0-7", 2: "0-7"}),
        # 4 cores for 3 GPUs: the lowest GPU gets the extra core; hyperthreads stay together.
        ("exclusive", {0: "0-1,4-5", 1: "2,6", 2: "3,7"}),
        # Two complexes for three GPUs: round robin.
        ("core-complex", {0: "0-1,4-5", 1: "2-3,6-7", 2: "0-1,4-5"}),
    ],
)
def test_one_socket(one_socket: Path, mode: str, expected: dict[int, str]) -> None:
    assert plan(one_socket, mode, ONE_SOCKET_GPUS, 3, allowed=cpus("0-7")) == expected


# Two sockets of two NUMA nodes each (0-3, 4-7 | 8-11, 12-15), no hyperthreads, one L3
# per node except node 2, which has two (8-9, 10-11). GPUs on node 1, node 2 (two of
# them) and node 3.
TWO_SOCKET_GPUS = gpus("0000:1a:00.0", "0000:3b:00.0", "0000:5c:00.0", "0000:9d:00.0")


@pytest.fixture
def two_sockets(tmp_path: Path) -> Path:
    def cpu(n: int) -> CpuSpec:
        l3 = (
            {8, 9}
            if n in (8, 9)
            else {10, 11}
            if n in (10, 11)
            else set(range(n - n % 4, n - n % 4 + 4))
        )
        return CpuSpec(package=n // 8, siblings={n}, l3=l3)

    on_node = [1, 2, 2, 3]
    return build(
        tmp_path,
        nodes={0: "0-3", 1: "4-7", 2: "8-11", 3: "12-15"},
        cpus={n: cpu(n) for n in range(16)},
        gpu_nodes={g.bus_id: node for g, node in zip(TWO_SOCKET_GPUS, on_node, strict=True)},
    )


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("node", {0: "4-7", 1: "8-11", 2: "8-11", 3: "12-15"}),
        ("socket", {0: "0-7", 1: "8-15", 2: "8-15", 3: "8-15"}),
        ("exclusive", {0: "4-7", 1: "8-9", 2: "10-11", 3: "12-15"}),
        ("core-complex", {0: "4-7", 1: "8-9", 2: "10-11", 3: "12-15"}),
    ],
)
def test_two_sockets(two_sockets: Path, mode: str, expected: dict[int, str]) -> None:
    assert plan(two_sockets, mode, TWO_SOCKET_GPUS, 4, allowed=cpus("0-15")) == expected


@pytest.mark.parametrize("mode", ["node", "socket", "exclusive", "core-complex"])
@pytest.mark.parametrize(
    ("tree", "devices", "allowed"),
    [
        ("one_socket", ONE_SOCKET_GPUS, "0-7"),
        ("two_sockets", TWO_SOCKET_GPUS, "0-15"),
        ("two_sockets", TWO_SOCKET_GPUS, "0-4,6-8,10-15"),
    ],
)
def test_the_same_cpus_as_torch(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    tree: str,
    devices: list[Gpu],
    allowed: str,
    mode: str,
) -> None:
    """torch's own functions on the same tree: its sysfs reads sent there, its CUDA answered."""
    binding = pytest.importorskip("torch.numa.binding")
    root: Path = request.getfixturevalue(tree)
    topology = read_topology([g.bus_id for g in devices], sysfs=root, allowed=cpus(allowed))

    def reroot(path: str) -> str:
        return str(root / path.removeprefix("/sys/")) if path.startswith("/sys/") else path

    listdir = os.listdir
    # torch's code opens it in a with block of its own.
    monkeypatch.setattr(binding, "open", lambda p, *a: open(reroot(p), *a), raising=False)  # noqa: SIM115
    monkeypatch.setattr(binding.os, "listdir", lambda p: listdir(reroot(p)))
    monkeypatch.setattr(binding, "_get_gpu_count", lambda: len(devices))
    monkeypatch.setattr(
        binding,
        "_get_numa_node_index_for_gpu_index",
        lambda *, gpu_index: max(topology.gpu_nodes[devices[gpu_index].bus_id] or 0, 0),
    )
    monkeypatch.setattr(
        binding, "_get_allowed_cpu_indices_for_current_thread", lambda: set(cpus(allowed))
    )
    options = binding.NumaOptions(affinity_mode=binding.AffinityMode(mode))
    ours = bind(mode, devices, len(devices), topology)  # type: ignore[arg-type]
    for rank in range(len(devices)):
        theirs = binding._get_logical_cpus_to_bind_to(gpu_index=rank, numa_options=options)
        assert ours[rank] == theirs, rank


def test_memory_only_nodes_belong_to_no_socket(tmp_path: Path) -> None:
    devices = gpus("0000:17:00.0")
    root = build(
        tmp_path,
        nodes={0: "0-3", 1: ""},  # node 1: memory only (CXL, HBM); torch fails on it
        cpus={n: CpuSpec(0, {n}, {0, 1, 2, 3}) for n in range(4)},
        gpu_nodes={"0000:17:00.0": 0},
    )
    assert plan(root, "socket", devices, 1, allowed=cpus("0-3")) == {0: "0-3"}


def test_only_cpus_the_launcher_may_use_are_handed_out(two_sockets: Path) -> None:
    allowed = cpus("0-4,6-8,10-15")  # 5 and 9 are not ours (a cpuset, taskset)
    assert plan(two_sockets, "node", TWO_SOCKET_GPUS, 4, allowed=allowed) == {
        0: "4,6-7", 1: "8,10-11", 2: "8,10-11", 3: "12-15",
    }  # fmt: skip
    # Node 2 has three usable cores left for its two GPUs.
    assert plan(two_sockets, "exclusive", TWO_SOCKET_GPUS, 4, allowed=allowed) == {
        0: "4,6-7", 1: "8,10", 2: "11", 3: "12-15",
    }  # fmt: skip


def test_ranks_beyond_nproc_are_not_bound_but_their_gpus_share_the_node(
    two_sockets: Path,
) -> None:
    # Two workers, four GPUs: rank 1 still splits node 2 with the unused GPU 2, as torch does.
    assert plan(two_sockets, "exclusive", TWO_SOCKET_GPUS, 2, allowed=cpus("0-15")) == {
        0: "4-7",
        1: "8-9",
    }


def test_a_rank_without_a_gpu_is_an_error(two_sockets: Path) -> None:
    with pytest.raises(NumaError, match=r"^local rank 2 has no GPU \(2 visible to the group\)$"):
        plan(two_sockets, "node", TWO_SOCKET_GPUS[:2], 3, allowed=cpus("0-15"))


def test_a_gpu_without_numa_information_is_an_error(tmp_path: Path) -> None:
    devices = gpus("0000:17:00.0", "0000:65:00.0")
    root = build(
        tmp_path,
        nodes={0: "0-3"},
        cpus={n: CpuSpec(0, {n}, {0, 1, 2, 3}) for n in range(4)},
        gpu_nodes={"0000:17:00.0": 0, "0000:65:00.0": None},
    )
    with pytest.raises(NumaError, match=r"local rank 1 \(GPU 0000:65:00.0\): no NUMA information"):
        plan(root, "node", devices, 2, allowed=cpus("0-3"))


def test_a_node_sysfs_does_not_list_is_an_error(tmp_path: Path) -> None:
    devices = gpus("0000:17:00.0")
    root = build(tmp_path, nodes={}, cpus={}, gpu_nodes={"0000:17:00.0": 0})
    with pytest.raises(NumaError, match="no NUMA information for node 0"):
        plan(root, "node", devices, 1, allowed=cpus("0-3"))


def test_exclusive_needs_a_core_per_gpu(tmp_path: Path) -> None:
    devices = gpus("0000:17:00.0", "0000:65:00.0")
    root = build(
        tmp_path,
        nodes={0: "0-1"},
        cpus={n: CpuSpec(0, {0, 1}, {0, 1}) for n in range(2)},
        gpu_nodes={g.bus_id: 0 for g in devices},
    )
    with pytest.raises(NumaError, match=r"has 1 physical core\(s\) for 2 GPUs"):
        plan(root, "exclusive", devices, 2, allowed=cpus("0-1"))


def test_the_highest_data_cache_is_the_core_complex(one_socket: Path) -> None:
    topology = read_topology([], sysfs=one_socket, allowed=cpus("0-7"))
    assert topology.cpus[5].cache == cpus("0-1,4-5")  # L3, not L1/L2 or an instruction cache
    assert topology.cpus[5].siblings == cpus("1,5")
    assert topology.cpus[5].package == 0


# -- which GPU is CUDA's device i ---------------------------------------------------

NVML = [
    Gpu(index=0, uuid="GPU-aaaa1111", bus_id="0000:17:00.0", name="H100"),
    Gpu(index=1, uuid="GPU-bbbb2222", bus_id="0000:65:00.0", name="H100"),
    Gpu(index=2, uuid="GPU-bbbb3333", bus_id="0000:ca:00.0", name="H100"),
]


def buses(devices: list[Gpu]) -> list[str]:
    return [g.bus_id[5:7] for g in devices]


def test_cuda_visible_devices_picks_and_orders_gpus() -> None:
    assert buses(cuda_devices(NVML, None, None)) == ["17", "65", "ca"]
    assert buses(cuda_devices(NVML, ["2", "0"], None)) == ["ca", "17"]
    assert buses(cuda_devices(NVML, ["GPU-bbbb3", "GPU-aaaa"], None)) == ["ca", "17"]
    # As in CUDA, the list ends at an entry naming no device (out of range, ambiguous, MIG)
    # or naming one twice.
    assert buses(cuda_devices(NVML, ["1", "7", "0"], None)) == ["65"]
    assert buses(cuda_devices(NVML, ["0", "GPU-bbbb", "1"], None)) == ["17"]
    assert buses(cuda_devices(NVML, ["MIG-1234"], None)) == []
    assert buses(cuda_devices(NVML, ["0", "0"], None)) == ["17"]


def test_mixed_models_need_pci_bus_id_order_for_indices() -> None:
    mixed = [*NVML[:2], Gpu(index=2, uuid="GPU-cccc", bus_id="0000:ca:00.0", name="L4")]
    with pytest.raises(NumaError, match="CUDA_DEVICE_ORDER=PCI_BUS_ID"):
        cuda_devices(mixed, ["0"], None)
    with pytest.raises(NumaError, match="CUDA_DEVICE_ORDER=PCI_BUS_ID"):
        cuda_devices(mixed, None, "FASTEST_FIRST")
    assert buses(cuda_devices(mixed, ["2"], "PCI_BUS_ID")) == ["ca"]
    assert buses(cuda_devices(mixed, ["GPU-cccc"], None)) == ["ca"]  # UUIDs need no order


def test_bus_ids_and_cpu_lists() -> None:
    assert sysfs_bus_id("00000000:CA:00.0") == "0000:ca:00.0"
    assert sysfs_bus_id("0000:17:00.0") == "0000:17:00.0"
    assert sysfs_bus_id("17:00.0") == "0000:17:00.0"
    assert parse_cpulist("0-2,4,6-7\n") == {0, 1, 2, 4, 6, 7}
    assert parse_cpulist("") == frozenset()
    assert format_cpulist({0, 1, 2, 4, 6, 7}) == "0-2,4,6-7"
