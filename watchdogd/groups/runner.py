"""One worker group at work: processes, logs and exits, driven by :class:`GroupMachine`.

Each group runs as one task. Its inbox holds the machine's inputs as typed
messages (:data:`~watchdogd.core.group_machine.Input`: a worker exited, a
worker is stuck in D state, an operator asked to stop or restart), each with
its reason; the runner feeds them to the machine and carries out what it
returns (spawn an attempt, signal ranks). Exits are learned from each
worker's pidfd becoming readable — from the event loop, not a polling
interval.

What only some groups have (a NUMA binding, warm spares, injected faults,
shared straggler scores, the D-state watch, a user's ``LogsSpecs``) are
:class:`~watchdogd.groups.features.Feature` s the runner iterates; starting
an attempt's workers is :class:`~watchdogd.groups.attempt.AttemptLauncher`'s.

Workers stop in the reverse of their start order, as groups do
(:meth:`Supervisor.stop_all <watchdogd.groups.supervisor.Supervisor.stop_all>`).
When a worker exits, whatever it left in its process group and its cell
(:mod:`~watchdogd.groups.containment`) is killed before the worker is
reaped, while its pid still names that group; the next attempt starts once
every cell of the last is empty.
"""

from __future__ import annotations

import logging
import math
import shutil
import signal
import socket
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import msgspec

from watchdogd.core.group_machine import (
    Action,
    Fail,
    Finished,
    GroupMachine,
    Input,
    Restart,
    Signal,
    Signalled,
    Spawn,
    Stop,
    Transition,
    Unhealthy,
    WorkerExited,
    WorkerStuck,
)
from watchdogd.core.ports import EventSink, GroupError, Hardware, StragglerShare
from watchdogd.core.progress import StepProgress
from watchdogd.core.quarantine import node_fault
from watchdogd.core.rdzv_state import Change, RendezvousError, RendezvousGracefulExitError
from watchdogd.core.workerenv import Placement, gpu_assignment
from watchdogd.groups.attempt import AttemptLauncher
from watchdogd.groups.containment import AttemptCells, Containment
from watchdogd.groups.failures import AttemptFailures
from watchdogd.groups.faults import FaultInjector, RankProcess
from watchdogd.groups.features import (
    CpuBinding,
    DStateWatch,
    FaultInjection,
    Feature,
    NoFaultInjection,
    NumaBinding,
    StragglerSharing,
    WarmSpares,
)
from watchdogd.groups.gpu_release import GpuRelease
from watchdogd.groups.logs_specs import CustomLogsSpecs, LogLayout, OwnLogs
from watchdogd.groups.rendezvous import Rendezvous, open_rendezvous
from watchdogd.groups.starters import CommandStarter, WorkerStarter
from watchdogd.groups.straggler_replacement import StragglerReplacement
from watchdogd.groups.workers import (
    Endpoints,
    Worker,
    WorkerIndex,
    describe_exit,
    visible_gpus,
)
from watchdogd_client.events import RdzvEvent
from watchdogd_client.groups import (
    Fault,
    GroupInfo,
    GroupSpec,
    GroupState,
    RendezvousInfo,
    WorkerInfo,
)

if TYPE_CHECKING:
    from watchdogd.groups.etcd_quarantine import EtcdQuarantine

__all__ = ["Endpoints", "GroupRunner", "WorkerIndex", "visible_gpus"]

log = logging.getLogger("watchdogd.supervisor")

_DRAIN_TIMEOUT = 2.0


def open_quarantine(
    spec: GroupSpec, rendezvous: Rendezvous, events: EventSink
) -> EtcdQuarantine | None:
    """The quarantine of an etcd group that keeps one (``quarantine_after``, or a straggler
    replaced, ``replace_stragglers_after``); None elsewhere: only etcd names nodes stably
    across agents and keeps a key past them."""
    keeps_one = spec.quarantine_after or spec.replace_stragglers_after is not None
    if spec.rendezvous.backend != "etcd" or not keeps_one:
        return None
    from watchdogd.groups.etcd_backend import EtcdBackend
    from watchdogd.groups.etcd_quarantine import EtcdQuarantine

    assert isinstance(rendezvous, EtcdBackend)
    return EtcdQuarantine(spec, rendezvous, events)


