"""A memory cgroup per child: how often the OOM killer struck in it, its peak, a cap.

Where the memory controller is, each child's cell has a memory cgroup:

- on a unified host whose v2 cgroup delegates ``memory`` to the daemon's job
  cgroup, the v2 cell itself (``+memory`` in the job's
  ``cgroup.subtree_control``; the job holds no process, so the
  no-internal-processes rule allows it): no second placement. A daemon alone
  in a cgroup that offers ``memory`` (a systemd unit's, ``Delegate=yes``)
  moved into a leaf of it first, so that it could delegate it
  (:func:`~watchdogd.linux.cgroups.leave_for_leaf`);
- else, where the v1 memory hierarchy may be written (a hybrid host, as
  root), a second cgroup the child enters too, before user code::

    <own memory cgroup>/watchdogd-<pid>-<start time>/   the job, named for its owner
        <group>.<kind><local rank>.<n>/                 one worker or spare

  v1 has no ``cgroup.kill``: the v2 cell's kill ends the processes, and the
  memory cgroup is removed (rmdir) once empty. A dead daemon's memory job is
  swept at the next start, as the v2 job is (:func:`sweep_stale`).

The files, v2 then v1: the OOM killer's count is ``oom_kill`` in
``memory.events`` / ``memory.oom_control`` (the same ``key value`` lines);
the peak is ``memory.peak`` (kernel 5.19) / ``memory.max_usage_in_bytes``;
the cap is ``memory.max`` / ``memory.limit_in_bytes``. Swap is not capped.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from pathlib import Path
from typing import NamedTuple

from watchdogd.linux.cgroups import Stale, cell_name, job_name, members, stale_jobs
from watchdogd.linux.procs import read_stat
from watchdogd.linux.sessions import kill_matched

__all__ = [
    "V1",
    "V2",
    "Memory",
    "MemoryFiles",
    "MemoryJob",
    "MemoryReading",
    "open_memory_job",
    "parse_oom_kills",
    "parse_peak",
    "sweep_stale",
    "v1_memory_dir",
]


class MemoryFiles(NamedTuple):
    """One cgroup version's names for the files read and written here."""

    version: str
    events: str
    peak: str
    limit: str


V2 = MemoryFiles("v2", "memory.events", "memory.peak", "memory.max")
V1 = MemoryFiles("v1", "memory.oom_control", "memory.max_usage_in_bytes", "memory.limit_in_bytes")


def parse_oom_kills(text: str) -> int:
    """``oom_kill`` of a ``memory.events`` or ``memory.oom_control`` text (0: not there,
    as before kernel 4.13)."""
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if key == "oom_kill":
            return int(value)
    return 0


def parse_peak(text: str) -> int | None:
    """The bytes of a ``memory.peak`` or ``memory.max_usage_in_bytes`` text."""
    text = text.strip()
    return int(text) if text.isdigit() else None


class MemoryReading(NamedTuple):
    """What a memory cgroup said when it was read."""

    oom_kills: int
    peak_bytes: int | None


class Memory:
    """One child's memory cgroup: ``path``, whose files are ``files``; ``procs``: the
    ``cgroup.procs`` the child enters (none: the memory is its v2 cell's own)."""

    def __init__(self, path: Path, files: MemoryFiles, procs: tuple[str, ...]) -> None:
        self.path = path
        self.files = files
        self.procs = procs

    def read(self) -> MemoryReading:
        """The OOM kills and the peak so far (0 and None once it is gone)."""
        try:
            kills = parse_oom_kills((self.path / self.files.events).read_text())
        except FileNotFoundError:
            kills = 0
        try:
            peak = parse_peak((self.path / self.files.peak).read_text())
        except FileNotFoundError:  # memory.peak came in 5.19
            peak = None
        return MemoryReading(kills, peak)

    def remove(self) -> None:
        """rmdir a v1 memory cgroup, once empty (a v2 cell's memory goes with the cell)."""
        if self.procs:
            with contextlib.suppress(OSError):
                os.rmdir(self.path)


