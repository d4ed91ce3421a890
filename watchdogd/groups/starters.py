"""How a group's workers come to be: a command (``Popen``) or a Python callable
(``multiprocessing``, in the caller's process).

The runner hands a starter each worker's environment and opened streams and
gets back a :class:`WorkerProcess`; exits, signals, timers, dumps and
restarts are the runner's and the same for both.
"""

from __future__ import annotations

import errno
import multiprocessing
import os
import shutil
import subprocess
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from string import Template
from typing import Any, NamedTuple, Protocol

from watchdogd.core.ports import GroupError
from watchdogd.groups.callable_worker import InheritedFd, WorkerCall, run
from watchdogd.groups.child import Cell, WorkerProcess
from watchdogd.groups.worker_logs import Target, child_stream
from watchdogd.linux.enter_cell import shim_command
from watchdogd.linux.numa import bound_to
from watchdogd_client.groups import GroupSpec

__all__ = [
    "CallableStarter",
    "CommandStarter",
    "Started",
    "WorkerProcess",
    "WorkerStarter",
    "substitute_local_rank",
]

START_METHODS = ("spawn", "forkserver", "fork")


class Started(NamedTuple):
    process: WorkerProcess
    stdout: int | None
    """The read end of its stdout pipe when the stream is piped (the runner's now)."""
    stderr: int | None
    cell: Cell
    """Where it runs: the cell it was given, or a spare's own."""


class WorkerStarter(Protocol):
    off_loop: bool
    """:meth:`start` blocks: call it from a thread (else it is quick, and on the loop)."""

    def start(
        self,
        local_rank: int,
        attempt: int,
        env: dict[str, str],
        streams: tuple[Target, Target],
        cpus: frozenset[int] | None,
        cell: Cell,
    ) -> Started:
        """Start one worker in ``cell`` (OSError when it cannot be); ``streams`` stay the
        caller's. The thread that calls this forks the worker, whose parent-death signal
        fires when that thread ends: it must live as long as the group."""
        ...


def substitute_local_rank(args: Sequence[Any], local_rank: int) -> list[Any]:
    """``${local_rank}`` in each string argument, as torch's agent substitutes it."""
    return [
        Template(arg).safe_substitute(local_rank=str(local_rank)) if isinstance(arg, str) else arg
        for arg in args
    ]


def _take(pipe: Any) -> int | None:
    """``Popen``'s end of a pipe, as a descriptor of our own."""
    if pipe is None:
        return None
    fd = os.dup(pipe.fileno())
    pipe.close()
    return fd


class CommandStarter:
    """Each worker is the spec's ``entrypoint`` command, in a session of its own, started
    through the exec shim that places it in its cell (:mod:`watchdogd.linux.enter_cell`)
    from the loop's thread."""

    off_loop = False  # fork and exec: a millisecond or two

    def __init__(self, spec: GroupSpec) -> None:
        self.spec = spec

    def start(
        self,
        local_rank: int,
        attempt: int,
        env: dict[str, str],
        streams: tuple[Target, Target],
        cpus: frozenset[int] | None,
        cell: Cell,
    ) -> Started:
        argv = substitute_local_rank(self.spec.entrypoint, local_rank)
        # The shim execs the program: one it cannot find fails here, as Popen would.
        cwd = self.spec.cwd or "."
        program = argv[0] if "/" not in argv[0] else os.path.join(cwd, argv[0])
        if shutil.which(program, path=env.get("PATH", os.defpath)) is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), argv[0])
        with bound_to(cpus):
            popen = subprocess.Popen(
                shim_command(cell.procs, argv, env.get("PWD")),
                env=env,
                cwd=self.spec.cwd,
                stdin=subprocess.DEVNULL,
                stdout=streams[0].popen,
                stderr=streams[1].popen,
                start_new_session=True,
            )
        return Started(popen, _take(popen.stdout), _take(popen.stderr), cell)