class GroupRunner:
    """One worker group: its machine, its processes, its logs."""

    def __init__(
        self,
        spec: GroupSpec,
        *,
        events: EventSink,
        endpoints: Endpoints,
        workers: WorkerIndex,
        hardware: Hardware,
        containment: Containment,
        starter: WorkerStarter | None = None,
        fault_injection: bool = False,
        stragglers: StragglerShare | None = None,
    ) -> None:
        """``fault_injection``: the daemon allows injected faults (the spec's, ``inject``)."""
        self.spec = spec
        self.events = events
        self.index = workers
        self.rendezvous = open_rendezvous(spec, self._rdzv_event)
        self.progress = StepProgress(spec.max_no_progress_restarts, spec.progress_scope)
        self.machine = GroupMachine(
            spec.nproc, self.rendezvous.local_restarts, spec.shutdown_timeout, self.progress
        )
        workers.track(spec.name, self.progress)
        self.workers: dict[int, Worker] = {}
        """The latest attempt's, in start order."""
        self.do_not_requeue: list[str] = []
        """Once it failed: why the run must not be requeued (empty: a requeue may help)."""
        self.started_at = time.time()
        self.oom_kills = 0
        """Processes of its workers' cells the OOM killer ended, over all attempts."""
        self.placement: Placement | None = None
        try:
            self.gpus = gpu_assignment(spec, visible_gpus())
        except ValueError as e:
            raise GroupError(f"group {spec.name}: {e}") from None
        # Every worker gets torch's error file, as under torchrun: beside its logs when
        # there are logs, else in a directory of the group's own, kept only if it failed.
        self.run_dir = (
            Path(spec.log_dir) / spec.name
            if spec.log_dir is not None
            else Path(tempfile.mkdtemp(prefix=f"watchdogd-{spec.name}-"))
        )
        self.finished = anyio.Event()
        self._meeting: anyio.CancelScope | None = None
        """From an attempt's start to its round: a change of the last round is old news,
        and a stop ends the wait (no worker to stop)."""
        self._inbox_send, self._inbox = anyio.create_memory_object_stream[Input](math.inf)
        self.binding = (
            NumaBinding(spec, spec.numa_binding, hardware, events)
            if spec.numa_binding is not None
            else CpuBinding()
        )
        logs: LogLayout = (
            CustomLogsSpecs(spec, spec.logs_specs) if spec.logs_specs is not None else OwnLogs(spec)
        )
        # First: the last attempt's processes are gone before anything else prepares.
        self.cells = AttemptCells(containment, spec.name, events, spec.worker_memory_max)
        # Second: a node set aside leaves the job once its last attempt is gone.
        self.quarantine: EtcdQuarantine | None = open_quarantine(spec, self.rendezvous, events)
        self.failures = AttemptFailures(
            self.progress, socket.gethostname(), spec.max_no_progress_restarts + 1, self.quarantine
        )
        quarantine = [] if self.quarantine is None else [self.quarantine]
        self.features: list[Feature] = [self.cells, *quarantine, self.binding, logs]
        """In the order they start; they close in the reverse."""
        if starter is None:
            starter = CommandStarter(spec)
            if spec.prewarm:
                spares = WarmSpares.for_group(
                    spec, events, endpoints, self.gpus, self.binding, self.cells.cell
                )
                starter = spares.pool
                workers.watch_work(spec.name, spares.at_work)
                self.features.append(spares)
        self.faults: FaultInjection | NoFaultInjection = NoFaultInjection(spec.name)
        if fault_injection:
            injector = FaultInjector(
                spec.name, events, self._running_rank, self.index.mark_injected
            )
            self.faults = FaultInjection(injector, spec.faults)
            self.features.append(self.faults)
        if stragglers is not None:
            self.features.append(
                StragglerSharing(stragglers, spec.name, self.rendezvous, lambda: self.placement)
            )
            after = spec.replace_stragglers_after
            if after is not None and self.quarantine is not None:
                replacement = StragglerReplacement(
                    after, stragglers, self.quarantine, spec.nproc, self._in_round, self._post
                )
                self.features.append(replacement)
        if spec.uninterruptible_state_timeout:
            timeout = spec.uninterruptible_state_timeout
            self.features.append(DStateWatch(timeout, lambda: self.workers, self._post))
        # Last: the spares warm while it waits.
        self.features.append(
            GpuRelease(spec.name, spec.gpu_release_timeout, hardware, lambda: self.workers, events)
        )
        self.launcher = AttemptLauncher(
            spec,
            events=events,
            endpoints=endpoints,
            index=workers,
            starter=starter,
            logs=logs,
            binding=self.binding,
            cells=self.cells,
            features=self.features,
            gpus=self.gpus,
            run_dir=self.run_dir,
            hostname=socket.gethostname(),
        )

    # -- control -----------------------------------------------------------------

    def stop(self) -> None:
        self._control(Stop())

    def restart(self) -> None:
        self._control(Restart())

    def signalled(self, signum: int) -> None:
        """The launcher received ``signum``: pass it to the workers and stop the group."""
        self._control(Signalled(signum))

    def mark_unhealthy(self, reason: str) -> None:
        self._control(Unhealthy(reason))

    def inject(self, fault: Fault) -> None:
        """Inject ``fault`` ``fault.after`` seconds from now; GroupError if it cannot be."""
        self.faults.inject(fault, sorted(worker.rank for worker in self.workers.values()))

    def uses_gpu(self, index: int) -> bool:
        """Whether any worker may see GPU ``index`` (all of them, if unrestricted)."""
        return any(
            devices is None or str(index) in devices.split(",") for devices in self.gpus.values()
        )

    def _control(self, event: Input) -> None:
        if self.finished.is_set():
            raise GroupError(f"group {self.spec.name} is not running ({self.state.value})")
        if self._meeting is not None and isinstance(event, Stop | Signalled):
            self._meeting.cancel()  # a standby, or a node set aside: no worker runs
        self._post(event)

    def _post(self, event: Input) -> None:
        self._inbox_send.send_nowait(event)

    def _in_round(self) -> Placement | None:
        """This node's round while its attempt runs in it (None while it meets the job)."""
        return None if self._meeting is not None else self.placement

    def _running_rank(self, rank: int) -> RankProcess | None:
        """The injector's view of global rank ``rank``'s worker, while it runs."""
        for worker in self.workers.values():
            if worker.rank == rank and worker.exitcode is None:
                return RankProcess(worker.child, worker.local_rank)
        return None

    @property
    def state(self) -> GroupState:
        return self.machine.state

    def info(self) -> GroupInfo:
        return GroupInfo(
            name=self.spec.name,
            state=self.machine.state,
            attempt=self.machine.attempt,
            restarts_left=self.rendezvous.restarts_left(self.machine.restarts_left),
            workers=[
                WorkerInfo(
                    local_rank=w.local_rank,
                    rank=w.rank,
                    pid=w.pid,
                    exitcode=w.exitcode,
                    memory_peak_bytes=w.memory_peak(),
                )
                for w in self.workers.values()
            ],
            last_failure=self.failures.last,
            rendezvous=self._rendezvous_info(),
            spares=[info for feature in self.features for info in feature.spare_infos()],
            started_at=self.started_at,
            oom_kills=self.oom_kills,
            failed_without_progress=self.progress.streak,
        )

    def _rendezvous_info(self) -> RendezvousInfo | None:
        info = self.rendezvous.info()
        if info is None or self.quarantine is None or self.quarantine.reason is None:
            return info
        return msgspec.structs.replace(info, quarantined=self.quarantine.reason)

    # -- the loop ----------------------------------------------------------------

    async def run(self) -> GroupState:
        """Run the group to a final state (or STOPPED); every worker is gone on return."""
        try:
            async with self.rendezvous, anyio.create_task_group() as tg:
                tg.start_soon(self.rendezvous.watch, self._membership_changed)
                for feature in self.features:
                    feature.start(tg)
                # Caught here, inside the task group, or it would leave wrapped in a group.
                try:
                    final = await self._run_attempts()
                except RendezvousGracefulExitError as e:  # a standby the job ended without
                    final = await self._not_needed(str(e))
                except RendezvousError as e:
                    final = await self._cannot_run(str(e), exitcode=1)
                except GroupError as e:  # an attempt that cannot start: no restart helps
                    self.events.emit("group_error", group=self.spec.name, reason=str(e))
                    final = await self._cannot_run(str(e), exitcode=127)
                if final is GroupState.UNHEALTHY and self.quarantine is not None:
                    # The node's beyond doubt: it leaves the job, which goes on without it.
                    await self.quarantine.unhealthy(self.machine.reason)
                else:
                    await self.rendezvous.finish(final)
                tg.cancel_scope.cancel()
            return final
        finally:
            with anyio.CancelScope(shield=True):
                await self._kill_everything()
                for feature in reversed(self.features):
                    await feature.aclose()
            self._drop_run_dir()
            self.index.untrack(self.spec.name)
            self._inbox_send.close()
            self._inbox.close()
            self.finished.set()

    def _drop_run_dir(self) -> None:
        """Remove the group's own directory unless it holds the error file of a failure."""
        if self.spec.log_dir is not None:
            return  # the operator's
        if self.machine.state is GroupState.SUCCEEDED or not any(
            self.run_dir.glob("attempt_*/*/error.json")
        ):
            shutil.rmtree(self.run_dir, ignore_errors=True)

    async def _cannot_run(self, reason: str, *, exitcode: int) -> GroupState:
        self.failures.group_failed(reason, exitcode)
        await self._apply(self.machine.error(reason))
        return GroupState.FAILED

    async def _not_needed(self, reason: str) -> GroupState:
        await self._apply(self.machine.not_needed(reason))
        return GroupState.SUCCEEDED

    async def _run_attempts(self) -> GroupState:
        final = await self._apply(self.machine.start())
        while final is None:
            final = await self._apply(await self._next_input())
        return final

    def _membership_changed(self, change: Change) -> None:
        if self.finished.is_set() or self._meeting is not None:
            return  # the end of a round this node already left (it waits for the next)
        match change:
            case "waiting":
                self._control(Restart())  # scale-up: a new round, not a failure
            case "lost":
                self._control(Fail("a node of the job was lost"))
            case "fenced":
                self._control(
                    Fail("fenced: this node's lease on the rendezvous could not be renewed")
                )
            case "closed":
                self._control(Stop())

    def _rdzv_event(self, event: RdzvEvent) -> None:
        self.events.emit(
            f"rdzv_{event.name}",
            group=self.spec.name,
            run_id=event.run_id,
            node_state=event.node_state.value,
            rank=event.rank,
            master_endpoint=event.master_endpoint,
            message=event.message,
            error=event.error_trace or None,
        )

    async def _next_input(self) -> list[Action]:
        wake = self.machine.next_wake()
        delay = math.inf if wake is None else max(0.0, wake - time.monotonic())
        with anyio.move_on_after(delay):
            event = await self._inbox.receive()
            self._before_machine(event)
            return self.machine.feed(event, time.monotonic())
        return self.machine.tick(time.monotonic())

    def _before_machine(self, event: Input) -> None:
        """What the group records of ``event`` itself, before the machine takes it."""
        match event:
            case WorkerExited(local_rank, exitcode, attempt):
                worker = self.workers.get(local_rank)
                if worker is not None and worker.attempt == attempt:
                    self._report_exit(worker, exitcode)
            case WorkerStuck(local_rank) if local_rank in self.workers:
                reason = "stuck in uninterruptible sleep (D state)"
                self.failures.record(self.workers[local_rank], 0, reason)

    async def _apply(self, actions: list[Action]) -> GroupState | None:
        final = None
        for action in actions:
            match action:
                case Transition(old, new, reason, attempt):
                    self.events.emit(
                        "group_state",
                        group=self.spec.name,
                        old=old.value,
                        state=new.value,
                        reason=reason,
                        attempt=attempt,
                        run_id=self.spec.rendezvous.run_id,
                        role=self.spec.role,
                        hostname=self.launcher.hostname,
                        agent_restarts=self.machine.restarts_used,
                    )
                case Spawn(attempt, restart_count):
                    if not await self._start_attempt(attempt, restart_count):
                        reason = "stopped while it waited for its place in the job"
                        final = await self._apply(self.machine.abandon(reason))
                case Signal(local_ranks, signum):
                    for worker in self._stop_order(local_ranks):
                        worker.child.send_signal(signum)
                case Finished(state):
                    final = state
                    if state is GroupState.FAILED:
                        self.do_not_requeue = self.failures.do_not_requeue()
                        self._emit_do_not_requeue()
        return final

    def _emit_do_not_requeue(self) -> None:
        if self.progress.exhausted:
            self.events.emit_at(
                logging.ERROR,
                "no_progress",
                group=self.spec.name,
                attempts=self.progress.streak,
                causes="; ".join(self.do_not_requeue[1:]),
            )
        elif self.do_not_requeue:
            bad = self.failures.bad_program
            assert bad.failure is not None
            self.events.emit_at(
                logging.ERROR,
                "bad_program",
                group=self.spec.name,
                attempts=bad.attempts,
                ranks=", ".join(map(str, sorted(bad.ranks))),
                exitcode=bad.failure.exitcode,
                error=bad.failure.error,
            )

    def _stop_order(self, local_ranks: Iterable[int]) -> list[Worker]:
        """These workers, the last started first."""
        chosen = set(local_ranks)
        return [w for w in reversed(self.workers.values()) if w.local_rank in chosen]

    # -- processes ---------------------------------------------------------------

    async def _start_attempt(self, attempt: int, restart_count: int) -> bool:
        """Meet the job, then start the workers; False when stopped before they started."""
        meeting = self._meeting = anyio.CancelScope()
        try:
            with meeting:
                # Before rendezvous: a node that cannot start holds nobody up, spares warm.
                for feature in self.features:
                    await feature.prepare()
                self.workers = {}  # the last attempt's are all gone: none shown while nodes meet
                self.failures.new_attempt()
                waiting_since = time.monotonic()
                placement, restart_count = await self.rendezvous.next_round(restart_count)
        finally:
            self._meeting = None
        if meeting.cancelled_caught:
            return False
        self.placement = placement
        self.failures.bad_program.attempt_started()
        # Every backend's round, the static one's too: a job's timeline shows each.
        self.events.emit(
            "rendezvous_round",
            group=self.spec.name,
            attempt=attempt,
            run_id=placement.run_id,
            group_rank=placement.group_rank,
            group_world_size=placement.group_world_size,
            master=f"{placement.master_addr}:{placement.master_port}",
            waited_s=round(time.monotonic() - waiting_since, 3),
            hostname=self.launcher.hostname,
        )
        await self.launcher.start(attempt, restart_count, placement, self.workers, self._exited)
        return True

    def _exited(self, worker: Worker) -> None:
        """Its pidfd is readable: it is a zombie, and its process group id not reusable yet."""
        worker.child.kill_group()
        exitcode = worker.child.wait()
        # Read before the cell goes (at the next attempt's start): the OOM killer's count.
        worker.memory_at_exit = worker.read_memory()
        if worker.memory_at_exit is not None:
            self.oom_kills += worker.memory_at_exit.oom_kills
        self.index.remove(worker.pid)
        worker.exited.set()
        self._post(WorkerExited(worker.local_rank, exitcode, worker.attempt))

    def _report_exit(self, worker: Worker, exitcode: int) -> None:
        expired_scope = self.index.take_expired_scope(worker.pid)
        notes = [note for f in self.features if (note := f.failure_note(worker.pid)) is not None]
        failed = exitcode != 0 and self.machine.state is GroupState.HEALTHY
        memory = worker.memory_at_exit
        oom_kills = memory.oom_kills if memory is not None else 0
        if failed:
            reason = describe_exit(exitcode, oom_kills)
            if expired_scope is not None:
                reason += f" (watchdogd: timer {expired_scope!r} expired)"
            reason += "".join(f" ({note})" for note in notes)
            hung = expired_scope is not None
            fault = node_fault(exitcode, oom_kills=oom_kills, timer_expired=hung)
            self.failures.record(worker, exitcode, reason, oom_kills, fault)
        self.events.emit_at(
            logging.WARNING if failed else logging.DEBUG,
            "worker_failed" if failed else "worker_exited",
            **worker.about,
            exitcode=exitcode,
            reason=self.failures.last.reason if failed and self.failures.last else None,
            total_run_time=round(time.time() - worker.started, 3),
            raw_error=self.failures.last.error_message if failed and self.failures.last else None,
            oom_kills=oom_kills,
            memory_peak_bytes=memory.peak_bytes if memory is not None else None,
        )

    async def _kill_everything(self) -> None:
        """On the way out: no worker survives, no output is lost; the last started goes first."""
        workers = self._stop_order(self.workers)
        for worker in workers:
            worker.child.send_signal(signal.SIGKILL)
        copiers = self.launcher.copiers
        with anyio.move_on_after(_DRAIN_TIMEOUT) as drain:
            for worker in workers:
                await worker.exited.wait()
            for copier in copiers:
                await copier.done.wait()
            # The consoles' threads may still be writing what the copiers handed them.
            for console in {c.console for c in copiers if c.console is not None}:
                left = drain.deadline - anyio.current_time()
                await anyio.to_thread.run_sync(console.flush, left)
        for copier in copiers:
            copier.close()
        for worker in workers:
            if worker.exited.is_set():
                continue  # reaped by _exited
            if worker.child.let_go() is None:
                log.warning("worker pid %d did not exit after SIGKILL; left behind", worker.pid)
            self.index.remove(worker.pid)
