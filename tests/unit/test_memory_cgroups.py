"""What a memory cgroup says, read from texts and trees built here (v2 and v1 alike)."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path

import pytest

from watchdogd.core.run_options import OptionsError, memory_bytes
from watchdogd.groups.cell_memory import MeteredCell
from watchdogd.groups.workers import describe_exit
from watchdogd.linux.cgroups import CgroupCell
from watchdogd.linux.memory_cgroups import (
    V1,
    V2,
    Memory,
    MemoryJob,
    MemoryReading,
    open_memory_job,
    parse_oom_kills,
    parse_peak,
    v1_memory_dir,
)

MEMORY_EVENTS = "low 0\nhigh 0\nmax 12\noom 1\noom_kill 1\noom_group_kill 0\n"
OOM_CONTROL = "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n"

HYBRID_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
OWN_CGROUPS = "9:name=systemd:/\n4:memory:/process_api/73f8\n1:cpu:/\n0::/\n"


def test_the_oom_kill_count_reads_alike_in_v2_memory_events_and_v1_oom_control() -> None:
    assert parse_oom_kills(MEMORY_EVENTS) == 1
    assert parse_oom_kills(OOM_CONTROL) == 2
    assert parse_oom_kills("oom_kill_disable 0\nunder_oom 0\n") == 0  # before kernel 4.13


def test_the_peak_is_the_files_bytes() -> None:
    assert parse_peak("52428800\n") == 52428800
    assert parse_peak("") is None


def test_the_v1_memory_cgroup_is_found_from_mountinfo_and_proc_self_cgroup() -> None:
    found = v1_memory_dir(HYBRID_MOUNTINFO, OWN_CGROUPS)
    assert found == Path("/sys/fs/cgroup/memory/process_api/73f8")


def test_a_containers_memory_mount_is_rooted_where_its_cgroup_is() -> None:
    mountinfo = "35 31 0:32 /docker/abc /sys/fs/cgroup/memory ro,nosuid - cgroup cgroup rw,memory\n"
    assert v1_memory_dir(mountinfo, "4:memory:/docker/abc/job\n") is None  # read-only
    writable = mountinfo.replace(" ro,nosuid ", " rw,nosuid ")
    combined = "4:cpu,memory:/docker/abc/job\n"
    assert v1_memory_dir(writable, combined) == Path("/sys/fs/cgroup/memory/job")


def test_a_unified_host_has_no_v1_memory_dir() -> None:
    unified = "30 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
    assert v1_memory_dir(unified, "0::/user.slice\n") is None


def _v2_job(tmp_path: Path, controllers: str) -> Path:
    job = tmp_path / "watchdogd-1-2"
    job.mkdir()
    (job / "cgroup.controllers").write_text(controllers)
    (job / "cgroup.subtree_control").write_text("")
    return job


def test_where_v2_offers_memory_the_cells_own_files_are_used(tmp_path: Path) -> None:
    job_dir = _v2_job(tmp_path, "cpu memory pids\n")
    job = open_memory_job(job_dir)
    assert (job.files, job.path) == (V2, job_dir)
    assert (job_dir / "cgroup.subtree_control").read_text() == "+memory"
    cell = job_dir / "default.a0.rank0.1"
    cell.mkdir()
    memory = job.cell("default.a0.rank0", cell, 50 << 20)
    assert memory.procs == ()  # no second placement: the v2 cell is the memory cgroup
    assert (cell / "memory.max").read_text() == str(50 << 20)
    (cell / "memory.events").write_text(MEMORY_EVENTS)
    (cell / "memory.peak").write_text("52428800\n")
    assert memory.read() == MemoryReading(oom_kills=1, peak_bytes=52428800)
    memory.remove()
    assert cell.exists()  # removed with the v2 cell, not here


def test_v1_memory_cells_are_entered_beside_the_v2_one_and_removed_alone(tmp_path: Path) -> None:
    job = MemoryJob(tmp_path, V1)
    memory = job.cell("default.a0/rank1", None, None)
    assert memory.path == tmp_path / "default_a0_rank1.1"
    assert memory.procs == (str(memory.path / "cgroup.procs"),)
    assert not (memory.path / "memory.limit_in_bytes").exists()  # no cap asked
    (memory.path / "memory.oom_control").write_text(OOM_CONTROL)
    assert memory.read() == MemoryReading(oom_kills=2, peak_bytes=None)
    (memory.path / "memory.oom_control").unlink()
    memory.remove()
    assert not memory.path.exists()


def test_a_v1_memory_cgroup_is_removed_by_the_v2_jobs_writer_after_its_v2_cell(
    tmp_path: Path,
) -> None:
    # An rmdir waits for cgroup_mutex, which a placement holds through a grace period:
    # never on the loop, and in order (the v2 rmdir first, as the kill went).
    handed: list[Callable[[], None]] = []
    v2_dir = tmp_path / "v2" / "default.rank0.1"
    v2_dir.mkdir(parents=True)
    (tmp_path / "v1").mkdir()
    memory = MemoryJob(tmp_path / "v1", V1).cell("default.rank0", None, None)
    cell = MeteredCell(CgroupCell(v2_dir, handed.append), memory)
    cell.remove()
    assert v2_dir.exists() and memory.path.exists()  # nothing done here
    for op in handed:
        op()
    assert not v2_dir.exists() and not memory.path.exists()
    assert len(handed) == 2


def test_a_gone_memory_cgroup_reads_as_nothing(tmp_path: Path) -> None:
    assert Memory(tmp_path / "gone", V1, ()).read() == MemoryReading(0, None)


def test_the_reason_names_the_oom_killer_only_for_a_sigkill_it_counted() -> None:
    assert describe_exit(-signal.SIGKILL, oom_kills=1) == "killed by the OOM killer"
    assert describe_exit(-signal.SIGKILL) == "killed by SIGKILL"
    assert describe_exit(1, oom_kills=2) == (
        "exited with status 1 (the OOM killer ended 2 process(es) of its cell)"
    )


@pytest.mark.parametrize(
    ("size", "expected"),
    [("52428800", 52428800), (4096, 4096), ("50M", 50 << 20), ("2g", 2 << 30), ("1K", 1024)],
)
def test_a_memory_cap_reads_as_the_kernel_reads_it(size: int | str, expected: int) -> None:
    assert memory_bytes(size) == expected


@pytest.mark.parametrize("size", ["50MB", "-1", "1.5G", ""])
def test_a_memory_cap_that_is_no_size_names_the_option(size: str) -> None:
    with pytest.raises(OptionsError, match="worker_memory_max"):
        memory_bytes(size)
