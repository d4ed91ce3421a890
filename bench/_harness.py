"""The benchmark's plumbing: processes, servers, /proc readers, statistics.

Everything that arms a timer runs in a child process started with ``spawn``:
the daemon refuses timers on its own ancestors (the benchmark's main
process is one), and a fresh interpreter keeps torch out of processes that
measure our client.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import multiprocessing.connection
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import msgspec

import watchdogd_client as wd

__all__ = [
    "CTX",
    "Child",
    "ChildError",
    "Distribution",
    "TorchTimerServer",
    "Watchdogd",
    "cpu_seconds",
    "percentile",
    "rss_bytes",
    "run_child",
    "settled_rss",
    "wait_until",
]

CTX = multiprocessing.get_context("spawn")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# -- statistics ---------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) with linear interpolation, as numpy's default."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True)
class Distribution:
    """Summary of a sample, in the unit of its values."""

    n: int
    median: float
    p99: float
    mean: float
    min: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float], scale: float = 1.0) -> Distribution:
        """Summarize ``values``, each multiplied by ``scale`` (e.g. 1e3 for s -> ms)."""
        scaled = [v * scale for v in values]
        if not scaled:
            return cls(0, math.nan, math.nan, math.nan, math.nan, math.nan)
        return cls(
            n=len(scaled),
            median=percentile(scaled, 50),
            p99=percentile(scaled, 99),
            mean=sum(scaled) / len(scaled),
            min=min(scaled),
            max=max(scaled),
        )


# -- /proc --------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time ``pid`` has used, all threads, from ``/proc/PID/stat``."""
    raw = Path(f"/proc/{pid}/stat").read_bytes()
    # comm (field 2) may hold spaces: fields after the last ')' start at field 3.
    fields = raw[raw.rindex(b")") + 2 :].split()
    utime, stime = int(fields[14 - 3]), int(fields[15 - 3])
    return (utime + stime) / _CLOCK_TICKS


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (``VmRSS`` in ``/proc/PID/status``)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise ProcessLookupError(pid)


def settled_rss(pid: int, quiet_s: float = 1.0, timeout: float = 30.0) -> int:
    """``pid``'s RSS once it has not moved by more than 1% for ``quiet_s``.

    Servers finish work in the background after the last request (torch's
    loop registers a batch per ``max_interval``; our daemon writes its timer
    snapshot): the resident size is read when that is done.
    """
    deadline = time.monotonic() + timeout
    stable_since, last = time.monotonic(), rss_bytes(pid)
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = rss_bytes(pid)
        if abs(now - last) > last / 100:
            stable_since, last = time.monotonic(), now
        elif time.monotonic() - stable_since >= quiet_s:
            break
    return last


