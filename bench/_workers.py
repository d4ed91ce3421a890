"""What the benchmark's child processes do: one function per role.

Each function runs in a fresh spawned process (see ``_harness.Child``) and
returns a small picklable result. ``impl`` names the client under test:

- ``ours-socket``: ``watchdogd_client.SocketTimerClient`` to our daemon;
- ``ours-fifo``: ``watchdogd_client.FileTimerClient`` to our daemon's FIFO;
- ``torch``: torch's ``FileTimerClient`` to torch's ``FileTimerServer``.

torch is imported only inside the functions that use it.
"""

from __future__ import annotations

import multiprocessing.synchronize
import os
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from types import FrameType
from typing import Literal, Protocol

import watchdogd_client as wd

__all__ = [
    "CostResult",
    "Impl",
    "LatencyResult",
    "WriterResult",
    "arm_socket_timers",
    "measure_expiry_latency",
    "measure_wakeup_floor",
    "time_expires_blocks",
    "write_requests",
    "write_torch_timers",
]

Impl = Literal["ours-socket", "ours-fifo", "torch"]

# Requests a writer sends between two looks at the clock.
_PAIRS_PER_CHECK = 64
# Lines per write() when filling torch's FIFO (one writer, so no interleaving).
_LINES_PER_WRITE = 4096


class _TimerClient(Protocol):
    def acquire(self, scope_id: str, expiration_time: float) -> None: ...
    def release(self, scope_id: str) -> None: ...


_Expires = Callable[..., AbstractContextManager[None]]


def _our_client(impl: Impl, endpoint: str, signum: int) -> wd.TimerClient:
    if impl == "ours-socket":
        return wd.SocketTimerClient(endpoint, signal=signum)
    return wd.FileTimerClient(endpoint, signal=signum)


def _client(impl: Impl, endpoint: str, signum: int) -> _TimerClient:
    if impl != "torch":
        return _our_client(impl, endpoint, signum)
    from torch.distributed.elastic.timer.file_based_local_timer import FileTimerClient

    client: _TimerClient = FileTimerClient(endpoint, signal=signum)
    return client


def _finish(client: _TimerClient) -> None:
    """Wait until our daemon processed everything (raises its errors); no-op otherwise."""
    if isinstance(client, wd.SocketTimerClient):
        client.sync()


def _error_name(exc: BaseException) -> str:
    return type(exc).__name__


# Exceptions a timer client raises when a request did not get through:
# torch's FileTimerClient raises BlockingIOError (pipe full) and
# BrokenPipeError (no reader); ours raises WatchdogError subclasses.
_CLIENT_ERRORS = (OSError, wd.WatchdogError)


# -- 1. client cost -----------------------------------------------------------


@dataclass(frozen=True)
class CostResult:
    block_ns: list[float]  # mean cost of one block, one value per batch
    blocks: int
    errors: dict[str, int]
    stack_depth: int  # frames on the stack at the `with` statement


def _stack_depth() -> int:
    """Frames on the caller's stack, the caller's own included."""
    depth = 0
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        depth += 1
        frame = frame.f_back
    return depth


def time_expires_blocks(
    impl: Impl,
    endpoint: str,
    scoped: bool,
    batches: int,
    batch_size: int,
    warmup: int,
    pause_s: float,
) -> CostResult:
    """Time ``with expires(after=60[, scope="s"]): pass`` blocks, ``batch_size`` per sample.

    The client is installed with ``configure`` and ``expires`` is called
    without ``client=``, the way trainers use it. Batches are ``pause_s``
    apart (untimed) so that each starts with the server idle, as a training
    step's block does: back to back, torch's client overflows the FIFO
    (BlockingIOError) and our socket client waits on a busy daemon.
    """
    client: _TimerClient
    expires: _Expires
    if impl == "torch":
        from torch.distributed.elastic.timer.api import configure
        from torch.distributed.elastic.timer.api import expires as torch_expires
        from torch.distributed.elastic.timer.file_based_local_timer import FileTimerClient

        torch_client = FileTimerClient(endpoint, signal=signal.SIGKILL)
        configure(torch_client)
        client, expires = torch_client, torch_expires
    else:
        our_client = _our_client(impl, endpoint, signal.SIGKILL)
        wd.configure(our_client)
        client, expires = our_client, wd.expires
    errors: Counter[str] = Counter()

    def scoped_batch() -> int:
        start = time.perf_counter_ns()
        for _ in range(batch_size):
            try:
                with expires(after=60, scope="s"):
                    pass
            except _CLIENT_ERRORS as e:
                errors[_error_name(e)] += 1
        return time.perf_counter_ns() - start

    def scopeless_batch() -> int:
        start = time.perf_counter_ns()
        for _ in range(batch_size):
            try:
                with expires(after=60):
                    pass
            except _CLIENT_ERRORS as e:
                errors[_error_name(e)] += 1
        return time.perf_counter_ns() - start

    run_batch = scoped_batch if scoped else scopeless_batch
    block_ns: list[float] = []
    for batch in range(warmup + batches):
        elapsed_ns = run_batch()
        if batch >= warmup:
            block_ns.append(elapsed_ns / batch_size)
        time.sleep(pause_s)
    try:
        _finish(client)
    except _CLIENT_ERRORS as e:
        errors[_error_name(e)] += 1
    return CostResult(block_ns, batches * batch_size, dict(errors), _stack_depth() + 1)


