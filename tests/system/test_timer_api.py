"""torch's timer extension points and the daemon-less pair, with real processes.

A custom pair built from the exported ABCs alone; the watchdog loop's rounds
driven one at a time; ``LocalTimerServer`` killing hung ``spawn`` and
``fork`` children at their deadline; and its pid safety, shown both by the
pidfds it holds (read from ``/proc/self/fdinfo``) and, where root may make a
pid namespace, by forcing the kernel to reuse a pid.
"""

from __future__ import annotations

import inspect
import json
import logging
import math
import multiprocessing as mp
import os
import queue
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from multiprocessing.synchronize import Event as MpEvent
from pathlib import Path
from typing import Any

import pytest

import watchdogd_client as wd

from ..conftest import REPO, wait_until

LOGGER = "watchdogd_client.timer"


def pidfd_target(fd: int) -> int | None:
    """The pid the pidfd ``fd`` of this process pins (-1 once reaped); None: no pidfd."""
    try:
        info = Path(f"/proc/self/fdinfo/{fd}").read_text()
    except FileNotFoundError:
        return None
    for line in info.splitlines():
        if line.startswith("Pid:"):
            return int(line.split()[1])
    return None


def pidfds_on(pid: int) -> list[int]:
    return [int(fd) for fd in os.listdir("/proc/self/fd") if pidfd_target(int(fd)) == pid]


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    child = subprocess.Popen(["sleep", "60"])
    try:
        yield child
    finally:
        child.kill()
        child.wait()


# -- a custom pair, from the exported ABCs only -------------------------------


class ListQueue(wd.RequestQueue):
    """An in-process RequestQueue that records how long each ``get`` may block."""

    def __init__(self) -> None:
        self.items: queue.Queue[wd.TimerRequest] = queue.Queue()
        self.timeouts: list[float] = []

    def size(self) -> int:
        return self.items.qsize()

    def get(self, size: int, timeout: float) -> list[wd.TimerRequest]:
        self.timeouts.append(timeout)
        batch: list[wd.TimerRequest] = []
        try:
            batch.append(self.items.get(timeout=timeout))
            while len(batch) < size:
                batch.append(self.items.get_nowait())
        except queue.Empty:
            pass
        return batch


class NamedClient(wd.TimerClient):
    def __init__(self, requests: ListQueue, worker_id: str) -> None:
        self.requests = requests
        self.worker_id = worker_id

    def acquire(self, scope_id: str, expiration_time: float) -> None:
        self.requests.items.put(wd.TimerRequest(self.worker_id, scope_id, expiration_time))

    def release(self, scope_id: str) -> None:
        self.requests.items.put(wd.TimerRequest(self.worker_id, scope_id, -1))


class CancellingServer(wd.TimerServer):
    """Workers are names; reaping one sets its event, or fails as told by ``outcome``."""

    def __init__(self, requests: ListQueue, max_interval: float, outcome: object = True) -> None:
        super().__init__(requests, max_interval, run_id="run-7")
        self.timers: dict[tuple[str, str], wd.TimerRequest] = {}
        self.cancel: dict[str, threading.Event] = {}
        self.reaped: list[str] = []
        self.outcome = outcome

    def register_timers(self, timer_requests: list[wd.TimerRequest]) -> None:
        for r in timer_requests:
            if r.expiration_time < 0:
                self.timers.pop((r.worker_id, r.scope_id), None)
            else:
                self.timers[(r.worker_id, r.scope_id)] = r

    def clear_timers(self, worker_ids: set[Any]) -> None:
        self.timers = {k: r for k, r in self.timers.items() if k[0] not in worker_ids}

    def get_expired_timers(self, deadline: float) -> dict[Any, list[wd.TimerRequest]]:
        expired: dict[Any, list[wd.TimerRequest]] = {}
        for r in self.timers.values():
            if r.expiration_time <= deadline:
                expired.setdefault(r.worker_id, []).append(r)
        return expired

    def _reap_worker(self, worker_id: Any) -> bool:
        self.reaped.append(worker_id)
        if isinstance(self.outcome, Exception):
            raise self.outcome
        self.cancel.setdefault(worker_id, threading.Event()).set()
        return bool(self.outcome)


