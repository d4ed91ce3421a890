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
    <own cgroup>/watchdogd-daemon/               the daemon, if it was alone in its cgroup

The owner's pid and start time are in the job cgroup's name (cgroupfs
takes no plain files), so a later daemon tells a cgroup whose owner is gone
(:func:`sweep_stale`) from one whose owner runs; an owner outside the
initial pid namespace adds its namespace (``-ns<inode>``), and only jobs
of the sweeper's own namespace are judged (daemons in a container and on
its host may share a cgroup). A cgroup with processes
cannot enable a controller for its children (the no-internal-processes
rule), so a daemon alone in its cgroup (a systemd unit's) whose memory
controller is offered but not enabled moves into a leaf of its own first
and enables ``memory`` for the job (:func:`leave_for_leaf`); one that
shares its cgroup (a shell's, under ``watchdogd run``) stays in it, and its
cells get no v2 memory controller.

``cgroup.kill`` (kernel 5.14) kills every process of a cgroup and of those
below, whatever session or process group it made; ``cgroup.events`` says
``populated 0`` once they have all exited, and inotify tells when it
changed (:func:`until_empty` waits so, re-reading it ever less often).

A child moving into its cell takes the kernel's lock for moving processes
between cgroups (``cgroup_threadgroup_rwsem``), which first waits for an RCU
grace period (8-14 ms on the development machine) when nobody took it for a
while, holding ``cgroup_mutex`` meanwhile, which every mkdir, rmdir and
``cgroup.kill`` takes too. So a job's writes run in a thread of their own
(:class:`_Writer`), never on the event loop; and a killed cell, which means
an attempt ended and new children will soon move, also takes that lock
once there, while the last attempt is being stopped: the new children then
wait only what is left of that grace period. (A host whose cgroup2 is
mounted with ``favordynmods`` never makes a mover wait.)
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import queue
import re
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import NamedTuple, Protocol

import anyio

from watchdogd.linux import keeper
from watchdogd.linux.procs import read_stat, still_runs

__all__ = [
    "DAEMON_LEAF",
    "CgroupCell",
    "JobCgroup",
    "Stale",
    "cell_name",
    "job_base",
    "leave_for_leaf",
    "open_job_cgroup",
    "remove_stale",
    "sweep_stale",
    "until_empty",
    "v2_mount",
]

log = logging.getLogger("watchdogd.supervisor")

_IN_MODIFY = 0x2
_FIRST_RECHECK = 0.001
_RECHECK = 0.1
"""Reads of ``cgroup.events`` while waiting, at most this far apart, from 1 ms on: the kernel
announces a change through a work queue (~3 ms late on a loaded machine) and at most every
20 ms per file, while a killed process is mostly gone in well under 1 ms."""
_KEEPER_STOP_TIMEOUT = 1.0

_JOB = re.compile(r"watchdogd-(\d+)-(\d+)(?:-ns(\d+))?(?:\.\d+)?")
_INITIAL_PID_NAMESPACE = 0xEFFFFFFC
"""The initial pid namespace's inode number (the kernel's ``PROC_PID_INIT_INO``)."""
_jobs = itertools.count(1)

DAEMON_LEAF = "watchdogd-daemon"
"""The leaf a daemon alone in its cgroup moves into, so that the cgroup may give its job
cgroup, beside the leaf, the memory controller (:func:`leave_for_leaf`)."""


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


def _mount_and_own() -> tuple[Path, Path]:
    """The v2 mount point, and this process's cgroup directory in it; OSError naming why
    there is none."""
    mount = v2_mount(Path("/proc/self/mountinfo").read_text())
    if mount is None:
        raise OSError("no read-write cgroup2 mount in /proc/self/mountinfo")
    return Path(mount), Path(mount + _own_cgroup().rstrip("/"))


def _base() -> Path:
    """Where job cgroups go (:func:`job_base`); OSError naming why there is none."""
    return job_base(_mount_and_own()[1])


def job_base(own: Path) -> Path:
    """Where the job cgroups of a daemon in cgroup ``own`` go: ``own``, or the cgroup it
    left for its leaf (:func:`leave_for_leaf`)."""
    return own.parent if own.name == DAEMON_LEAF else own


def leave_for_leaf(own: Path, mount: Path, pid: int, controller: str = "memory") -> Path | None:
    """Move process ``pid``, alone in its cgroup ``own``, into a leaf below it
    (:data:`DAEMON_LEAF`), and enable ``controller`` for ``own``'s children: the leaf
    made, or None when nothing was to be done or may be (the controller not offered,
    enabled already, ``own`` the root, which may enable controllers with processes in
    it, or other processes in ``own``, which are not this daemon's to move).

    A cgroup with processes cannot enable a controller for its children (the
    no-internal-processes rule): a daemon in its unit's delegated cgroup
    (``Delegate=yes``) holds that cgroup, so its job cgroup, beside it, would have
    no memory controller."""
    if own == mount or controller not in (own / "cgroup.controllers").read_text().split():
        return None
    if controller in (own / "cgroup.subtree_control").read_text().split():
        return None
    if (own / "cgroup.procs").read_text().split() != [str(pid)]:
        return None
    leaf = own / DAEMON_LEAF
    leaf.mkdir(exist_ok=True)
    (leaf / "cgroup.procs").write_text(str(pid))  # all its threads with it
    (own / "cgroup.subtree_control").write_text(f"+{controller}")
    return leaf


def _populated(path: Path) -> bool:
    try:
        return "populated 1" in (path / "cgroup.events").read_text()
    except FileNotFoundError:
        return False


def members(path: Path) -> list[int]:
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


def cell_name(name: str, serial: Iterator[int]) -> str:
    """A cell's directory name: ``name`` made safe, and unique with the next of ``serial``
    (an ``itertools.count``, safe to draw from any thread)."""
    return f"{re.sub(r'[^A-Za-z0-9_-]', '_', name)}.{next(serial)}"


def _at_once(write: Callable[[], None]) -> None:
    write()


class CgroupCell:
    """One child's cgroup: it and everything it starts.

    ``write(op)`` runs its kill and its removal (at once, or handed to a
    thread: :class:`_Writer`); ``killed()`` follows each kill.
    """

    memory = None  # none of its own: groups.cell_memory adds one

    def __init__(
        self,
        path: Path,
        write: Callable[[Callable[[], None]], None] = _at_once,
        killed: Callable[[], None] = lambda: None,
    ) -> None:
        self.path = path
        self.procs: tuple[str, ...] = (str(path / "cgroup.procs"),)
        self.write = write
        """Runs a write that takes ``cgroup_mutex`` (its own, and others' to follow them)."""
        self._killed = killed

    def bind(self, pid: int) -> None:
        """The child is ``pid`` (it placed itself: nothing to do)."""

    def kill(self) -> None:
        """SIGKILL every process in it, whatever session each made."""
        self.write(partial(_kill, self.path))
        self._killed()

    def alive(self) -> list[int]:
        """The pids still in it (none once ``populated 0``)."""
        return members(self.path) if _populated(self.path) else []

    def remove(self) -> None:
        """rmdir, once empty (a cgroup with processes stays, and is swept with the job)."""
        self.write(partial(_remove_quietly, self.path))


def _remove_quietly(path: Path) -> None:
    with contextlib.suppress(OSError):
        _remove(path)


class _Writer:
    """A thread for the cgroup writes of a running job: kills, removals, warm-ups.

    Each takes the kernel's ``cgroup_mutex``, which a child moving into its
    cell holds while it waits out the grace period: from the event loop, a
    kill or an rmdir beside a restart's placements would stall the loop that
    long. In order, one at a time; an error is the kernel's word that there
    was nothing to do (gone, or not empty yet). :meth:`warm` moves this
    process into the cgroup it already is in (``procs``): a move that changes
    nothing, but takes the lock and so pays its grace period, once per burst
    of kills.
    """

    def __init__(self, procs: Path) -> None:
        self.procs = procs
        self._ops: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._warm_queued = False
        self._thread = threading.Thread(target=self._run, name="watchdogd-cgroups", daemon=True)
        self._thread.start()

    def __call__(self, op: Callable[[], None]) -> None:
        self._ops.put(op)

    def warm(self) -> None:
        if not self._warm_queued:
            self._warm_queued = True
            self._ops.put(self._move_self)

    def _move_self(self) -> None:
        self._warm_queued = False
        with open(self.procs, "w") as f:
            f.write("0")

    def _run(self) -> None:
        while (op := self._ops.get()) is not None:
            with contextlib.suppress(OSError):
                op()

    def close(self, timeout: float) -> None:
        """Run what is queued, then stop (bounded)."""
        self._ops.put(None)
        self._thread.join(timeout)


class JobCgroup:
    """This daemon's cgroup of cgroups, named for its owner, with its keeper."""

    mode = "cgroup"

    def __init__(self, path: Path, own: Path) -> None:
        """``path``: the job cgroup; ``own``: the cgroup this process is in."""
        self.path = path
        self._serial = itertools.count(1)
        self._writer = _Writer(own / "cgroup.procs")
        self._keeper: subprocess.Popen[bytes] | None = None

    def describe(self) -> str:
        return f"cgroup v2 per worker, under {self.path}"

    def cell(self, name: str) -> CgroupCell:
        """A new cgroup for one child (``name`` made safe, and unique with a serial); from
        any thread."""
        path = self.path / cell_name(name, self._serial)
        path.mkdir()
        return CgroupCell(path, self._writer, self._writer.warm)

    async def settle(self, cells: Sequence[Cell]) -> None:
        """Kill what is left in ``cells`` and wait until they are empty (cancel to bound it;
        the cells stay, for the caller to remove once empty)."""
        await until_empty(cells)

    async def alive(self, cells: Sequence[Cell]) -> list[int]:
        """The pids still running in ``cells``."""
        return [pid for cell in cells for pid in cell.alive()]

    def start_keeper(self, memory_dirs: Sequence[Path] = ()) -> None:
        """The keeper (:mod:`watchdogd.linux.keeper`): kills the job if this process dies,
        and removes it and ``memory_dirs`` (the job's v1 memory cgroups) once empty."""
        dirs = [str(self.path), *map(str, memory_dirs)]
        self._keeper = subprocess.Popen(
            [sys.executable, "-I", "-S", keeper.__file__, str(os.getpid()), *dirs],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )

    def close(self) -> None:
        """This process ends its job itself: the keeper stands down (bounded: one that does
        not is killed), the job cgroup goes once empty."""
        self._writer.close(_KEEPER_STOP_TIMEOUT)
        keeper_process, self._keeper = self._keeper, None
        if keeper_process is not None and keeper_process.stdin is not None:
            try:
                keeper_process.stdin.write(b"stop\n")
                keeper_process.stdin.close()
            except OSError:
                pass
            try:
                keeper_process.wait(_KEEPER_STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                log.warning(
                    "the containment keeper (pid %d) did not stop: killed", keeper_process.pid
                )
                keeper_process.kill()
                keeper_process.wait()
        with contextlib.suppress(OSError):
            _remove(self.path)


class Cell(Protocol):
    """What :func:`until_empty` needs of a cell (``groups.child.Cell`` has it)."""

    procs: tuple[str, ...]
    """Its ``cgroup.procs`` files, its v2 cell's first."""

    def kill(self) -> None: ...

    def alive(self) -> list[int]: ...


class _Changes:
    """inotify on some cells' ``cgroup.events``: readable once one of them changed."""

    def __init__(self, cells: Sequence[Cell]) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"inotify_init1: {os.strerror(errno)}")
        for cell in cells:
            if cell.procs:
                events = os.path.join(os.path.dirname(cell.procs[0]), "cgroup.events")
                # A cell gone already (-1, ENOENT) has nothing left to announce.
                libc.inotify_add_watch(self.fd, os.fsencode(events), _IN_MODIFY)

    async def wait(self) -> None:
        """Until one of them changed."""
        await anyio.wait_readable(self.fd)
        with contextlib.suppress(BlockingIOError):
            while os.read(self.fd, 4096):
                pass

    def close(self) -> None:
        os.close(self.fd)


async def until_empty(cells: Sequence[Cell]) -> None:
    """Kill what is left in ``cells`` and wait until none of it runs (cancel to bound it).

    Cells already empty (the common case: each was killed as its child exited)
    cost one read each, and no wait.
    """
    if not _kill_left(cells):
        return
    changes = _Changes(cells)
    try:
        left = _kill_left(cells)  # again, now that every change is seen
        recheck = _FIRST_RECHECK
        while left:
            with anyio.move_on_after(recheck):
                await changes.wait()
            recheck = min(recheck * 2, _RECHECK)
            left = [pid for cell in cells for pid in cell.alive()]
    finally:
        changes.close()


def _kill_left(cells: Sequence[Cell]) -> list[int]:
    """Kill each cell that still has processes: their pids."""
    left = []
    for cell in cells:
        alive = cell.alive()
        if alive:
            cell.kill()
            left += alive
    return left


def _pid_namespace() -> int:
    """The inode of this process's pid namespace, whose numbers its pids are."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return _INITIAL_PID_NAMESPACE


def job_name() -> str:
    """A new job cgroup's name: its owner's pid and start time (:func:`owner_gone`), the
    owner's pid namespace unless it is the initial one (``-ns<inode>``: the pid is that
    namespace's), and a serial (one process may run jobs one after another: a launch
    API's callers do)."""
    namespace = _pid_namespace()
    where = "" if namespace == _INITIAL_PID_NAMESPACE else f"-ns{namespace}"
    return f"watchdogd-{os.getpid()}-{read_stat(os.getpid()).start_time}{where}.{next(_jobs)}"


def open_job_cgroup() -> JobCgroup:
    """This process's job cgroup, created (OSError naming why it cannot be); a daemon
    alone in its cgroup first moves into a leaf of it (:func:`leave_for_leaf`)."""
    mount, own = _mount_and_own()
    if own.name != DAEMON_LEAF:
        with contextlib.suppress(OSError):  # no memory controller for its cells, then
            own = leave_for_leaf(own, mount, os.getpid()) or own
    path = job_base(own) / job_name()
    path.mkdir()
    if not (path / "cgroup.kill").exists():
        path.rmdir()
        raise OSError("the kernel has no cgroup.kill (5.14 and later have)")
    return JobCgroup(path, own)


class Stale(NamedTuple):
    """A job cgroup whose owner is gone, and the pids that were still in it."""

    path: str
    owner: int
    pids: list[int]


def owner_gone(name: str) -> int | None:
    """The owner's pid of a job cgroup named ``name`` whose owner is gone (else None). An
    owner in another pid namespace is never judged gone: its pid means nothing here, and
    daemons in different namespaces may share a cgroup (a container on the host's)."""
    match = _JOB.fullmatch(name)
    if match is None:
        return None
    namespace = int(match[3]) if match[3] else _INITIAL_PID_NAMESPACE
    if namespace != _pid_namespace() or still_runs(int(match[1]), int(match[2])):
        return None
    return int(match[1])


def stale_jobs(where: Callable[[], Path]) -> list[tuple[Path, int]]:
    """The job cgroups in ``where()`` whose owner is gone, with the owner's pid (none if
    ``where`` cannot be read)."""
    try:
        entries = list(where().iterdir())
    except OSError:
        return []
    return [
        (entry, owner)
        for entry in entries
        if (owner := owner_gone(entry.name)) is not None and entry.is_dir()
    ]


def sweep_stale() -> list[Stale]:
    """Kill and remove the job cgroups beside ours whose owner is gone (none if no v2)."""
    found = []
    for entry, owner in stale_jobs(_base):
        pids = members(entry)
        _kill(entry)
        found.append(Stale(str(entry), owner, pids))
    return found


def remove_stale(stale: list[Stale]) -> None:
    """rmdir what :func:`sweep_stale` killed, once empty."""
    for entry in stale:
        with contextlib.suppress(OSError):
            _remove(Path(entry.path))
