"""The private runtime directories of foreground runs: each says whose it is, none outlives it.

A run (``watchdogd run``, the launch API) serves its workers from a
directory of its own in the temporary directory, ``watchdogd-run-*``: the
socket, the FIFO and their locks, and the stack dumps of hung workers.

- :func:`make_run_dir` records the owner in it, ``owner.json``: its pid and
  its start time (``/proc/PID/stat``), so that a pid reused by another
  process is not taken for the owner.
- :func:`tidy` is how a run leaves its directory, at its exit on every path:
  everything goes but the stack dumps, which the run printed and the user
  reads (the owner record goes too, so what is kept is never swept).
- :func:`sweep` tidies, at the next start, the directories whose owner is
  gone without tidying (SIGKILL, an OOM kill, a power cut of the session):
  only those that carry an owner record, belong to this uid, and whose owner
  no longer runs; a live run's is never touched.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from pathlib import Path

import msgspec

from watchdogd.linux.procs import read_stat, still_runs

__all__ = ["RUN_DIR_PREFIX", "Owner", "make_run_dir", "sweep", "tidy"]

RUN_DIR_PREFIX = "watchdogd-run-"
_OWNER_FILE = "owner.json"
_DUMPS = "dumps"


class Owner(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The process a run directory belongs to."""

    pid: int
    start_time: int
    """Clock ticks after boot at which it started (``/proc/PID/stat`` field 22)."""

    @classmethod
    def this_process(cls) -> Owner:
        pid = os.getpid()
        return cls(pid, read_stat(pid).start_time)

    def runs(self) -> bool:
        """Whether the owner still runs (not a zombie, not a later process with its pid)."""
        return still_runs(self.pid, self.start_time)


def make_run_dir(parent: Path | None = None) -> Path:
    """A new ``watchdogd-run-*`` directory (mode 0700) in ``parent`` (the temporary
    directory), owned by this process."""
    directory = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX, dir=parent))
    try:
        # Written whole under another name first: a sweep never reads half a record.
        partial = directory / f".{_OWNER_FILE}"
        partial.write_bytes(msgspec.json.encode(Owner.this_process()))
        partial.rename(directory / _OWNER_FILE)
    except BaseException:
        shutil.rmtree(directory, ignore_errors=True)
        raise
    return directory


def tidy(directory: Path) -> Path | None:
    """Remove ``directory`` but for stack dumps in it; where those are kept, if any."""
    dumps = directory / _DUMPS
    with contextlib.suppress(FileNotFoundError):
        if dumps.is_dir() and any(dumps.iterdir()):
            for entry in directory.iterdir():
                if entry.name == _DUMPS:
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)
            return dumps
    shutil.rmtree(directory, ignore_errors=True)
    return None


def sweep(parent: Path | None = None) -> list[Path]:
    """Tidy every run directory in ``parent`` (the temporary directory) whose owner is
    gone; the ones tidied."""
    parent = Path(tempfile.gettempdir()) if parent is None else parent
    swept = []
    for directory in parent.glob(f"{RUN_DIR_PREFIX}*"):
        owner = _owner(directory)
        if owner is not None and not owner.runs():
            tidy(directory)
            swept.append(directory)
    return swept


def _owner(directory: Path) -> Owner | None:
    """Who owns ``directory``, if it is one of this uid's run directories that says so."""
    try:
        info = directory.lstat()
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid():
            return None  # a link, a file, someone else's: never ours to remove
        return msgspec.json.decode((directory / _OWNER_FILE).read_bytes(), type=Owner)
    except (OSError, msgspec.DecodeError):
        return None  # no record (kept dumps, an older run's), or unreadable: left alone