# -- 2. expiry-to-signal latency ----------------------------------------------


@dataclass(frozen=True)
class LatencyResult:
    latencies_s: list[float]  # signal arrival - expiration_time, one per delivered signal
    missed: int  # timers whose signal never came within the wait
    senders: list[int]  # pids the signals came from


def measure_expiry_latency(
    impl: Impl,
    endpoint: str,
    samples: int,
    delay_range_s: tuple[float, float],
    wait_s: float,
    seed: int,
) -> LatencyResult:
    """Arm one timer at a time, ``delay_range_s`` ahead, and time its SIGUSR1.

    SIGUSR1 is blocked and taken with ``sigtimedwait``, so the arrival time is
    read the moment the signal is delivered, not when a Python handler runs.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    client = _client(impl, endpoint, signal.SIGUSR1)
    rng = random.Random(seed)
    latencies: list[float] = []
    senders: set[int] = set()
    missed = 0
    for i in range(samples):
        scope = f"latency-{i}"
        expiration = time.time() + rng.uniform(*delay_range_s)
        client.acquire(scope, expiration)
        info = signal.sigtimedwait([signal.SIGUSR1], expiration - time.time() + wait_s)
        arrival = time.time()
        if info is None:
            missed += 1
            client.release(scope)
            continue
        latencies.append(arrival - expiration)
        senders.add(info.si_pid)
    _finish(client)
    return LatencyResult(latencies, missed, sorted(senders))


def measure_wakeup_floor(
    samples: int, delay_range_s: tuple[float, float], seed: int
) -> list[float]:
    """How late this machine wakes a process: ``sigtimedwait`` timeouts, no server involved.

    The same wait as :func:`measure_expiry_latency`, left to time out: the
    part of any expiry latency that no timer server can remove.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    rng = random.Random(seed)
    lateness: list[float] = []
    for _ in range(samples):
        delay = rng.uniform(*delay_range_s)
        target = time.time() + delay
        signal.sigtimedwait([signal.SIGUSR1], delay)
        lateness.append(time.time() - target)
    return lateness


# -- 3. throughput ------------------------------------------------------------


@dataclass(frozen=True)
class WriterResult:
    sent: int  # requests whose call returned without an error
    errors: dict[str, int]  # requests whose call raised, by exception type
    started: float  # time.monotonic(), system-wide
    finished: float  # after the last request (and, for our socket, its sync)


def write_requests(
    impl: Impl, endpoint: str, duration_s: float, start: multiprocessing.synchronize.Barrier
) -> WriterResult:
    """acquire/release pairs on one scope, as fast as possible, for ``duration_s``."""
    client = _client(impl, endpoint, signal.SIGKILL)
    _finish(client)  # our socket client connects (hello) before the clock starts
    acquire, release = client.acquire, client.release
    errors: Counter[str] = Counter()
    sent = 0
    start.wait()
    started = time.monotonic()
    stop_at = started + duration_s
    while time.monotonic() < stop_at:
        for _ in range(_PAIRS_PER_CHECK):
            try:
                acquire("step", time.time() + 60)
                sent += 1
            except _CLIENT_ERRORS as e:
                errors[_error_name(e)] += 1
            try:
                release("step")
                sent += 1
            except _CLIENT_ERRORS as e:
                errors[_error_name(e)] += 1
    try:
        _finish(client)
    except _CLIENT_ERRORS as e:
        errors[_error_name(e)] += 1
    return WriterResult(sent, dict(errors), started, time.monotonic())


# -- 2 & 4. long-lived timer holders --------------------------------------------


def arm_socket_timers(socket_path: str, count: int, after_s: float, prefix: str) -> int:
    """Arm ``count`` timers on this process through our socket (pipelined), then sync."""
    client = wd.SocketTimerClient(socket_path, signal=signal.SIGKILL)
    expiration = time.time() + after_s
    for i in range(count):
        client.acquire(f"{prefix}{i}", expiration)
    client.sync()
    return os.getpid()


def write_torch_timers(fifo_path: str, count: int, after_s: float, prefix: str) -> int:
    """Write ``count`` torch-format acquire requests for this process into ``fifo_path``.

    The lines are torch's own ``FileTimerRequest.to_json()``. One descriptor,
    blocking writes: much faster than torch's client (one open per request),
    and safe because nobody else writes meanwhile. It is closed at the end,
    since torch's server cannot run its expiry check while a writer holds the
    FIFO open and the pipe is empty.
    """
    from torch.distributed.elastic.timer.file_based_local_timer import FileTimerRequest

    pid = os.getpid()
    expiration = time.time() + after_s
    fd = os.open(fifo_path, os.O_WRONLY | os.O_CLOEXEC)
    try:
        for first in range(0, count, _LINES_PER_WRITE):
            last = min(first + _LINES_PER_WRITE, count)
            chunk = "".join(
                FileTimerRequest(pid, f"{prefix}{i}", expiration, signal.SIGKILL).to_json() + "\n"
                for i in range(first, last)
            ).encode()
            view = memoryview(chunk)
            while view:
                view = view[os.write(fd, view) :]
    finally:
        os.close(fd)
    return pid