def wait_until(
    predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.01
) -> None:
    """Poll ``predicate`` until it holds; TimeoutError naming ``what`` otherwise."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


# -- child processes ----------------------------------------------------------


class ChildError(RuntimeError):
    """A child process raised; the message carries its traceback."""


def _child_main(
    conn: multiprocessing.connection.Connection,
    target: Callable[..., object],
    args: tuple[object, ...],
    hold: bool,
) -> None:
    try:
        result = target(*args)
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", result))
    if hold:
        # Stay alive (the timers it armed stay armed) until told to stop.
        with contextlib.suppress(EOFError, OSError):
            conn.recv()


class _StartStop:
    """``with`` starts it and stops it at the end of the block."""

    def start(self) -> Self:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class _Spawned(_StartStop):
    """``target(conn, *args)`` in a spawned process; ``conn`` is its end of a control pipe.

    :meth:`stop` says "stop" down the pipe, waits ``stop_timeout`` for the
    process to exit, kills it if it does not, and reaps it.
    """

    stop_timeout = 5.0

    def __init__(self, target: Callable[..., None], args: tuple[object, ...], name: str) -> None:
        self._conn, child_conn = CTX.Pipe()
        self._child_conn: multiprocessing.connection.Connection | None = child_conn
        self.process = CTX.Process(target=target, args=(child_conn, *args), name=name, daemon=True)

    @property
    def pid(self) -> int:
        pid = self.process.pid
        assert pid is not None, f"{self.process.name} not started"
        return pid

    def start(self) -> Self:
        self.process.start()
        if self._child_conn is not None:
            self._child_conn.close()
            self._child_conn = None
        return self

    def stop(self) -> None:
        if self.process.pid is None:
            return
        with contextlib.suppress(OSError, ValueError):
            self._conn.send("stop")
        self.process.join(self.stop_timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(self.stop_timeout)
        self._conn.close()


class Child(_Spawned):
    """``target(*args)`` in a spawned process; its return value comes back by pipe.

    With ``hold=True`` the process stays alive after ``target`` returned,
    until :meth:`stop`: a timer holder whose timers must outlive the call.
    """

    def __init__(self, target: Callable[..., object], *args: object, hold: bool = False) -> None:
        name = f"bench-{getattr(target, '__name__', 'child')}"
        super().__init__(_child_main, (target, args, hold), name)

    def result(self, timeout: float) -> Any:
        """The value ``target`` returned; ChildError if it raised."""
        if not self._conn.poll(timeout):
            raise TimeoutError(f"{self.process.name} gave no result within {timeout:.0f}s")
        try:
            status, value = self._conn.recv()
        except EOFError:
            raise ChildError(
                f"{self.process.name} died (exit code {self.process.exitcode})"
            ) from None
        if status == "error":
            raise ChildError(f"{self.process.name} failed:\n{value}")
        return value


def run_child(target: Callable[..., object], *args: object, timeout: float) -> Any:
    """Run ``target(*args)`` in a fresh process and return its result."""
    with Child(target, *args) as child:
        return child.result(timeout)


# -- our daemon ---------------------------------------------------------------

_SERVE = "import sys; from watchdogd.cli.main import main; sys.exit(main())"
Setting = str | int | float | bool
_LIMITS: dict[str, Setting] = {"max_timers_per_pid": 2_000_000, "max_timers": 3_000_000}


def _toml(value: Setting) -> str:
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string, for the paths and words used here
    if isinstance(value, bool):
        return "true" if value else "false"
    return repr(value)


def _known(struct: type[msgspec.Struct], settings: dict[str, Setting]) -> dict[str, Setting]:
    """The ``settings`` this version of the daemon's config knows (the daemon is evolving)."""
    return {key: value for key, value in settings.items() if key in struct.__struct_fields__}


