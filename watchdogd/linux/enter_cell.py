"""The first steps of every child the daemon starts: into its rank's cgroup, dying with its parent.

A child cannot be started inside a cgroup from Python (no ``CLONE_INTO_CGROUP``
in ``subprocess``, and glibc's ``posix_spawnattr_setcgroup_np`` came in
2.39), and ``preexec_fn`` is unsafe in a process with threads. So the child
places itself, before any user code: it writes ``0`` to its cgroups'
``cgroup.procs`` (its v2 cell's, and a v1 memory cgroup's where memory is
accounted there), then asks for ``SIGKILL`` when the thread that forked it
exits (``PR_SET_PDEATHSIG``), and checks that this parent is still there,
since it may have died before the request.

A command worker goes through a native shim where util-linux's ``setpriv``
is installed (it is on Debian, util-linux being essential): ``setpriv
--pdeathsig KILL`` execs ``sh``, which checks its parent (``$PPID``, read as
it starts, after the request), writes the cgroups and execs the program.
Both start before the placement, which may wait out the kernel's grace
period (:mod:`watchdogd.linux.cgroups`): once placed, only the program's
exec is left. A second Python interpreter costs ~17 ms a worker, which
every cold restart would pay. Elsewhere this file is the shim (stdlib only,
run with ``-I -S``)::

    python -I -S enter_cell.py PARENT_PID [PROCS…] -- PROGRAM ARGS…

``PARENT_PID`` is the daemon's pid (``-``: no parent check); each ``PROCS``
a ``cgroup.procs`` file (none: no cgroup, the weaker fallback). Then it
``execvp`` s the program, which keeps both (a setuid program drops the
parent-death signal). Spares and callable workers call :func:`enter` from
project code instead, and the daemon's own helpers :func:`die_with_parent`.
This file also holds the project's one :func:`prctl` wrapper, since it must
run without the package.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys

__all__ = ["PR_SET_CHILD_SUBREAPER", "die_with_parent", "enter", "prctl", "shim_command"]

_PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36


_SETPRIV = shutil.which("setpriv")
# Run by setpriv, after the request. $1: the parent it must have (else it died before the
# request: exit as the signal would have); $2: the worker's PWD as given ("=DIR"), or -
# for none, since the shell resets PWD to its own reading at start-up and the program
# must see its environment as given (as a fresh worker under torchrun does); then the
# cgroup.procs files, up to --.
_NATIVE = (
    'p=$1 w=$2; shift 2; [ "$PPID" = "$p" ] || exit 137; '
    'while [ "$1" != -- ]; do echo 0 >"$1" || exit 126; shift; done; shift; '
    'if [ "$w" = - ]; then unset PWD; else PWD=${w#=}; export PWD; fi; '
    'exec "$@"'
)


def shim_command(procs: tuple[str, ...], argv: list[str], pwd: str | None = None) -> list[str]:
    """``argv`` run through a shim, into each ``procs``' cgroup, dying with this process's
    forking thread (natively where ``setpriv`` is, else through this file, which runs
    by path: ``-I -S`` leave no package to import). ``pwd``: the ``PWD`` of the
    environment the program is given."""
    if _SETPRIV is not None:
        given = "-" if pwd is None else f"={pwd}"
        shell = ["/bin/sh", "-c", _NATIVE, "watchdogd-shim", str(os.getpid()), given]
        return [_SETPRIV, "--pdeathsig", "KILL", "--", *shell, *procs, "--", *argv]
    shim = os.path.abspath(__file__)
    return [sys.executable, "-I", "-S", shim, str(os.getpid()), *procs, "--", *argv]


def enter(procs: tuple[str, ...], parent: int | None) -> None:
    """Into the cgroups whose ``cgroup.procs`` are ``procs``, then SIGKILL with the
    forking thread's exit; exits at once if ``parent`` is no longer this one's parent."""
    for path in procs:
        with open(path, "w") as f:
            f.write("0")
    die_with_parent(parent)


def die_with_parent(parent: int | None) -> None:
    """SIGKILL this process when the thread that forked it exits; exits at once if
    ``parent`` (None: no check) is no longer its parent, since the request came too late."""
    prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if parent is not None and os.getppid() != parent:
        os._exit(128 + signal.SIGKILL)  # as the signal would have


def prctl(option: int, value: int) -> None:
    """``prctl(option, value)``; OSError naming the option if the kernel refuses."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl({option}): {os.strerror(errno)}")


def _main(argv: list[str]) -> None:
    split = argv.index("--", 1) if "--" in argv[1:] else len(argv)
    parent, procs, command = argv[:1], argv[1:split], argv[split + 1 :]
    if not parent or not command:
        sys.exit("usage: enter_cell.py PARENT_PID|- [PROCS…] -- PROGRAM ARGS…")
    try:
        enter(tuple(procs), None if parent[0] == "-" else int(parent[0]))
    except OSError as e:
        sys.exit(f"watchdogd: cannot place the worker: {e}")
    try:
        os.execvp(command[0], command)
    except OSError as e:
        # The shell's status for a program that cannot be found or run.
        print(f"watchdogd: cannot run {command[0]!r}: {e.strerror}", file=sys.stderr)
        os._exit(127 if isinstance(e, FileNotFoundError) else 126)


if __name__ == "__main__":
    _main(sys.argv[1:])
