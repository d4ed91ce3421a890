"""NUMA binding reaches real workers: what ``/proc/self/status`` says in each one.

The GPUs are handed in at the port (``NodeHardware(gpus=...)``) and the
topology is a sysfs tree built here, because this machine's GPUs (if any)
sit wherever they sit; the binding itself is the kernel's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from watchdogd.core.numa import format_cpulist
from watchdogd.linux.numa import NodeHardware
from watchdogd_client.groups import GroupSpec, GroupState

from ..conftest import running_daemon, wait_for
from ..sysfs_tree import CpuSpec, build, gpus

REPORT = """
import os, sys
status = open("/proc/self/status").read()
line = next(l for l in status.splitlines() if l.startswith("Cpus_allowed_list:"))
with open(os.path.join(sys.argv[1], os.environ["LOCAL_RANK"]), "w") as f:
    f.write(line.split(":", 1)[1].strip())
"""


@pytest.fixture
def two_cpus() -> tuple[int, int]:
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) < 2:
        pytest.skip("binding two workers to different CPUs needs two CPUs")
    return mine[0], mine[1]


@pytest.mark.anyio
async def test_each_worker_starts_bound_to_its_gpus_node(
    short_dir: Path, tmp_path: Path, two_cpus: tuple[int, int]
) -> None:
    first, second = two_cpus
    devices = gpus("0000:17:00.0", "0000:ca:00.0")
    sysfs = build(
        tmp_path / "sys",
        nodes={0: str(first), 1: str(second)},
        cpus={first: CpuSpec(0, {first}, {first}), second: CpuSpec(1, {second}, {second})},
        gpu_nodes={"0000:17:00.0": 0, "0000:ca:00.0": 1},
    )
    out = tmp_path / "out"
    out.mkdir()
    spec = GroupSpec(
        name="bound",
        entrypoint=[sys.executable, "-c", REPORT, str(out)],
        nproc=2,
        gpus=[0, 1],
        numa_binding="node",
    )
    before = os.sched_getaffinity(0)
    async with running_daemon(short_dir) as daemon:
        daemon.supervisor.hardware = NodeHardware(sysfs=sysfs, gpus=lambda: devices)
        runner = daemon.supervisor.submit(spec)
        await wait_for(lambda: runner.finished.is_set())
        assert runner.state is GroupState.SUCCEEDED, runner.failures.last
    assert (out / "0").read_text() == str(first)
    assert (out / "1").read_text() == str(second)
    assert os.sched_getaffinity(0) == before  # the launcher's own thread is unbound again
    (event,) = [e for e in daemon.events.since() if e.name == "numa_binding"]
    assert event.metadata["cpus"] == f"0:{first} 1:{second}"


@pytest.mark.anyio
async def test_a_binding_that_cannot_be_applied_fails_the_group_naming_the_rank(
    short_dir: Path, tmp_path: Path
) -> None:
    every_cpu = format_cpulist(os.sched_getaffinity(0))
    sysfs = build(tmp_path / "sys", nodes={0: every_cpu}, cpus={}, gpu_nodes={"0000:17:00.0": 0})
    spec = GroupSpec(name="unbound", entrypoint=["true"], nproc=2, gpus=[0, 1], numa_binding="node")
    async with running_daemon(short_dir) as daemon:
        daemon.supervisor.hardware = NodeHardware(sysfs=sysfs, gpus=lambda: gpus("0000:17:00.0"))
        runner = daemon.supervisor.submit(spec)
        await wait_for(lambda: runner.finished.is_set())
    assert runner.state is GroupState.FAILED
    assert runner.failures.last is not None
    assert runner.failures.last.reason == (
        "group unbound: numa binding 'node': local rank 1 has no GPU "
        "(1 visible to the group); the group's GPUs: CUDA_VISIBLE_DEVICES=0,1"
    )
    assert not runner.workers  # nothing was started