class _Process:
    """A ``multiprocessing`` worker as a :class:`WorkerProcess`."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self.process = process
        self.pid: int = process.pid  # type: ignore[assignment]

    def wait(self) -> int:
        self.process.join()
        return self.process.exitcode  # type: ignore[return-value]

    def poll(self) -> int | None:
        return self.process.exitcode


class CallableStarter:
    """Each worker runs ``function(*args)`` in a process ``multiprocessing`` starts here.

    Starting one blocks (``spawn`` writes the pickled call into the child, the
    forkserver answers with its pid), so the runner calls :meth:`start` from a
    thread (``off_loop``), which hands it to the starter's own thread: the
    parent-death signal a worker sets is tied to the thread that forked it,
    and anyio's pool threads retire after 10 s idle, so the forking thread is
    one that lives until :meth:`close`, after the group. (A forkserver's
    workers are the server's children: they die with it, and it with this
    process.) The worker binds itself to its CPUs and places itself in its
    cell: a forkserver's children inherit the server's affinity, not the
    caller's. ``fork`` is
    refused: the runner's loop thread is alive in this process, and forking a
    process with threads may leave the child holding a lock forever.
    """

    def __init__(
        self,
        function: Callable[..., Any],
        args: Sequence[Any],
        start_method: str,
        result_dir: Path,
    ) -> None:
        if start_method not in START_METHODS:
            raise GroupError(f"start_method {start_method!r}: use spawn, forkserver or fork")
        if start_method == "fork":
            raise GroupError(
                "start_method 'fork': the supervisor runs a thread in this process, and a "
                "fork of a process with threads is unsafe; use 'spawn' (torch's default) "
                "or 'forkserver'"
            )
        self.function = function
        self.args = tuple(args)
        self.context: Any = multiprocessing.get_context(start_method)
        self.start_method = start_method
        self.result_dir = result_dir
        self._forker = ThreadPoolExecutor(1, thread_name_prefix="watchdogd-worker-starter")

    def close(self) -> None:
        """Once every worker is gone: the forking thread ends."""
        self._forker.shutdown()

    off_loop = True

    def result_path(self, attempt: int, local_rank: int) -> Path:
        return self.result_dir / f"attempt_{attempt}-{local_rank}.pickle"

    def start(
        self,
        local_rank: int,
        attempt: int,
        env: dict[str, str],
        streams: tuple[Target, Target],
        cpus: frozenset[int] | None,
        cell: Cell,
    ) -> Started:
        forked = self._forker.submit(self._start, local_rank, attempt, env, streams, cpus, cell)
        return forked.result()

    def _start(
        self,
        local_rank: int,
        attempt: int,
        env: dict[str, str],
        streams: tuple[Target, Target],
        cpus: frozenset[int] | None,
        cell: Cell,
    ) -> Started:
        ends: list[tuple[int | None, InheritedFd | None]] = []
        try:
            for target in streams:
                read_end, child_fd = child_stream(target, None)  # a console: inherited
                ends.append((read_end, InheritedFd(child_fd) if child_fd is not None else None))
            call = WorkerCall(
                self.function,
                substitute_local_rank(self.args, local_rank),
                env,
                ends[0][1],
                ends[1][1],
                str(self.result_path(attempt, local_rank)),
                cpus,
                cell.procs,
                os.getpid() if self.start_method == "spawn" else None,
            )
            process = self.context.Process(
                target=run, args=(call,), name=f"local rank {local_rank}"
            )
            try:
                process.start()  # spawn and forkserver pickle the call here
            except OSError:
                raise
            except Exception as e:  # an argument that cannot go (a queue of another context…)
                raise GroupError(f"the call cannot be sent to the worker: {e}") from None
        except BaseException:
            for ours, _ in ends:
                if ours is not None:
                    os.close(ours)
            raise
        finally:
            for _, theirs in ends:
                if theirs is not None:
                    os.close(theirs.fd)
        return Started(_Process(process), ends[0][0], ends[1][0], cell)
