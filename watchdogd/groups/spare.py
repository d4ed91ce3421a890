"""A warm spare: an interpreter that imported a group's heavy modules and waits to be a worker.

Run as ``PYTHON [-u …] -m watchdogd.groups.spare CONTROL_FD PARENT [PROCS…] --
MODULE… ROOM`` by the daemon (:mod:`watchdogd.groups.spares`), with the rank-stable
part of the worker's environment. It first places itself in its own cgroups
(each ``PROCS``, none in the fallback; memory stays charged where a page was first
touched, so a spare is born where its worker will run) and asks to die with its
parent (:func:`~watchdogd.linux.enter_cell.enter`). It imports each ``MODULE``
(``torch`` …), says :class:`Ready` on its control socket, and waits. No user
code runs before the assignment: the :class:`Assignment` (the attempt's whole
environment, ``argv``, the script or module) comes with the worker's stdout and
stderr as descriptors. The spare then becomes the worker as ``python script.py
args`` or ``python -m module args`` would start: ``os.environ``, ``sys.argv``,
``sys.path[0]``, a fresh ``__main__`` (``__name__``, ``__file__``), the
streams; it already leads a session of its own. It also shows the worker's
command line (``ps``, ``pgrep -f train.py``), written over its own in place
(:mod:`watchdogd.linux.proctitle`): ``ROOM``, a last argument of blanks,
made its own line long enough.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib
import os
import runpy
import socket
import sys
import types
from importlib.machinery import SourceFileLoader
from typing import Literal

import msgspec

from watchdogd.linux.enter_cell import enter
from watchdogd.linux.proctitle import show_command_line
from watchdogd_client.framing import FrameSplitter, frame

__all__ = ["MAX_ASSIGNMENT", "Assignment", "Failed", "Ready", "Report"]

MAX_ASSIGNMENT = 1 << 24


class Assignment(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Become this worker (sent with two descriptors: its stdout and stderr)."""

    env: dict[str, str]
    argv: list[str]
    """``sys.argv`` as a fresh interpreter has it (``script args`` / ``module args``)."""
    mode: Literal["script", "module"]
    target: str
    """The script's path (as given) or the module's name."""
    command_line: list[str]
    """What ``ps`` shows of the worker started fresh: ``PYTHON [-u …] script args``."""


class Ready(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """The modules are imported; the spare waits for its :class:`Assignment`."""


class Failed(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """A module could not be imported: the daemon lets this spare go."""

    message: str


Report = Ready | Failed


def _receive(control: socket.socket) -> tuple[Assignment, list[int]]:
    splitter = FrameSplitter(MAX_ASSIGNMENT)
    descriptors: list[int] = []
    while True:
        data, fds, _, _ = socket.recv_fds(control, 1 << 16, 2)
        descriptors += fds
        if not data:
            sys.exit(0)  # the daemon is gone, or let this spare go: nothing to become
        for payload in splitter.feed(data):
            return msgspec.msgpack.decode(payload, type=Assignment), descriptors


def _run_script(path: str) -> None:
    """As the interpreter runs ``python path``: a fresh ``__main__``, ``sys.path[0]`` its dir."""
    absolute = os.path.abspath(path)
    sys.path[0] = os.path.dirname(absolute)
    main = types.ModuleType("__main__")
    main.__file__ = absolute
    main.__cached__ = None  # type: ignore[attr-defined]
    main.__loader__ = SourceFileLoader("__main__", absolute)
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    with open(absolute, "rb") as f:
        code = compile(f.read(), absolute, "exec")
    exec(code, main.__dict__)


def _run_module(name: str) -> None:
    """As the interpreter runs ``python -m name``: its own runpy entry, on a fresh ``__main__``."""
    sys.path[0] = os.getcwd()
    main = types.ModuleType("__main__")
    main.__builtins__ = builtins  # type: ignore[attr-defined]
    sys.modules["__main__"] = main
    runpy._run_module_as_main(name)  # type: ignore[attr-defined]


def _user_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    """The traceback from the first frame of the user's code on (this module and runpy dropped)."""
    skipped = {__file__, runpy.__file__}
    while tb is not None and tb.tb_frame.f_code.co_filename in skipped:
        tb = tb.tb_next
    return tb


def main() -> None:
    split = sys.argv.index("--")
    enter(tuple(sys.argv[3:split]), int(sys.argv[2]))
    control = socket.socket(fileno=int(sys.argv[1]))
    modules = sys.argv[split + 1 : -1]  # the last is ROOM
    report: Report = Ready()
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as e:  # their code: anything may happen in it
            report = Failed(message=f"import {name}: {type(e).__name__}: {e}")
            break
    # Assigned before it was ready, the daemon no longer listens: the assignment waits,
    # and is carried out even after a failed import (the user's code imports what it needs).
    with contextlib.suppress(BrokenPipeError):
        control.sendall(frame(msgspec.msgpack.encode(report)))
    assignment, (stdout, stderr) = _receive(control)
    control.close()
    for stream, fd in ((sys.stdout, stdout), (sys.stderr, stderr)):
        stream.flush()
        os.dup2(fd, stream.fileno())
        os.close(fd)
    os.environ.clear()
    os.environ.update(assignment.env)
    sys.argv = list(assignment.argv)
    show_command_line(assignment.command_line)
    try:
        if assignment.mode == "script":
            _run_script(assignment.target)
        else:
            _run_module(assignment.target)
    except SystemExit:
        raise
    except BaseException as e:
        sys.excepthook(type(e), e, _user_frames(e.__traceback__))
        sys.exit(1)


if __name__ == "__main__":
    main()