class Watchdogd(_StartStop):
    """``watchdogd serve`` as a child process, with a query connection to it.

    Its config raises the per-process and total timer limits (the memory
    measurement arms 1,000,000 timers), logs warnings only (as torch's server
    does by default) and writes events to a JSON-lines file, from which the
    benchmark reads how late the daemon sent each signal. ``settings`` are
    top-level config keys laid on top; keys the installed daemon does not
    know are left out, and :attr:`config_text` says what was used.
    """

    def __init__(self, runtime_dir: Path, settings: dict[str, Setting] | None = None) -> None:
        self.runtime_dir = runtime_dir
        self.socket_path = runtime_dir / "watchdogd.sock"
        self.fifo_path = runtime_dir / "timer.fifo"
        self.log_path = runtime_dir.with_name(runtime_dir.name + ".log")
        self.config_path = runtime_dir.with_name(runtime_dir.name + ".toml")
        self.event_log_path = runtime_dir.with_name(runtime_dir.name + "-events.jsonl")
        # Imported here, not at the top: the children that import this module
        # to measure the client should not load the daemon (anyio, uvloop).
        from watchdogd.core.config import Config, Limits

        top: dict[str, Setting] = {
            "log_level": "warning",
            "event_log": str(self.event_log_path),
            **(settings or {}),
        }
        self.settings = _known(Config, top)
        # Whether it captures a process's stacks before signalling it.
        self.stack_dumps = (
            self.settings.get("stack_dumps", getattr(Config(), "stack_dumps", "off")) != "off"
        )
        lines = [f"{key} = {_toml(value)}" for key, value in self.settings.items()]
        lines += ["", "[limits]"]
        lines += [f"{key} = {_toml(value)}" for key, value in _known(Limits, _LIMITS).items()]
        self.config_text = "\n".join(lines) + "\n"
        self._process: subprocess.Popen[bytes] | None = None
        self._query: wd.SocketTimerClient | None = None

    @property
    def pid(self) -> int:
        assert self._process is not None, "daemon not started"
        return self._process.pid

    def start(self, timeout: float = 30.0) -> Self:
        self.config_path.write_text(self.config_text)
        with self.log_path.open("wb") as log:
            self._process = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _SERVE,
                    "serve",
                    "--runtime-dir",
                    str(self.runtime_dir),
                    "--config",
                    str(self.config_path),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            wait_until(self._ready, timeout, f"watchdogd at {self.socket_path}")
        except BaseException:
            self.stop()
            raise
        return self

    def _ready(self) -> bool:
        assert self._process is not None
        if self._process.poll() is not None:
            raise ChildError(
                f"watchdogd exited with {self._process.returncode}: "
                f"{self.log_path.read_text(errors='replace')[-2000:]}"
            )
        if not self.socket_path.exists():
            return False
        try:
            self._query = wd.SocketTimerClient(self.socket_path, name="bench")
            self._query.status()
        except wd.DaemonUnavailableError:
            return False
        return True

    def events(self, name: str) -> list[dict[str, Any]]:
        """The events called ``name`` in the daemon's event log, oldest first."""
        if not self.event_log_path.exists():
            return []
        events = (json.loads(line) for line in self.event_log_path.read_text().splitlines())
        return [event for event in events if event.get("name") == name]

    def status(self) -> wd.protocol.StatusInfo:
        assert self._query is not None, "daemon not started"
        return self._query.status()

    def stop(self, timeout: float = 10.0) -> None:
        if self._query is not None:
            self._query.close()
            self._query = None
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout)

    def timers(self) -> int:
        """How many timers the daemon holds."""
        return self.status().timers


# -- torch's server -----------------------------------------------------------


@dataclass(frozen=True)
class TorchStats:
    requests: int  # FileTimerServer._request_count: requests registered so far
    timers: int  # len(FileTimerServer._timers)


def _torch_server_main(
    conn: multiprocessing.connection.Connection, fifo_path: str, max_interval: float
) -> None:
    # After reaping a worker, torch's server sends the same signal to its own
    # pid (FileTimerServer._run_watchdog): the benchmark's victims are
    # signalled with SIGUSR1, which this process ignores.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    from torch.distributed.elastic.timer.file_based_local_timer import FileTimerServer

    server = FileTimerServer(fifo_path, run_id="bench", max_interval=max_interval, daemon=True)
    server.start()
    conn.send("ready")
    try:
        while True:
            try:
                command = conn.recv()
            except EOFError:
                return
            if command == "stats":
                conn.send(TorchStats(server._request_count, len(server._timers)))
            else:
                return
    finally:
        server.stop()


class TorchTimerServer(_Spawned):
    """torch's ``FileTimerServer`` in its own process, with a control pipe."""

    stop_timeout = 10.0

    def __init__(self, fifo_path: Path, max_interval: float) -> None:
        self.fifo_path = fifo_path
        self.max_interval = max_interval
        args = (str(fifo_path), max_interval)
        super().__init__(_torch_server_main, args, "bench-torch-FileTimerServer")

    def start(self, timeout: float = 60.0) -> Self:
        super().start()
        try:
            if not self._conn.poll(timeout):
                raise TimeoutError(f"torch's FileTimerServer did not start in {timeout:.0f}s")
            if self._conn.recv() != "ready":
                raise ChildError("torch's FileTimerServer sent garbage")
        except BaseException:
            self.stop()
            raise
        return self

    def stats(self) -> TorchStats:
        self._conn.send("stats")
        stats: TorchStats = self._conn.recv()
        return stats

    def timers(self) -> int:
        """How many timers the server holds."""
        return self.stats().timers
