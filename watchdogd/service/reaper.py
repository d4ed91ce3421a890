"""What happens when a timer expires: stacks, the requested signal, then SIGKILL.

Rules
-----
- Each expired timer is recorded as a ``timer_expired`` event.
- A process gets at most one signal per expiry round, the one of its
  soonest expired timer with a signal ``> 0`` (torch semantics); a signal
  ``<= 0`` records without killing.
- Signals go through the pidfd taken when the process's first timer was
  armed, so they can only reach that very process.
- With stack dumps on, the hung process's Python stacks are captured
  first (faulthandler if its client registered it, else py-spy), bounded
  by ``stack_dump_timeout``; the signal goes out as soon as they are read.
  Captures run as their own tasks: a slow one never delays another
  expiry. A faulthandler dump is complete at the client's end-of-dump
  marker, or, from a client that writes none, once its file stopped
  growing. The dump is saved after the signal, by worker threads (a few
  at a time), each save bounded too, and the ``timer_expired`` event that
  names it is recorded once it is saved: a hung disk delays events, never
  a kill or the loop. Old dumps are pruned after that.
- A stopped process (``T``, SIGSTOP; ``t``, a tracer's stop) runs no
  handler and writes no dump: it is signalled at once, its own stacks
  and trace are not asked for, and its ``timer_expired`` event says
  ``stopped=True``.
- The expiry of a worker a drill's fault was injected into is the
  drill's: its event says ``injected=True`` and it is counted apart.
- When the process is a worker whose group runs torch's NCCL flight
  recorder, every rank of that group on this node is made to dump its
  trace at the same time (a thread per rank polls for it), and the traces
  are saved with the stacks; the capture and the save are then each
  bounded by the longer of ``stack_dump_timeout`` and
  ``flight_recorder_timeout``.
- When the requested signal is not SIGKILL and the process is still alive
  ``kill_grace`` seconds later, it gets SIGKILL.
"""

from __future__ import annotations

import logging
import signal as _signal
import time
from collections.abc import Callable
from functools import partial
from typing import Protocol

import anyio
import anyio.abc
import anyio.to_thread

from watchdogd.core.config import ReaperSettings
from watchdogd.core.flight_recorder import Recorder
from watchdogd.core.ports import EventSink, Metadata, Supervision
from watchdogd.core.timers import Timer
from watchdogd.linux import flight_recorder
from watchdogd.linux.procs import ProcessHandle, read_stat, still_runs
from watchdogd.linux.stacks import (
    DumpInfo,
    FaulthandlerCaptures,
    StackStore,
    TraceInfo,
    capture_pyspy,
)
from watchdogd.service.stats import Stats

__all__ = ["Reaper"]

log = logging.getLogger("watchdogd")


class ProcessLookup(Protocol):
    def process(self, pid: int) -> ProcessHandle | None:
        """The process a timer of ``pid`` was armed on, while it is watched."""
        ...

    def pin(self, pid: int) -> ProcessHandle | None:
        """The process ``pid``, watched from now on; None if it is gone."""
        ...


_GONE = "process already gone"
_RECORDED = "recorded"
Expiry = tuple[Timer, float | str]
"""An expired timer and how late its signal went out (s), else ``_RECORDED`` or why not."""
_Captured = tuple[str, str, list[tuple[TraceInfo, bytes]]]
"""A capture not yet saved: the stacks' method and text, and the ranks' traces."""
_SAVERS = 4


def _stopped(handle: ProcessHandle) -> bool:
    """Whether the process is stopped (``T``) or stopped by its tracer (``t``)."""
    if handle.exited():
        return False
    try:
        stat = read_stat(handle.pid)
    except ProcessLookupError:
        return False
    return stat.start_time == handle.start_time and stat.state in ("T", "t")


def describe(timer: Timer) -> dict[str, Metadata]:
    return {
        "pid": timer.pid,
        "scope_id": timer.scope_id,
        "signal": timer.signal,
        "source": timer.source,
        "uid": None if timer.uid < 0 else timer.uid,
    }