class MemoryJob:
    """Where this daemon's children's memory cgroups are made."""

    def __init__(self, path: Path, files: MemoryFiles) -> None:
        self.path = path
        self.files = files
        self._serial = itertools.count(1)

    def describe(self) -> str:
        return f"memory cgroup {self.files.version} per worker, under {self.path}"

    def cell(self, name: str, v2_cell: Path | None, limit: int | None) -> Memory:
        """The memory cgroup of a new cell named ``name`` (``v2_cell``: its v2 directory,
        None in the session fallback), capped at ``limit`` bytes (None: no cap)."""
        if self.files is V2:
            if v2_cell is None:
                raise OSError("no v2 cell to read memory from")
            memory = Memory(v2_cell, V2, ())
        else:
            path = self.path / cell_name(name, self._serial)
            path.mkdir()
            memory = Memory(path, V1, (str(path / "cgroup.procs"),))
        if limit is not None:
            try:
                (memory.path / self.files.limit).write_text(str(limit))
            except OSError:
                memory.remove()
                raise
        return memory

    def own_dirs(self) -> list[Path]:
        """The directories it made beside the v2 job (v1's), for the keeper to remove."""
        return [self.path] if self.files is V1 else []

    def remove(self) -> None:
        """rmdir the v1 job and what is left below it, once empty."""
        if self.files is V1:
            for directory, _, _ in sorted(os.walk(self.path), key=lambda d: -d[0].count("/")):
                with contextlib.suppress(OSError):
                    os.rmdir(directory)


def _v1_mount(mountinfo: str) -> tuple[str, str] | None:
    """(mount point, root in the hierarchy) of the first read-write v1 memory mount."""
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 6:
            continue
        after = line.split(" - ", 1)[1].split()
        memory = after[0] == "cgroup" and len(after) > 2 and "memory" in after[2].split(",")
        if memory and "rw" in fields[5].split(","):
            return fields[4].replace("\\040", " "), fields[3]
    return None


def v1_memory_dir(mountinfo: str, own_cgroups: str) -> Path | None:
    """This process's v1 memory cgroup directory, from ``/proc/self/mountinfo``'s and
    ``/proc/self/cgroup``'s texts (None: no v1 memory hierarchy is mounted)."""
    mount = _v1_mount(mountinfo)
    if mount is None:
        return None
    point, root = mount
    for line in own_cgroups.splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            if root != "/" and path.startswith(root):  # a container's view: from its root
                path = path[len(root) :]
            return Path(point + path.rstrip("/"))
    return None


def _own_v1_dir() -> Path:
    found = v1_memory_dir(
        Path("/proc/self/mountinfo").read_text(), Path("/proc/self/cgroup").read_text()
    )
    if found is None:
        raise OSError(
            "no memory controller: cgroup v2 does not offer one, and no v1 memory "
            "hierarchy is mounted read-write"
        )
    return found


def open_memory_job(v2_job: Path | None) -> MemoryJob:
    """Memory cgroups for this daemon's children: v2 in ``v2_job`` when it may have
    the controller, else a v1 job of its own (OSError naming why there is none)."""
    if v2_job is not None:
        with contextlib.suppress(OSError):
            if "memory" in (v2_job / "cgroup.controllers").read_text().split():
                (v2_job / "cgroup.subtree_control").write_text("+memory")
                return MemoryJob(v2_job, V2)
    path = _own_v1_dir() / job_name()
    path.mkdir()
    return MemoryJob(path, V1)


def sweep_stale() -> list[Stale]:
    """Remove the v1 memory jobs beside ours whose owner is gone (after the v2 sweep
    killed their processes); those that still held processes (the session fallback's
    orphans, SIGKILLed here through a pidfd; a job not yet empty waits for the next
    sweep)."""
    found = []
    for entry, owner in stale_jobs(_own_v1_dir):
        pids = members(entry)
        started = {}
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                started[pid] = read_stat(pid).start_time
        kill_matched(started)
        MemoryJob(entry, V1).remove()
        if pids:  # an empty one is housekeeping: its processes were reported, or never left
            found.append(Stale(str(entry), owner, pids))
    return found
