"""A worker that runs a Python callable: the child side of ``starters.CallableStarter``.

``multiprocessing`` starts it in the caller's process (``spawn`` or
``forkserver``), so the caller's functions and arguments (a ``multiprocessing``
queue among them) unpickle here, never in a daemon. It becomes a session leader
(so the group is signalled as a whole, as a command worker is), takes the
environment and the streams the runner chose, and runs the callable. Before any
of that it places itself in its rank's cgroup and asks to die with its parent
(:func:`watchdogd.linux.enter_cell.enter`); under ``spawn``, the caller's
``__main__`` was imported (as ``__mp_main__``) and the callable unpickled
before, outside it. Its return value is pickled to a file for the caller; an
exception, or a return value that cannot be pickled, goes to torch's error file
(``TORCHELASTIC_ERROR_FILE``) in torch's ``@record`` format and the worker
exits 1. Standard library only: this is every worker's start-up.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from multiprocessing import reduction
from typing import Any

from watchdogd.linux.enter_cell import enter

__all__ = ["InheritedFd", "WorkerCall", "run"]


class InheritedFd:
    """A descriptor handed to the child: duplicated into it when ``multiprocessing``
    pickles the arguments (spawn, forkserver), inherited as is under fork."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuild, (reduction.DupFd(self.fd),)


def _rebuild(duplicate: Any) -> InheritedFd:
    return InheritedFd(duplicate.detach())


class WorkerCall:
    """What one worker runs, and where it reports."""

    def __init__(
        self,
        function: Callable[..., Any],
        args: Sequence[Any],
        env: dict[str, str],
        stdout: InheritedFd | None,
        stderr: InheritedFd | None,
        result_path: str,
        cpus: frozenset[int] | None,
        procs: tuple[str, ...],
        parent: int | None,
    ) -> None:
        """``procs``: its cgroups' ``cgroup.procs``; ``parent``: the pid its parent must
        have (None: a forkserver's child, whose parent is the server)."""
        self.function = function
        self.args = tuple(args)
        self.env = env
        self.stdout = stdout
        self.stderr = stderr
        self.result_path = result_path
        self.cpus = cpus
        self.procs = procs
        self.parent = parent


def _record(error_file: str, message: str, stack: str) -> None:
    """torch's ``@record`` error file, which torch's ``ProcessFailure`` and the runner read."""
    if not error_file:
        return
    data = {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": stack, "timestamp": str(int(time.time()))},
        }
    }
    try:
        partial = f"{error_file}.partial"  # whole or absent: torch's reader raises on half
        with open(partial, "w") as f:
            json.dump(data, f)
        os.rename(partial, error_file)
    except OSError as e:
        print(f"watchdogd: cannot write the error file {error_file}: {e}", file=sys.stderr)


def run(call: WorkerCall) -> None:
    """The ``multiprocessing`` target: become the worker, run the callable, report."""
    enter(call.procs, call.parent)
    os.setsid()
    if call.cpus is not None:
        os.sched_setaffinity(0, call.cpus)
    for stream, target in ((sys.stdout, call.stdout), (sys.stderr, call.stderr)):
        if target is not None:
            stream.flush()
            os.dup2(target.fd, stream.fileno())
            os.close(target.fd)
    os.environ.clear()
    os.environ.update(call.env)
    if call.env.get("PYTHONUNBUFFERED"):  # read at start-up, before the env was the worker's
        for stream in (sys.stdout, sys.stderr):
            stream.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    error_file = call.env.get("TORCHELASTIC_ERROR_FILE", "")
    try:
        result = call.function(*call.args)
    except SystemExit as e:
        if e.code not in (None, 0):
            raise  # an exit status of its own, as torch's @record leaves it
        result = None  # sys.exit() from the function: it returned, with nothing
    except Exception as e:
        _record(error_file, f"{type(e).__name__}: {e}", traceback.format_exc())
        raise
    rank = call.env.get("LOCAL_RANK", "?")
    try:
        data = pickle.dumps(result)
    except Exception as e:
        message = (
            f"the return value of local rank {rank} cannot be pickled: {type(e).__name__}: {e}"
        )
        _record(error_file, message, traceback.format_exc())
        print(f"watchdogd: {message}", file=sys.stderr, flush=True)
        sys.exit(1)
    partial = call.result_path + ".partial"
    with open(partial, "wb") as f:
        f.write(data)
    os.rename(partial, call.result_path)