class Reaper:
    def __init__(
        self,
        settings: ReaperSettings,
        *,
        processes: ProcessLookup,
        events: EventSink,
        stats: Stats,
        supervision: Supervision,
        stacks: StackStore,
        observe_latency: Callable[[float], None],
    ) -> None:
        self.settings = settings
        self.processes = processes
        self.events = events
        self.stats = stats
        self.supervision = supervision
        self.stacks = stacks
        self.observe_latency = observe_latency
        # pid -> (start time, signal, writes the end-of-dump marker) of clients
        # that registered faulthandler with us.
        self.faulthandlers: dict[int, tuple[int, int, bool]] = {}
        self.captures = FaulthandlerCaptures()
        self._task_group: anyio.abc.TaskGroup | None = None
        self._pruning = False
        self._prune_again = False
        # A few threads save: a save is ~0.2 ms of file writes, and a hundred
        # saving threads at once, each wanting the GIL back after its write,
        # held the loop's thread off it for 50+ ms while it reaped the dead.
        self._savers = anyio.CapacityLimiter(_SAVERS)
        self.capturing = 0
        """Expiries whose dump is being taken: their signal is still to come."""

    def attach(self, task_group: anyio.abc.TaskGroup) -> None:
        self._task_group = task_group
        task_group.start_soon(self.captures.run)
        if self.settings.stack_dumps != "off":
            self.stacks.prepare()

    def reconfigure(self, settings: ReaperSettings) -> None:
        """Apply reloaded settings from the next expiry on (one under way keeps its own)."""
        # Dumps a reload turns on need the directory a start with them off never made.
        if settings.stack_dumps != "off" and self._task_group is not None:
            self.stacks.prepare()
        self.settings = settings

    # -- faulthandler registration (hello over the socket) -------------------------

    def register_stack_dumps(self, pid: int, signal: int, marker: bool = False) -> int | None:
        """A descriptor for the client's faulthandler output; None when not wanted.

        ``marker``: the client writes the end-of-dump marker after each dump.
        """
        if not 0 < signal < 65 or signal == 9:
            return None
        if self.settings.stack_dumps in ("off", "py-spy"):
            return None
        handle = self.processes.pin(pid)
        if handle is None:
            return None
        fd = self.stacks.faulthandler_file(handle.pid, handle.start_time)
        self.faulthandlers[handle.pid] = (handle.start_time, signal, marker)
        return fd

    def forget(self, handle: ProcessHandle) -> None:
        registered = self.faulthandlers.pop(handle.pid, None)
        if registered is not None:
            assert self._task_group is not None  # registered over the socket: after attach
            self._task_group.start_soon(self._remove_live_file, handle.pid, registered[0])

    async def _remove_live_file(self, pid: int, start_time: int) -> None:
        # An unlink waits for the filesystem's journal: off the loop, and bounded,
        # since a thread that hangs holds one of the few worker-thread tokens
        # until it is given up.
        timeout = self.settings.stack_dump_timeout
        remove = partial(self.stacks.forget_process, pid, start_time)
        with anyio.move_on_after(timeout):
            try:
                await anyio.to_thread.run_sync(remove, abandon_on_cancel=True)
            except OSError as e:
                log.warning("cannot remove the faulthandler file of pid %d: %s", pid, e.strerror)
            return
        log.warning(
            "removing the faulthandler file of pid %d took over %g s: left to finish on its own",
            pid,
            timeout,
        )

    # -- expiry --------------------------------------------------------------------

    def expire(self, expired: list[Timer]) -> list[Expiry]:
        """Signal the processes of ``expired`` (soonest first); what :meth:`record` records.

        The caller records once every timer due meanwhile was signalled too:
        with a hundred timers due at once, the last kill waits for a hundred
        signals, not for a hundred events as well.
        """
        chosen: set[int] = set()
        done: list[Expiry] = []
        for timer in expired:
            self.stats.expired += 1
            if self.supervision.injected(timer.pid):
                self.stats.expired_injected += 1
            handle = self.processes.process(timer.pid)
            first = timer.signal > 0 and timer.pid not in chosen
            if first:
                chosen.add(timer.pid)
            if handle is not None and self._wants_dump(timer, first):
                assert self._task_group is not None
                self._task_group.start_soon(self._reap, timer, handle, first)
            elif first:
                done.append((timer, self._send(timer, handle)))
            else:
                done.append((timer, _RECORDED))
        return done

    def record(self, done: list[Expiry]) -> None:
        for timer, outcome in done:
            self._report(timer, outcome, None, self._marks(timer, stopped=False))

    def _wants_dump(self, timer: Timer, first: bool) -> bool:
        # Record-only timers get their dump too: that is often their point.
        if not (first or timer.signal <= 0):
            return False
        return self.settings.stack_dumps != "off" or bool(
            self.supervision.flight_recorders(timer.pid)
        )

    async def _reap(self, timer: Timer, handle: ProcessHandle, first: bool) -> None:
        """Capture the dump, signal (or only record), then save the dump and record.

        The save waits for a worker thread (~1 ms, p99 ~2 ms on a 2-core
        node): after the signal, it delays the event, not the kill.
        """
        stopped = _stopped(handle)
        marks = self._marks(timer, stopped)  # before its exit takes it out of the index
        self.capturing += 1
        try:
            captured = await self._capture(timer, handle, stopped)
        finally:
            self.capturing -= 1
        outcome = self._send(timer, handle) if first else _RECORDED
        dump = None
        try:
            dump = await self._save(timer, captured)
        finally:  # recorded even if the daemon stops meanwhile
            self._report(timer, outcome, dump, marks)

    async def _escalate(self, timer: Timer, handle: ProcessHandle, grace: float) -> None:
        """SIGKILL the process if it outlives its signal by ``grace`` (``kill_grace``)."""
        await anyio.sleep(grace)
        if self.processes.process(timer.pid) is handle and not handle.exited():
            try:
                handle.send_signal(_signal.SIGKILL)
            except ProcessLookupError:
                return
            self.stats.escalated += 1
            self.events.emit(
                "process_escalated", pid=timer.pid, scope_id=timer.scope_id, after_s=grace
            )

    async def _capture(
        self, timer: Timer, handle: ProcessHandle, stopped: bool
    ) -> _Captured | None:
        """Stacks and the group's collective traces, taken together: bounded.

        ``stopped``: the process cannot answer, so only its peers' traces are asked for.
        """
        config = self.settings
        recorders = self.supervision.flight_recorders(timer.pid)
        if stopped:
            recorders = [recorder for recorder in recorders if recorder.pid != timer.pid]
        bound = max(config.stack_dump_timeout, config.flight_recorder_timeout if recorders else 0)
        stacks: list[tuple[str, str]] = []
        traces: list[tuple[TraceInfo, bytes]] = []
        with anyio.move_on_after(bound):
            async with anyio.create_task_group() as tg:
                if config.stack_dumps != "off" and not stopped:
                    tg.start_soon(self._capture_stacks, timer, handle, stacks)
                for recorder in recorders:
                    tg.start_soon(self._collect_trace, recorder, traces)
        if stacks and not self._still_same(handle):
            stacks.clear()  # it exited meanwhile: what we read may be a newcomer's stacks
        if not stacks and not any(data for _, data in traces):
            return None
        method, text = stacks[0] if stacks else ("", "")
        traces.sort(key=lambda trace: trace[0].rank)
        return method, text, traces

    async def _save(self, timer: Timer, captured: _Captured | None) -> DumpInfo | None:
        """Save what was captured, in a thread and bounded (a hung disk delays only the event)."""
        if captured is None:
            return None
        method, text, traces = captured
        config = self.settings
        bound = max(config.stack_dump_timeout, config.flight_recorder_timeout if traces else 0)
        save = partial(self.stacks.save, timer.pid, timer.scope_id, method, text, traces)
        async with self._savers:  # waiting for a turn is not the save's time
            with anyio.move_on_after(bound):
                try:
                    dump = await anyio.to_thread.run_sync(save, abandon_on_cancel=True)
                except OSError as e:
                    log.error("cannot save the stack dump of pid %d: %s", timer.pid, e.strerror)
                    return None
                self._prune_dumps()
                return dump
        log.error(
            "saving the stack dump of pid %d took over %g s: left to finish on its own",
            timer.pid,
            bound,
        )
        return None

    async def _capture_stacks(
        self, timer: Timer, handle: ProcessHandle, found: list[tuple[str, str]]
    ) -> None:
        """Append ``(method, text)``: faulthandler if the client registered it, else py-spy."""
        config = self.settings
        registered = self.faulthandlers.get(timer.pid)
        with anyio.move_on_after(config.stack_dump_timeout):
            text = None
            if registered is not None and registered[0] == handle.start_time:
                _, signal, marker = registered
                path = self.stacks.live_path(timer.pid, handle.start_time)
                text = await self.captures.capture(handle, path, signal, marker)
                method = "faulthandler"
            if text is None and config.stack_dumps in ("auto", "py-spy") and not handle.exited():
                text = await capture_pyspy(timer.pid, config.stack_dump_timeout)
                method = "py-spy"
            if text is not None:
                found.append((method, text))

    def _prune_dumps(self) -> None:
        """Keep the newest ``dumps_kept`` dumps: one pruning at a time, after the signal."""
        if self._pruning:
            self._prune_again = True  # the running one may have listed before this dump
            return
        assert self._task_group is not None
        self._pruning = True
        self._task_group.start_soon(self._prune_task)

    async def _prune_task(self) -> None:
        try:
            while True:
                self._prune_again = False
                with anyio.move_on_after(self.settings.stack_dump_timeout):
                    try:
                        await anyio.to_thread.run_sync(self.stacks.prune, abandon_on_cancel=True)
                    except OSError as e:
                        log.warning("cannot prune the stack dumps: %s", e.strerror)
                if not self._prune_again:
                    return
        finally:
            self._pruning = False

    async def _collect_trace(
        self, recorder: Recorder, found: list[tuple[TraceInfo, bytes]]
    ) -> None:
        """Append one rank's flight-recorder trace, or why there is none."""
        timeout = self.settings.flight_recorder_timeout
        collect = partial(flight_recorder.collect, recorder, time.monotonic() + timeout)
        collected = await anyio.to_thread.run_sync(collect, abandon_on_cancel=True)
        if collected.problem:
            log.warning(
                "flight recorder of rank %d (pid %d): %s",
                recorder.rank,
                recorder.pid,
                collected.problem,
            )
        info = TraceInfo(
            rank=recorder.rank,
            pid=recorder.pid,
            size=len(collected.data),
            problem=collected.problem,
        )
        found.append((info, collected.data))

    @staticmethod
    def _still_same(handle: ProcessHandle) -> bool:
        return not handle.exited() and still_runs(handle.pid, handle.start_time)

    def _send(self, timer: Timer, handle: ProcessHandle | None) -> float | str:
        """Send the timer's signal, count it, arm its escalation: how late it went out (s),
        or why it did not. Its event is :meth:`_report`'s, once the dump is saved."""
        try:
            if handle is None:
                raise ProcessLookupError(timer.pid)
            handle.send_signal(timer.signal)
        except ProcessLookupError:
            self.stats.dropped += 1
            return _GONE
        except OSError as e:
            return f"signal failed: {e.strerror}"
        late = time.monotonic() - timer.deadline
        self.observe_latency(late)
        self.stats.signalled += 1
        self.stats.signals[timer.signal] += 1
        # Before the loop can see the exit: the supervisor names the timer as its cause.
        self.supervision.timer_fired(timer.pid, timer.scope_id)
        # The grace as of the signal: a reload before the task starts changes nothing.
        grace = self.settings.kill_grace
        if grace is not None and 0 < timer.signal != _signal.SIGKILL:
            assert self._task_group is not None
            self._task_group.start_soon(self._escalate, timer, handle, grace)
        return late

    def _marks(self, timer: Timer, stopped: bool) -> dict[str, Metadata]:
        """What the event adds: the process was stopped (why it has no dump), and the
        expiry is a drill's."""
        marks: dict[str, Metadata] = {"stopped": True} if stopped else {}
        if self.supervision.injected(timer.pid):
            marks["injected"] = True
        return marks

    def _report(
        self,
        timer: Timer,
        outcome: float | str,
        dump: DumpInfo | None,
        marks: dict[str, Metadata],
    ) -> None:
        """Record what :meth:`_send` did (``_RECORDED``: a timer that signals nothing)."""
        if isinstance(outcome, str):
            dumped = {"dump": dump.id if dump else None} if outcome is _RECORDED else {}
            self.events.emit("timer_expired", **describe(timer), action=outcome, **dumped, **marks)
            return
        self.events.emit(
            "timer_expired",
            **describe(timer),
            action="signalled",
            late_ms=round(outcome * 1000, 3),
            dump=dump.id if dump else None,
            **marks,
        )
