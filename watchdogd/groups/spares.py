"""Warm spares: one interpreter per local rank, its heavy imports done, waiting to be a worker.

A group with ``prewarm = ["torch", …]`` keeps one spare per local rank
(:mod:`watchdogd.groups.spare` is the spare's side). A spare is started
with the rank-stable part of the worker's environment (its local rank,
GPUs, CPUs, the timer endpoints, the user's variables) and imports the
listed modules; when an attempt starts, :meth:`SparePool.start` hands it
the attempt's environment and the worker's streams and it becomes the
worker, so a restart does not pay the imports again. A consumed spare is
replaced in the background once the attempt that took it is at work
(:meth:`SparePool.at_work`: every rank released a timer or reported a
step), or :data:`REFILL_HOLD` seconds after the handover for a group that
never says so: a restarted worker's own start (its process group's
connections, its data loaders) does not share the CPUs with the imports
of its replacements. As root, replacements warm up at the lowest CPU
priority (nice 19) and are put back at the workers' priority when assigned
(an unprivileged daemon could not raise their priority back, so its spares
warm up at its own). Nice alone is not enough: it lowers the spares' share
of the CPUs, not the wait of a woken worker, and a process group's start
is many short round trips between ranks, each a wake-up that may wait out
a spare's time slice on a busy core; nor does it govern the import's page
faults and file reads. A spare that dies before it is assigned is
reported and replaced (after a pause that doubles, up to a minute, while
they keep dying). The first attempt takes the spares as they are, warm or
not yet: a worker never waits for a spare it could not have started faster
itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable

import anyio
import msgspec

from watchdogd.core.ports import EventSink
from watchdogd.core.workerenv import PythonCommand
from watchdogd.groups.child import Cell, ChildProcess
from watchdogd.groups.spare import Assignment, Failed, Ready, Report
from watchdogd.groups.starters import Started, WorkerStarter, substitute_local_rank
from watchdogd.groups.worker_logs import Target, child_stream
from watchdogd.linux import aio
from watchdogd.linux.numa import bound_to
from watchdogd.linux.priority import worker_priority
from watchdogd.linux.procs import read_rss
from watchdogd.linux.proctitle import room
from watchdogd_client.framing import FrameSplitter, frame
from watchdogd_client.groups import SpareInfo

__all__ = ["REFILL_HOLD", "SparePool"]

log = logging.getLogger("watchdogd.supervisor")

_LOWEST_PRIORITY = 19
_SEND_TIMEOUT = 5.0
_MAX_BACKOFF = 60.0
REFILL_HOLD = 5.0
"""Seconds after a handover that the refill waits for the attempt to be at work: past a
process group's start on a loaded node (0.8 s in bench/bench_goodput.py's restarts, at
worst), well before most next failures."""


class _Spare:
    def __init__(
        self,
        local_rank: int,
        popen: subprocess.Popen[bytes],
        control: socket.socket,
        cell: Cell,
    ) -> None:
        self.local_rank = local_rank
        self.popen = popen
        self.child = ChildProcess(popen, cell)
        self.cell = cell
        self.control = control
        self.ready = False
        self.started = time.monotonic()
        self.ready_after: float | None = None
        """Seconds from its start to ready (its imports done); None while it warms."""
        self.failure: str | None = None
        self.splitter = FrameSplitter(1 << 16)

    def unwatch(self) -> None:
        self.child.unwatch()
        with contextlib.suppress(ValueError, OSError):
            aio.unwatch(self.control.fileno())

    def close(self) -> None:
        """Its pidfd and control socket go (idempotent: a closed socket stays closed)."""
        try:
            self.unwatch()
        finally:
            self.child.close()
            self.control.close()


class SparePool:
    """The group's spares; a :class:`WorkerStarter` that falls back to ``cold`` without one."""

    off_loop = False  # a handover is one non-blocking send; a cold start is a Popen

    def __init__(
        self,
        group: str,
        command: PythonCommand,
        modules: list[str],
        *,
        events: EventSink,
        rank_env: Callable[[int], dict[str, str]],
        cwd: str | None,
        cold: WorkerStarter,
        cells: Callable[[str], Cell],
    ) -> None:
        """``cells(name)``: a new cell for a spare."""
        self.group = group
        self.command = command
        self.modules = modules
        self.events = events
        self.rank_env = rank_env
        self.cwd = cwd
        self.cold = cold
        self.cells = cells
        self.nproc = 0
        self.cpus: dict[int, frozenset[int]] | None = None
        self.spares: dict[int, _Spare] = {}
        self._backoff: dict[int, float] = {}
        self._not_before: dict[int, float] = {}
        self._wanted = anyio.Event()
        self._closed = False
        self._root = os.geteuid() == 0
        self._refill_since: float | None = None
        """When the first spare was taken since every rank last had a ready one."""
        self._held_until: float | None = None
        """Until when consumed spares wait to be replaced (None: replaced as asked)."""

    # -- keeping them ready -------------------------------------------------------------

    def fill(self, nproc: int, cpus: dict[int, frozenset[int]] | None) -> None:
        """Start a spare for each local rank that has none (and is not pausing after deaths)."""
        self.nproc, self.cpus = nproc, cpus
        now = time.monotonic()
        for local_rank in range(nproc):
            if local_rank in self.spares or self._closed:
                continue
            if self._not_before.get(local_rank, 0.0) > now:
                continue
            self._not_before.pop(local_rank, None)
            try:
                self.spares[local_rank] = self._start_spare(local_rank)
            except OSError as e:
                reason = f"cannot start {self.command.python!r}: {e.strerror}"
                self.events.emit(
                    "spare_failed", group=self.group, local_rank=local_rank, reason=reason
                )
                self._pause(local_rank)

    async def keep_ready(self) -> None:
        """Replace consumed and dead spares, in the background, for the group's life."""
        while not self._closed:
            with anyio.move_on_after(self._next_wake()):
                await self._wanted.wait()
            self._wanted = anyio.Event()
            if self._held_until is not None and time.monotonic() >= self._held_until:
                self._held_until = None  # the attempt never said it is at work
            if self.nproc and self._held_until is None:
                self.fill(self.nproc, self.cpus)

    def at_work(self) -> None:
        """Every rank of the attempt that took the spares is at work: replace them now."""
        self._held_until = None
        self._wanted.set()

    def _next_wake(self) -> float:
        """Seconds until a paused rank may get a spare again, or the refill's hold ends
        (inf: neither)."""
        now = time.monotonic()
        times = [*self._not_before.values(), self._held_until]
        pending = [t - now for t in times if t is not None and t > now]
        return min(pending) if pending else float("inf")

    def _pause(self, local_rank: int) -> None:
        backoff = min(self._backoff.get(local_rank, 0.5) * 2, _MAX_BACKOFF)
        self._backoff[local_rank] = backoff
        self._not_before[local_rank] = time.monotonic() + backoff
        self._wanted.set()

    def _command_line(self, local_rank: int) -> list[str]:
        """What ``ps`` shows of the rank's worker started fresh, and of one from a spare."""
        return substitute_local_rank(self.command.command_line(), local_rank)

    def _start_spare(self, local_rank: int) -> _Spare:
        cell = self.cells(f"spare{local_rank}")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        command = [
            self.command.python,
            *self.command.options,
            "-m",
            "watchdogd.groups.spare",
            str(theirs.fileno()),
            str(os.getpid()),
            *cell.procs,
            "--",
            *self.modules,
            room(self._command_line(local_rank)),  # to show the worker's line in, later
        ]
        cpus = self.cpus.get(local_rank) if self.cpus is not None else None
        try:
            with bound_to(cpus):
                popen = subprocess.Popen(
                    command,
                    env=self.rank_env(local_rank),
                    cwd=self.cwd,
                    stdin=subprocess.DEVNULL,
                    stdout=sys.stderr.fileno(),  # an import's warnings, until it is a worker
                    pass_fds=(theirs.fileno(),),
                    start_new_session=True,
                )
        except BaseException:
            ours.close()
            cell.remove()
            raise
        finally:
            theirs.close()
        if self._root:
            _renice(popen.pid, _LOWEST_PRIORITY)
        ours.setblocking(False)
        spare = _Spare(local_rank, popen, ours, cell)
        aio.watch_readable(spare.control.fileno(), lambda: self._on_report(spare))
        spare.child.watch(lambda: self._on_exit(spare))
        return spare

    def _on_report(self, spare: _Spare) -> None:
        try:
            data = spare.control.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            aio.unwatch(spare.control.fileno())  # it exited: the pidfd tells
            return
        for payload in spare.splitter.feed(data):
            report = msgspec.msgpack.decode(payload, type=Report)
            if isinstance(report, Ready):
                spare.ready = True
                spare.ready_after = time.monotonic() - spare.started
                self._backoff.pop(spare.local_rank, None)
                self.events.emit_at(logging.DEBUG, "spare_ready", group=self.group,
                                    local_rank=spare.local_rank, pid=spare.popen.pid,
                                    after_s=round(spare.ready_after, 3))  # fmt: skip
                self._check_refilled()
            elif isinstance(report, Failed):
                spare.failure = report.message
                spare.child.kill_group()  # its exit is reported

    def _check_refilled(self) -> None:
        """Once every rank has a ready spare again after some were taken: how long the
        pool took (a restart before then starts some workers cold)."""
        if self._refill_since is None or not self.nproc:
            return
        if all(r in self.spares and self.spares[r].ready for r in range(self.nproc)):
            after = time.monotonic() - self._refill_since
            self._refill_since = None
            self.events.emit("spares_refilled", group=self.group, after_s=round(after, 3))

    @staticmethod
    def _reap(spare: _Spare) -> None:
        spare.close()
        spare.child.kill_group()  # what it started while warming up
        spare.child.wait()
        spare.cell.remove()

    def _on_exit(self, spare: _Spare) -> None:
        if self.spares.get(spare.local_rank) is not spare:
            return
        del self.spares[spare.local_rank]
        self._reap(spare)
        status = spare.popen.returncode
        if self._closed:
            return
        self.events.emit("spare_died", group=self.group, local_rank=spare.local_rank,
                         pid=spare.popen.pid, exitcode=status,
                         reason=spare.failure or "exited before it was assigned")  # fmt: skip
        self._pause(spare.local_rank)

    # -- handing one over --------------------------------------------------------------

    def start(
        self,
        local_rank: int,
        attempt: int,
        env: dict[str, str],
        streams: tuple[Target, Target],
        cpus: frozenset[int] | None,
        cell: Cell,
    ) -> Started:
        spare = self.spares.pop(local_rank, None)
        self._held_until = time.monotonic() + REFILL_HOLD  # its replacement: see at_work
        self._wanted.set()
        if self._refill_since is None:
            self._refill_since = time.monotonic()
        if spare is None or spare.popen.poll() is not None:
            if spare is not None:
                self._reap(spare)
            return self.cold.start(local_rank, attempt, env, streams, cpus, cell)
        spare.unwatch()
        ends: list[tuple[int | None, int | None]] = []
        try:
            for target, console in zip(streams, (1, 2), strict=True):
                ends.append(child_stream(target, console))
            assignment = Assignment(
                env=env,
                argv=[self.command.target, *substitute_local_rank(self.command.args, local_rank)],
                mode=self.command.mode,
                target=self.command.target,
                command_line=self._command_line(local_rank),
            )
            data = frame(msgspec.msgpack.encode(assignment))
            # Never waits: a socket buffer holds far more than an assignment, so one
            # that does not fit at once means a spare gone wrong.
            fds = [theirs for _, theirs in ends if theirs is not None]  # both: a console is given
            if socket.send_fds(spare.control, [data], fds) < len(data):
                raise BlockingIOError("the spare takes no more")
        except OSError:
            # It died on the way, or stopped reading: let it go, start a fresh worker.
            for ours, _ in ends:
                if ours is not None:
                    os.close(ours)
            spare.child.kill_group()
            spare.child.watch(lambda: self._reap(spare))
            return self.cold.start(local_rank, attempt, env, streams, cpus, cell)
        finally:
            for _, theirs in ends:
                if theirs is not None:
                    os.close(theirs)
        if self._root:
            _renice(spare.popen.pid, worker_priority())
        spare.close()  # a worker now: the runner pins it, in the spare's cell
        cell.remove()
        return Started(spare.popen, ends[0][0], ends[1][0], spare.cell)

    # -- seeing and stopping them ------------------------------------------------------

    def infos(self) -> list[SpareInfo]:
        return [
            SpareInfo(
                local_rank=spare.local_rank,
                pid=spare.popen.pid,
                ready=spare.ready,
                ready_after_s=spare.ready_after,
                rss_bytes=read_rss(spare.popen.pid),
            )
            for spare in sorted(self.spares.values(), key=lambda s: s.local_rank)
        ]

    async def aclose(self) -> None:
        """Kill every spare and reap it (bounded: one stuck in D state is left to the kernel)."""
        self._closed = True
        self._wanted.set()
        spares, self.spares = list(self.spares.values()), {}
        for spare in spares:
            spare.unwatch()
            spare.child.kill_group()
        for spare in spares:
            with anyio.move_on_after(2.0):
                await anyio.wait_readable(spare.child.pidfd)
            spare.close()
            spare.cell.remove()
            if spare.child.let_go() is None:
                log.warning("spare pid %d did not exit after SIGKILL; left behind", spare.popen.pid)


def _renice(pid: int, priority: int) -> None:
    """Every thread of ``pid`` (a nice value is a thread's), as far as it is still there."""
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, int(task), priority)