def test_timer_request_is_torchs_value_object() -> None:
    request = wd.TimerRequest(12, "step", 5.0)
    assert request == wd.TimerRequest(12, "step", 5.0)
    assert request != wd.TimerRequest(12, "step", -1)
    assert request != (12, "step", 5.0)
    assert not hasattr(request, "__dict__")  # __slots__, as torch's
    assert request.__hash__ is None
    assert repr(request) == "TimerRequest(worker_id=12, scope_id='step', expiration_time=5.0)"


def test_custom_pair_reaps_the_hung_worker_only(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    requests = ListQueue()
    server = CancellingServer(requests, max_interval=0.05)
    for name in ("hung", "quick"):
        server.cancel[name] = threading.Event()
    outcomes: dict[str, bool] = {}

    def work(name: str, seconds: float) -> None:
        with wd.expires(after=0.3, scope="step", client=NamedClient(requests, name)):
            outcomes[name] = server.cancel[name].wait(seconds)

    server.start()
    try:
        threads = [
            threading.Thread(target=work, args=("hung", 30.0)),
            threading.Thread(target=work, args=("quick", 0.01)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        time.sleep(0.4)  # past the quick worker's deadline: its release must hold
    finally:
        server.stop()
    assert outcomes == {"hung": True, "quick": False}
    assert server.reaped == ["hung"]
    assert server.timers == {}  # reaped → cleared; released → gone
    hook = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Timers expired")]
    assert hook == ["Timers expired for run:[run-7] [{'hung': ['step']}]."]


@pytest.mark.parametrize(
    ("outcome", "kept"),
    [(True, False), (False, True), (RuntimeError("boom"), False)],
    ids=["reaped", "failed-kept-for-retry", "raised-counts-as-reaped"],
)
def test_a_round_clears_only_reaped_workers(outcome: object, kept: bool) -> None:
    requests = ListQueue()
    server = CancellingServer(requests, max_interval=60, outcome=outcome)
    NamedClient(requests, "w").acquire("s", time.time() - 1)
    server._run_watchdog()
    assert server.reaped == ["w"]
    assert list(server.timers) == ([("w", "s")] if kept else [])
    # Without _next_expiration_after the wait is torch's max_interval, capped
    # so that stop() stays prompt.
    assert requests.timeouts == [1.0]


def test_bad_arguments_fail_at_construction() -> None:
    with pytest.raises(ValueError, match="max_interval"):
        CancellingServer(ListQueue(), max_interval=0)
    with pytest.raises(ValueError):
        wd.LocalTimerServer(queue.Queue(), signal=12345)


def test_start_and_stop_twice_change_nothing_as_in_torch() -> None:
    server = CancellingServer(ListQueue(), max_interval=0.05)
    server.start()
    try:
        first = server._watchdog_thread
        server.start()  # torch carries on: no error, no second watchdog thread
        assert server._watchdog_thread is first
        watchdogs = [t for t in threading.enumerate() if t.name == "CancellingServer-watchdog"]
        assert watchdogs == [first]
    finally:
        server.stop()
    server.stop()
    assert first is not None and not first.is_alive()


# -- LocalTimerServer, one round at a time ----------------------------------


class SpyQueue(queue.Queue[Any]):
    """A plain queue in place of a multiprocessing one, recording each get's timeout."""

    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float] = []

    def get(self, block: bool = True, timeout: float | None = None) -> Any:
        assert timeout is not None
        self.timeouts.append(timeout)
        return super().get(block, timeout)


class RecordingServer(wd.LocalTimerServer):
    """A LocalTimerServer, driven one round at a time, that records its reaps."""

    def __init__(self) -> None:
        self.requests = SpyQueue()
        super().__init__(self.requests, max_interval=60)
        self.reaped: list[int] = []

    def _reap_worker(self, worker_id: int) -> bool:
        self.reaped.append(worker_id)
        return super()._reap_worker(worker_id)


def test_the_wait_ends_at_the_next_deadline(sleeper: subprocess.Popen[bytes]) -> None:
    server = RecordingServer()
    server.requests.put(wd.TimerRequest(sleeper.pid, "late", time.time() + 30))
    server.requests.put(wd.TimerRequest(sleeper.pid, "soon", time.time() + 0.3))
    server._run_watchdog()  # registers both; nothing expired
    assert server.reaped == []
    (pidfd,) = pidfds_on(sleeper.pid)
    server._run_watchdog()  # blocks until "soon" expires, then kills
    first, second = server.requests.timeouts[0], server.requests.timeouts[2]
    assert 0.9 < first <= 1.0  # nothing armed yet: the stop-check cap, not max_interval=60
    assert 0 < second <= 0.3  # the deadline, not a tick
    assert server.reaped == [sleeper.pid]
    assert sleeper.wait(10) == -signal.SIGKILL
    assert server.get_expired_timers(math.inf) == {}  # both of the worker's timers cleared
    assert pidfd_target(pidfd) is None  # and its pidfd closed


def test_a_failed_reap_is_retried_without_spinning(sleeper: subprocess.Popen[bytes]) -> None:
    class Failing(RecordingServer):
        def _reap_worker(self, worker_id: int) -> bool:
            self.reaped.append(worker_id)
            return False

    server = Failing()
    server.register_timers([wd.TimerRequest(sleeper.pid, "s", time.time() - 1)])
    server._run_watchdog()  # due at once: no wait; the reap fails
    server.requests.put(wd.TimerRequest(sleeper.pid, "other", -1))  # ends the next wait
    server._run_watchdog()
    assert server.reaped == [sleeper.pid, sleeper.pid]  # retried next round
    first, second = server.requests.timeouts
    assert first == 0
    assert second > 0.9  # a timer already handed to the reaper does not cut waits short


def test_one_pidfd_per_worker_held_while_it_has_timers(sleeper: subprocess.Popen[bytes]) -> None:
    server = RecordingServer()
    far = time.time() + 60
    a, b, a_again = (wd.TimerRequest(sleeper.pid, s, far + i) for i, s in enumerate("aba"))
    server.register_timers([a, b, a_again])
    assert len(pidfds_on(sleeper.pid)) == 1
    # Re-arming replaces; each pid's timers come soonest first.
    assert server.get_expired_timers(far + 10) == {sleeper.pid: [b, a_again]}
    server.register_timers([wd.TimerRequest(sleeper.pid, "a", -1)])
    assert len(pidfds_on(sleeper.pid)) == 1
    server.register_timers([wd.TimerRequest(sleeper.pid, "b", -1)])
    assert pidfds_on(sleeper.pid) == []
    # A release for a pid without timers opens nothing; a bogus worker_id is ignored.
    server.register_timers([wd.TimerRequest(sleeper.pid, "a", -1), wd.TimerRequest("x", "a", 1)])
    assert pidfds_on(sleeper.pid) == [] and server.get_expired_timers(math.inf) == {}


@pytest.mark.parametrize("alive", [True, False], ids=["alive-reaped", "exited-dropped"])
def test_an_exited_worker_is_dropped_never_signalled(
    sleeper: subprocess.Popen[bytes], alive: bool
) -> None:
    server = RecordingServer()
    pid = sleeper.pid
    server.register_timers([wd.TimerRequest(pid, "work", time.time() - 1)])
    (pidfd,) = pidfds_on(pid)
    if not alive:
        sleeper.kill()
        sleeper.wait()  # the pid is free for anyone now
        assert pidfd_target(pidfd) == -1  # the pidfd still names the dead process
    server._run_watchdog()
    assert server.reaped == ([pid] if alive else [])
    assert pidfd_target(pidfd) is None  # closed
    assert server.get_expired_timers(math.inf) == {}
    if alive:
        assert sleeper.wait(10) == -signal.SIGKILL


def test_torchs_local_timer_client_is_understood() -> None:
    local_timer = pytest.importorskip("torch.distributed.elastic.timer.local_timer")
    server = RecordingServer()
    client = local_timer.LocalTimerClient(server.requests)  # arms timers on this very process
    far = time.time() + 60
    client.acquire("torch", far)
    server.requests.put("not a request")
    server._run_watchdog()
    assert server.get_expired_timers(math.inf) == {
        os.getpid(): [wd.TimerRequest(os.getpid(), "torch", far)]
    }
    client.release("torch")
    server._run_watchdog()
    assert server.get_expired_timers(math.inf) == {}
    assert server.reaped == []


def test_reaping_a_pid_without_timers_signals_nothing(sleeper: subprocess.Popen[bytes]) -> None:
    assert RecordingServer()._reap_worker(sleeper.pid) is True
    assert sleeper.poll() is None


# -- LocalTimerServer with real children ----------------------------------


def _hang_in_expires(client: wd.TimerClient, ready: MpEvent, use_torch: bool = False) -> None:
    if use_torch:
        from torch.distributed.elastic.timer import expires
    else:
        expires = wd.expires
    with expires(after=0.5, scope="hang", client=client):
        ready.set()
        time.sleep(60)


def _release_in_time(mp_queue: Any, ready: MpEvent, use_torch: bool = False) -> None:
    if use_torch:
        from torch.distributed.elastic.timer import expires
    else:
        expires = wd.expires
    client = wd.LocalTimerClient(mp_queue)  # built in the child, from the queue alone
    with expires(after=0.5, scope="quick", client=client):
        pass
    ready.set()
    time.sleep(1.5)  # well past the deadline it released


def run_hung_and_released(
    method: str, use_torch: bool = False
) -> tuple[int | None, float, int | None]:
    """Hung and releasing children under one server: (hung exit, seconds to die, other exit)."""
    ctx = mp.get_context(method)
    requests = ctx.Queue()
    server = wd.LocalTimerServer(requests, max_interval=60)
    server.start()
    hung_ready, quick_ready = ctx.Event(), ctx.Event()
    hung = ctx.Process(
        target=_hang_in_expires, args=(wd.LocalTimerClient(requests), hung_ready, use_torch)
    )
    quick = ctx.Process(target=_release_in_time, args=(requests, quick_ready, use_torch))
    try:
        hung.start()
        quick.start()
        assert hung_ready.wait(30) and quick_ready.wait(30)
        armed = time.monotonic()
        hung.join(20)
        died_after = time.monotonic() - armed
        quick.join(20)
        return hung.exitcode, died_after, quick.exitcode
    finally:
        server.stop()
        for child in (hung, quick):
            if child.is_alive():
                child.kill()
                child.join()


@pytest.mark.parametrize("method", ["spawn", "fork"])
def test_local_server_kills_a_hung_child_at_its_deadline(method: str) -> None:
    hung_exit, died_after, quick_exit = run_hung_and_released(method)
    assert hung_exit == -signal.SIGKILL
    assert died_after < 15  # deadline 0.5 s; torch's would wait for max_interval=60
    assert quick_exit == 0  # released in time: untouched


def test_torchs_expires_drives_the_local_pair() -> None:
    pytest.importorskip("torch.distributed.elastic.timer")
    hung_exit, died_after, quick_exit = run_hung_and_released("fork", use_torch=True)
    assert (hung_exit, quick_exit) == (-signal.SIGKILL, 0)
    assert died_after < 15


def _hang(client: wd.TimerClient, ready: MpEvent) -> None:
    client.acquire("hang", time.time() + 0.3)
    ready.set()
    time.sleep(60)


@pytest.mark.parametrize("sig", [signal.SIGTERM, 0], ids=["SIGTERM", "record-only"])
def test_signal_argument(sig: int, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    ctx = mp.get_context("fork")
    requests = ctx.Queue()
    server = wd.LocalTimerServer(requests, max_interval=60, signal=sig)
    ready = ctx.Event()
    child = ctx.Process(target=_hang, args=(wd.LocalTimerClient(requests), ready))
    server.start()
    try:
        child.start()
        assert ready.wait(30)
        if sig:
            child.join(20)
            assert child.exitcode == -sig
        else:
            expiry = f"Timers expired for run:[] [{{{child.pid}: ['hang']}}]."
            wait_until(lambda: expiry in [r.getMessage() for r in caplog.records])
            wait_until(lambda: pidfds_on(child.pid) == [])  # its timers cleared
            assert child.is_alive()
    finally:
        server.stop()
        if child.is_alive():
            child.kill()
            child.join()


# -- a real pid reuse, in a pid namespace -----------------------------------

REUSE_SCRIPT = r"""
import json, multiprocessing as mp, subprocess, time
import watchdogd_client as wd


class Recording(wd.LocalTimerServer):
    def __init__(self, q):
        super().__init__(q, max_interval=60)
        self.reaped = []

    def _reap_worker(self, worker_id):
        self.reaped.append(worker_id)
        return super()._reap_worker(worker_id)


def start_with_pid(pid):
    # A process's start time is counted in 10 ms ticks: start in a later one.
    time.sleep(0.03)
    with open("/proc/sys/kernel/ns_last_pid", "w") as f:
        f.write(str(pid - 1))
    return subprocess.Popen(["sleep", "60"])


def arm_and_exit(q):
    wd.LocalTimerClient(q).acquire("late", time.time() - 1)


def alive(proc):
    # A signal takes effect asynchronously: give it time to.
    try:
        proc.wait(0.5)
    except subprocess.TimeoutExpired:
        return True
    return False


ctx = mp.get_context("fork")
q = ctx.Queue()
server = Recording(q)
result = {}

# A request read only after its sender exited and a newcomer took the pid.
sender = ctx.Process(target=arm_and_exit, args=(q,))
sender.start()
sender.join()  # its exit flushed the request into the queue
newcomer = start_with_pid(sender.pid)
server._run_watchdog()
result["late"] = {
    "reused": newcomer.pid == sender.pid,
    "armed": server.get_expired_timers(float("inf")) != {},
    "reaped": server.reaped[:],
    "alive": alive(newcomer),
}
newcomer.kill()
newcomer.wait()

# A timer armed on a live process, whose pid is reused before the deadline round.
victim = subprocess.Popen(["sleep", "60"])
server.register_timers([wd.TimerRequest(victim.pid, "held", time.time() - 1)])
victim.kill()
victim.wait()
newcomer = start_with_pid(victim.pid)
direct = server._reap_worker(victim.pid)  # the reaper itself, before any exit check
server.reaped.clear()
server._run_watchdog()
result["held"] = {
    "reused": newcomer.pid == victim.pid,
    "direct_reap": direct,
    "armed": server.get_expired_timers(float("inf")) != {},
    "reaped": server.reaped[:],
    "alive": alive(newcomer),
}
newcomer.kill()
newcomer.wait()
print(json.dumps(result))
"""


def test_a_reused_pid_is_never_signalled(pid_namespace: list[str]) -> None:
    command = pid_namespace
    out = subprocess.run(
        [*command, sys.executable, "-c", textwrap.dedent(REUSE_SCRIPT)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result == {
        "late": {"reused": True, "armed": False, "reaped": [], "alive": True},
        "held": {"reused": True, "direct_reap": True, "armed": False, "reaped": [], "alive": True},
    }


# -- parity with torch, and the worked example ------------------------------


def test_same_names_and_signatures_as_torch() -> None:
    pytest.importorskip("torch.distributed.elastic.timer")
    from torch.distributed.elastic.timer import api, debug_info_logging, local_timer

    def params(obj: Any) -> list[tuple[str, Any]]:
        return [(p.name, p.default) for p in inspect.signature(obj).parameters.values()]

    for module in (api, local_timer, debug_info_logging):
        for name in module.__all__:
            theirs, ours = getattr(module, name), getattr(wd, name)
            # Ours may add keyword-only parameters after torch's.
            assert params(ours)[: len(params(theirs))] == params(theirs), name
            if inspect.isabstract(theirs):
                assert ours.__abstractmethods__ == theirs.__abstractmethods__, name
            for method in ("acquire", "release", "size", "get", "start", "stop"):
                if hasattr(theirs, method):
                    assert params(getattr(ours, method)) == params(getattr(theirs, method))


def test_the_custom_timer_example_runs() -> None:
    out = subprocess.run(
        [sys.executable, str(REPO / "examples" / "custom_timer.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    lines = sorted(out.stdout.splitlines())
    assert [line.split(" after ")[0] for line in lines] == ["fast: finished", "stuck: reaped"]
