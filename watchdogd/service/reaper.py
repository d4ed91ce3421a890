"""What happens when a timer expires: stacks, the requested signal, then SIGKILL.

Rules
-----
- Each expired timer is recorded as a ``timer_expired`` event.
- A process gets at most one signal per expiry round, the one of its
  soonest expired timer with a signal ``> 0`` (torch semantics); a signal
  ``<= 0`` records without killing.
- Signals go through the pidfd taken when the process's first timer was
  armed, so they can only reach that very process.
- With stack dumps on, the hung process's Python stacks are captured and
  saved first (faulthandler if its client registered it, else py-spy),
  both together bounded by ``stack_dump_timeout``. Captures run as their
  own tasks: a slow one never delays another expiry. A faulthandler dump
  is complete at the client's end-of-dump marker, or, from a client that
  writes none, once its file stopped growing. Dump files are written, and
  a client's faulthandler file removed when it exits, by worker threads,
  bounded too: a hung disk never holds the loop. Old dumps are pruned
  after the signal, never before it.
- When the process is a worker whose group runs torch's NCCL flight
  recorder, every rank of that group on this node is made to dump its
  trace at the same time (a thread per rank polls for it), and the traces
  are saved with the stacks; the capture and the save are then bounded by
  the longer of ``stack_dump_timeout`` and ``flight_recorder_timeout``.
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

from watchdogd.core.config import Config
from watchdogd.core.flight_recorder import Recorder
from watchdogd.core.ports import EventSink, Metadata, Supervision
from watchdogd.core.timers import Timer
from watchdogd.linux import flight_recorder
from watchdogd.linux.procs import ProcessHandle, read_stat
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
        settings: Config,
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

    def attach(self, task_group: anyio.abc.TaskGroup) -> None:
        self._task_group = task_group
        task_group.start_soon(self.captures.run)
        if self.settings.stack_dumps != "off":
            self.stacks.prepare()

    # -- faulthandler registration (hello over the socket) -------------------------

    def register_faulthandler(
        self, handle: ProcessHandle, signal: int, marker: bool = False
    ) -> int | None:
        """A descriptor for the client's faulthandler output, or None when dumps are off.

        ``marker``: the client writes the end-of-dump marker after the dump.
        """
        if self.settings.stack_dumps in ("off", "py-spy"):
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

    def expire(self, expired: list[Timer]) -> None:
        chosen: set[int] = set()
        for timer in expired:
            self.stats.expired += 1
            handle = self.processes.process(timer.pid)
            first = timer.signal > 0 and timer.pid not in chosen
            if first:
                chosen.add(timer.pid)
            if (handle is not None and self._wants_dump(timer, first)) or self._escalates(timer):
                assert self._task_group is not None
                self._task_group.start_soon(self._reap, timer, handle, first)
            elif first:
                self._signal(timer, handle, None)
            else:
                self.events.emit("timer_expired", **describe(timer), action="recorded")

    def _wants_dump(self, timer: Timer, first: bool) -> bool:
        # Record-only timers get their dump too: that is often their point.
        if not (first or timer.signal <= 0):
            return False
        return self.settings.stack_dumps != "off" or bool(
            self.supervision.flight_recorders(timer.pid)
        )

    def _escalates(self, timer: Timer) -> bool:
        grace = self.settings.kill_grace
        return grace is not None and 0 < timer.signal != _signal.SIGKILL

    async def _reap(self, timer: Timer, handle: ProcessHandle | None, first: bool) -> None:
        dump = None
        if handle is not None and self._wants_dump(timer, first):
            dump = await self._capture(timer, handle)
        if not first:
            if dump is not None:
                self._prune_dumps()
            self.events.emit(
                "timer_expired",
                **describe(timer),
                action="recorded",
                dump=dump.id if dump else None,
            )
            return
        signalled = self._signal(timer, handle, dump)
        if dump is not None:
            self._prune_dumps()
        if not signalled or handle is None or not self._escalates(timer):
            return
        grace = self.settings.kill_grace
        assert grace is not None
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

    async def _capture(self, timer: Timer, handle: ProcessHandle) -> DumpInfo | None:
        """Stacks and the group's collective traces, taken together, then saved: bounded."""
        config = self.settings
        recorders = self.supervision.flight_recorders(timer.pid)
        bound = max(config.stack_dump_timeout, config.flight_recorder_timeout if recorders else 0)
        stacks: list[tuple[str, str]] = []
        traces: list[tuple[TraceInfo, bytes]] = []
        with anyio.move_on_after(bound):
            async with anyio.create_task_group() as tg:
                if config.stack_dumps != "off":
                    tg.start_soon(self._capture_stacks, timer, handle, stacks)
                for recorder in recorders:
                    tg.start_soon(self._collect_trace, recorder, traces)
            if stacks and not self._still_same(handle):
                stacks.clear()  # it exited meanwhile: what we read may be a newcomer's stacks
            if not stacks and not any(data for _, data in traces):
                return None
            method, text = stacks[0] if stacks else ("", "")
            traces.sort(key=lambda trace: trace[0].rank)
            # Saved before the signal, so that the dump exists once the process is
            # gone; in a thread, and within the same bound, so that a hung disk
            # delays the kill by at most that bound and the loop not at all.
            save = partial(self.stacks.save, timer.pid, timer.scope_id, method, text, traces)
            try:
                return await anyio.to_thread.run_sync(save, abandon_on_cancel=True)
            except OSError as e:
                log.error("cannot save the stack dump of pid %d: %s", timer.pid, e.strerror)
                return None
        if stacks or traces:
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
                text = await capture_pyspy(timer.pid)
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
        if handle.exited():
            return False
        try:
            return read_stat(handle.pid).start_time == handle.start_time
        except ProcessLookupError:
            return False

    def _signal(self, timer: Timer, handle: ProcessHandle | None, dump: DumpInfo | None) -> bool:
        events = self.events
        try:
            if handle is None:
                raise ProcessLookupError(timer.pid)
            handle.send_signal(timer.signal)
        except ProcessLookupError:
            self.stats.dropped += 1
            events.emit("timer_expired", **describe(timer), action="process already gone")
            return False
        except OSError as e:
            events.emit("timer_expired", **describe(timer), action=f"signal failed: {e.strerror}")
            return False
        late = time.monotonic() - timer.deadline
        self.observe_latency(late)
        self.stats.signalled += 1
        self.stats.signals[timer.signal] += 1
        self.supervision.timer_fired(timer.pid, timer.scope_id)
        events.emit(
            "timer_expired",
            **describe(timer),
            action="signalled",
            late_ms=round(late * 1000, 3),
            dump=dump.id if dump else None,
        )
        return True
