"""cgroup v2 for the daemon's children: one per child, under a cgroup of the daemon's own.

Where the writable cgroup2 hierarchy is mounted is read from
``/proc/self/mountinfo`` (``/sys/fs/cgroup`` on a unified host,
``/sys/fs/cgroup/unified`` on a hybrid one), and the daemon's own cgroup
from ``/proc/self/cgroup``: under systemd that is the unit's delegated
subtree (``Delegate=yes``), under ``watchdogd run`` the shell's cgroup,
when it may be written (root, or a delegated user slice).

The layout::

    <own cgroup>/watchdogd-<pid>-<start time>/   the job: this daemon's (its owner)
        <group>.<kind><local rank>.<n>/          one worker or spare, and all it starts

The owner's pid and start time are in the job cgroup's name (cgroupfs
takes no plain files), so a later daemon tells a cgroup whose owner is gone
(:func:`sweep_stale`) from one whose owner runs. Controllers are never
enabled here, so the daemon may stay in its own cgroup beside these (the
no-internal-processes rule binds only cgroups with controllers on).

``cgroup.kill`` (kernel 5.14) kills every process of a cgroup and of those
below, whatever session or process group it made; ``cgroup.events`` says
``populated 0`` once they have all exited.
"""

from __future__ import annotations

import contextlib
import os
import re
from pathlib import Path
from typing import NamedTuple

from watchdogd.linux.procs import read_stat

__all__ = [
    "CgroupCell",
    "JobCgroup",
    "Stale",
    "open_job_cgroup",
    "remove_stale",
    "sweep_stale",
    "v2_mount",
]

_JOB = re.compile(r"watchdogd-(\d+)-(\d+)")


def v2_mount(mountinfo: str) -> str | None:
    """The first read-write cgroup2 mount point in ``mountinfo``'s text, if any."""
    for line in mountinfo.splitlines():
        fields = line.split()
        if " - " not in line or len(fields) < 6:
            continue
        after = line.split(" - ", 1)[1].split()
        if after[0] == "cgroup2" and "rw" in fields[5].split(","):
            return fields[4].replace("\\040", " ")
    return None


def _own_cgroup() -> str:
    """This process's cgroup in the v2 hierarchy (``0::/path``)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise OSError("no cgroup v2 line in /proc/self/cgroup")


def _base() -> Path:
    """The daemon's own v2 cgroup directory; OSError naming why there is none."""
    mount = v2_mount(Path("/proc/self/mountinfo").read_text())
    if mount is None:
        raise OSError("no read-write cgroup2 mount in /proc/self/mountinfo")
    return Path(mount + _own_cgroup().rstrip("/"))


def _populated(path: Path) -> bool:
    try:
        return "populated 1" in (path / "cgroup.events").read_text()
    except FileNotFoundError:
        return False


def _members(path: Path) -> list[int]:
    """Every pid in ``path`` and below."""
    pids: list[int] = []
    for directory, _, _ in os.walk(path):
        with contextlib.suppress(FileNotFoundError):
            pids += [int(p) for p in Path(directory, "cgroup.procs").read_text().split()]
    return pids


def _kill(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):  # removed: nothing in it
        (path / "cgroup.kill").write_text("1")


def _remove(path: Path) -> None:
    """``path`` and the cgroups below it, the deepest first (each must be empty)."""
    for directory, _, _ in sorted(os.walk(path), key=lambda d: -d[0].count("/")):
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(directory)


class CgroupCell:
    """One child's cgroup: it and everything it starts."""

    memory = None  # none of its own: groups.cell_memory adds one

    def __init__(self, path: Path) -> None:
        self.path = path
        self.procs: tuple[str, ...] = (str(path / "cgroup.procs"),)

    def bind(self, pid: int) -> None:
        """The child is ``pid`` (it placed itself: nothing to do)."""

    def kill(self) -> None:
        """SIGKILL every process in it, whatever session each made."""
        _kill(self.path)

    def alive(self) -> list[int]:
        """The pids still in it (none once ``populated 0``)."""
        return _members(self.path) if _populated(self.path) else []

    def remove(self) -> None:
        """rmdir, once empty (a cgroup with processes stays, and is swept with the job)."""
        with contextlib.suppress(OSError):
            _remove(self.path)


class JobCgroup(CgroupCell):
    """This daemon's cgroup of cgroups, named for its owner."""

    def __init__(self, path: Path) -> None:
        super().__init__(path)
        self._serial = 0

    def cell(self, name: str) -> CgroupCell:
        """A new cgroup for one child (``name`` made safe, and unique with a serial)."""
        self._serial += 1
        safe = re.sub(r"[^A-Za-z0-9_-]", "_", name)
        path = self.path / f"{safe}.{self._serial}"
        path.mkdir()
        return CgroupCell(path)


def open_job_cgroup() -> JobCgroup:
    """This process's job cgroup, created (OSError naming why it cannot be)."""
    base = _base()
    start = read_stat(os.getpid()).start_time
    path = base / f"watchdogd-{os.getpid()}-{start}"
    path.mkdir()
    if not (path / "cgroup.kill").exists():
        path.rmdir()
        raise OSError("the kernel has no cgroup.kill (5.14 and later have)")
    return JobCgroup(path)


class Stale(NamedTuple):
    """A job cgroup whose owner is gone, and the pids that were still in it."""

    path: str
    owner: int
    pids: list[int]


def _owner_alive(pid: int, start_time: int) -> bool:
    try:
        return read_stat(pid).start_time == start_time
    except ProcessLookupError:
        return False


def sweep_stale() -> list[Stale]:
    """Kill and remove the job cgroups beside ours whose owner is gone (none if no v2)."""
    try:
        base = _base()
        entries = list(base.iterdir())
    except OSError:
        return []
    found = []
    for entry in entries:
        match = _JOB.fullmatch(entry.name)
        if match is None or _owner_alive(int(match[1]), int(match[2])):
            continue
        pids = _members(entry)
        _kill(entry)
        found.append(Stale(str(entry), int(match[1]), pids))
    return found


def remove_stale(stale: list[Stale]) -> None:
    """rmdir what :func:`sweep_stale` killed, once empty."""
    for entry in stale:
        with contextlib.suppress(OSError):
            _remove(Path(entry.path))
