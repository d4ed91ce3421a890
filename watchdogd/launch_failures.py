"""torch's failures of a launch: ``ProcessFailure`` and ``ChildFailedError``, and ours.

When torch is importable a launch raises torch's own classes (``except
ChildFailedError`` and ``@record`` see what they expect); without it, the
classes of the same shape defined here. ``NoProgressError`` (a run whose
restarts made no progress, or a bad program: do not requeue it) subclasses whichever
``ChildFailedError`` is raised, so that catching torch's error still
catches it; it is made on first use, since only then is torch looked for.
"""

from __future__ import annotations

import contextlib
import functools
import signal
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import msgspec

from watchdogd.core.progress import EXIT_NO_PROGRESS
from watchdogd_client.groups import Failure

__all__ = [
    "ChildFailedError",
    "ProcessFailure",
    "child_failed",
    "no_progress_error_type",
    "process_failures",
]


@dataclass
class ProcessFailure:
    """torch's ``ProcessFailure``, for when torch is not installed."""

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    error_file_data: dict[str, Any] = field(init=False)
    message: Any = field(init=False)
    """As torch's: the error file's ``message`` (a dict holding the traceback), else a line."""
    timestamp: int = field(init=False)

    def __post_init__(self) -> None:
        self.error_file_data = {}
        self.message = ""
        self.timestamp = int(time.time())
        with contextlib.suppress(OSError, msgspec.DecodeError, KeyError, TypeError, ValueError):
            self.error_file_data = msgspec.json.decode(Path(self.error_file).read_bytes())
            self.message = self.error_file_data["message"]
            if isinstance(self.message, dict):
                self.timestamp = int(self.message["extraInfo"]["timestamp"])
            else:
                self.timestamp = int(self.error_file_data.get("timestamp", 0))
        if not self.message:
            self.message = (
                f"Signal {-self.exitcode} ({self.signal_name()}) received by PID {self.pid}"
                if self.exitcode < 0
                else "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
            )

    def signal_name(self) -> str:
        if self.exitcode < 0:
            with contextlib.suppress(ValueError):
                return signal.Signals(-self.exitcode).name
            return "<Unknown>"
        return "<N/A>"

    def timestamp_isoformat(self) -> str:
        return datetime.fromtimestamp(self.timestamp, tz=UTC).isoformat(sep="_")


class ChildFailedError(Exception):
    """torch's ``ChildFailedError``, for when torch is not installed (``failures``: by rank)."""

    def __init__(self, name: str, failures: dict[int, ProcessFailure]) -> None:
        self.name = name
        self.failures = failures
        super().__init__(self.format_msg())

    def get_first_failure(self) -> tuple[int, ProcessFailure]:
        rank = min(self.failures, key=lambda r: self.failures[r].timestamp)
        return rank, self.failures[rank]

    def format_msg(self, boarder_delim: str = "=", section_delim: str = "-") -> str:
        root_rank, _ = self.get_first_failure()
        lines = [f"{self.name} FAILED", boarder_delim * 60, "Failures:"]
        others = [self._describe(r) for r in sorted(self.failures) if r != root_rank]
        lines += others or ["  <NO_OTHER_FAILURES>"]
        lines += [section_delim * 60, "Root Cause (first observed failure):"]
        lines += [self._describe(root_rank), boarder_delim * 60]
        return "\n".join(lines)

    def _describe(self, rank: int) -> str:
        failure = self.failures[rank]
        message = failure.message
        if isinstance(message, dict):  # the traceback, else the message
            message = message.get("extraInfo", {}).get("py_callstack", message.get("message"))
            message = str(message).replace("\n", "\n  ")
        return (
            f"[{rank}]:\n  time      : {failure.timestamp_isoformat()}\n"
            f"  rank      : {rank} (local_rank: {failure.local_rank})\n"
            f"  exitcode  : {failure.exitcode} (pid: {failure.pid})\n"
            f"  error_file: {failure.error_file or '<N/A>'}\n  traceback : {message}"
        )


def _torch_errors() -> tuple[Any, Any]:
    """(ProcessFailure, ChildFailedError): torch's when torch is importable, else this module's."""
    try:
        from torch.distributed.elastic.multiprocessing import errors
    except ImportError:
        return ProcessFailure, ChildFailedError
    return errors.ProcessFailure, errors.ChildFailedError


def process_failures(failures: list[Failure]) -> dict[int, Any]:
    """torch's ``ProcessFailure`` of each failed worker, by global rank; where the OOM
    killer struck, a message that is a signal's line (no error file) says so."""
    failure_type, _ = _torch_errors()
    found = {}
    for f in failures:
        found[f.rank] = process = failure_type(
            local_rank=f.local_rank, pid=f.pid, exitcode=f.exitcode, error_file=f.error_file or ""
        )
        if f.oom_kills and isinstance(process.message, str) and f.exitcode < 0:
            process.message += f": {f.reason}"
    return found


def child_failed(name: str, failures: list[Failure]) -> Exception:
    """torch's ``ChildFailedError`` for these failures (this module's without torch)."""
    _, error_type = _torch_errors()
    return error_type(name=name, failures=process_failures(failures))  # type: ignore[no-any-return]


@functools.cache
def no_progress_error_type() -> type[Exception]:
    """``NoProgressError``, made once: a subclass of the ``ChildFailedError`` this module
    raises (torch's when importable), so that ``except ChildFailedError`` still catches it."""
    _, base = _torch_errors()

    class NoProgressError(base):  # type: ignore[misc,valid-type]
        """The run ended because its restarts made no progress, or every attempt failed the
        same way before any step (a bad program): do not requeue it."""

        exit_code = EXIT_NO_PROGRESS

        def __init__(self, name: str, failures: dict[int, Any], reason: str) -> None:
            self.reason = reason
            super().__init__(name=name, failures=failures)

        def __str__(self) -> str:
            return f"{self.reason}\n{super().__str__()}"

    NoProgressError.__module__ = "watchdogd.launcher"  # where users import it from
    return NoProgressError
