"""One worker group at work: processes, logs and exits, driven by :class:`GroupMachine`.

Each group runs as one task. It feeds the machine what happens (a worker
exited, a worker is stuck in D state, an operator asked to stop or restart)
and carries out what the machine returns (spawn an attempt, signal ranks).
Exits are learned from each worker's pidfd becoming readable — from the
event loop, not a polling interval.

Workers start in their own session, so a signal to a worker reaches its
whole process group (data loaders, compilers) and nothing is orphaned:
when a worker exits, whatever it left in its group is killed before the
worker is reaped, while its pid still names that group.

With ``numa_binding``, each worker starts bound to the CPUs near its GPU
(:mod:`watchdogd.core.numa` decides, from the ``Hardware`` port, once per
group, in a thread since NVML and sysfs block): the loop's thread binds
itself for the ``Popen`` call and unbinds right after
(:func:`watchdogd.linux.numa.bound_to`), so no ``numactl`` is needed.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import signal
import socket
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import NamedTuple

import anyio
import anyio.abc
import msgspec

from watchdogd.core.dstate import DStateDetector
from watchdogd.core.flight_recorder import Recorder, recorder_paths
from watchdogd.core.group_machine import Action, Finished, GroupMachine, Signal, Spawn, Transition
from watchdogd.core.job_stragglers import decode_summary, encode_summary
from watchdogd.core.numa import NumaError, bind, cuda_devices, format_cpulist
from watchdogd.core.ports import (
    EventSink,
    GroupError,
    Hardware,
    StragglerShare,
    SupervisedWorker,
)
from watchdogd.core.rdzv_state import Change, RendezvousError
from watchdogd.core.workerenv import (
    Placement,
    StreamRoute,
    attempt_dir,
    gpu_assignment,
    group_devices,
    log_prefix,
    python_command,
    rank_stable_env,
    routes_from_logs_dest,
    stream_routes,
    worker_env,
)
from watchdogd.groups.faults import FaultInjector, RankProcess
from watchdogd.groups.logs_specs import CustomLogsSpecs
from watchdogd.groups.rendezvous import open_rendezvous
from watchdogd.groups.spares import SparePool
from watchdogd.groups.starters import CommandStarter, WorkerProcess, WorkerStarter
from watchdogd.groups.worker_logs import StreamCopier, Target, open_target, start_copier
from watchdogd.linux import aio
from watchdogd.linux.procs import read_stat
from watchdogd_client._proc import pidfd_exited
from watchdogd_client.events import RdzvEvent
from watchdogd_client.groups import (
    Failure,
    Fault,
    GroupInfo,
    GroupSpec,
    GroupState,
    WorkerInfo,
)

__all__ = ["Endpoints", "GroupRunner", "WorkerIndex", "describe_exit", "visible_gpus"]

log = logging.getLogger("watchdogd.supervisor")

_DRAIN_TIMEOUT = 2.0
# NVML's init can take a second or more on GPUs without persistence mode.
_HARDWARE_TIMEOUT = 30.0


class Endpoints(NamedTuple):
    """The timer service's endpoints, handed to every worker."""

    socket_path: str
    fifo_path: str


class WorkerIndex:
    """The workers this daemon launched, by pid: the timer service's ``Supervision`` port.

    FIFO requests may target these pids; a timer that signals one is kept
    for its group's failure report.
    """

    def __init__(self) -> None:
        self._workers: dict[int, SupervisedWorker] = {}
        self._expired_scopes: dict[int, str] = {}
        # group -> pid -> the flight recorder of that rank, for workers that run one.
        self._recorders: dict[str, dict[int, Recorder]] = {}

    def add(self, pid: int, worker: SupervisedWorker, recorder: Recorder | None = None) -> None:
        self._workers[pid] = worker
        if recorder is not None:
            self._recorders.setdefault(worker.group, {})[pid] = recorder

    def remove(self, pid: int) -> None:
        worker = self._workers.pop(pid, None)
        recorders = None if worker is None else self._recorders.get(worker.group)
        if recorders is not None:
            recorders.pop(pid, None)

    def take_expired_scope(self, pid: int) -> str | None:
        return self._expired_scopes.pop(pid, None)

    def is_supervised(self, pid: int) -> bool:
        return pid in self._workers

    def worker(self, pid: int) -> SupervisedWorker | None:
        return self._workers.get(pid)

    def timer_fired(self, pid: int, scope_id: str) -> None:
        if pid in self._workers:
            self._expired_scopes[pid] = scope_id

    def flight_recorders(self, pid: int) -> list[Recorder]:
        worker = self._workers.get(pid)
        recorders = {} if worker is None else self._recorders.get(worker.group, {})
        return sorted(recorders.values(), key=lambda r: r.rank)

    def __contains__(self, pid: object) -> bool:
        return pid in self._workers


def visible_gpus() -> list[str] | None:
    """The GPUs this process may use: ``CUDA_VISIBLE_DEVICES``, else the driver's list."""
    configured = os.environ.get("CUDA_VISIBLE_DEVICES")
    if configured is not None:
        return [d.strip() for d in configured.split(",") if d.strip()]
    driver = Path("/proc/driver/nvidia/gpus")
    if driver.is_dir():
        return [str(i) for i in range(len(list(driver.iterdir())))]
    return None


def read_error_file(path: str | None) -> str | None:
    """The message of a torch ``@record`` error file, if the worker wrote one."""
    if path is None:
        return None
    try:
        data = msgspec.json.decode(Path(path).read_bytes())
    except (OSError, msgspec.DecodeError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, dict):
        message = message.get("message")
    return str(message) if message is not None else None


def describe_exit(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exited with status {exitcode}"


class _Worker:
    def __init__(self, local_rank: int, rank: int, attempt: int, process: WorkerProcess):
        self.local_rank = local_rank
        self.rank = rank
        self.attempt = attempt
        self.process = process
        self.pid = process.pid
        self.pidfd = os.pidfd_open(process.pid)
        self.exitcode: int | None = None
        self.exited = anyio.Event()
        self.started = time.time()
        self.error_file: str | None = None


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
        starter: WorkerStarter | None = None,
        fault_injection: bool = False,
        stragglers: StragglerShare | None = None,
    ) -> None:
        """``fault_injection``: the daemon allows injected faults (the spec's, ``inject``)."""
        self.spec = spec
        self.events = events
        self.stragglers = stragglers
        self.endpoints = endpoints
        self.index = workers
        self.hardware = hardware
        self.rendezvous = open_rendezvous(spec, self._rdzv_event)
        self.machine = GroupMachine(
            spec.nproc, self.rendezvous.local_restarts, spec.shutdown_timeout
        )
        self.workers: dict[int, _Worker] = {}
        self.copiers: list[StreamCopier] = []
        self.last_failure: Failure | None = None
        self.attempt_failures: dict[int, Failure] = {}
        """The workers of the latest attempt that failed on their own, by local rank."""
        self.started_at = time.time()
        self.hostname = socket.gethostname()
        self.placement: Placement | None = None
        self.spares = self._spare_pool() if spec.prewarm and starter is None else None
        self.starter: WorkerStarter = starter or self.spares or CommandStarter(spec)
        self.logs_specs = (
            CustomLogsSpecs(spec, spec.logs_specs) if spec.logs_specs is not None else None
        )
        self.gpus = self._assign_gpus()
        # Every worker gets torch's error file, as under torchrun: beside its logs when
        # there are logs, else in a directory of the group's own, kept only if it failed.
        self.run_dir = (
            Path(spec.log_dir) / spec.name
            if spec.log_dir is not None
            else Path(tempfile.mkdtemp(prefix=f"watchdogd-{spec.name}-"))
        )
        self.faults = (
            FaultInjector(spec.name, events, self._running_rank) if fault_injection else None
        )
        if self.faults is not None:
            for fault in spec.faults:
                self.faults.schedule(fault)
        self.cpus: dict[int, frozenset[int]] | None = None
        """Each local rank's CPUs under ``numa_binding``, once decided."""
        self.finished = anyio.Event()
        self._reason = ""
        self._inbox_send, self._inbox = anyio.create_memory_object_stream[tuple[str, int, int]](
            math.inf
        )
        self._detector = (
            DStateDetector(spec.uninterruptible_state_timeout)
            if spec.uninterruptible_state_timeout
            else None
        )

    # -- setup -------------------------------------------------------------------

    def _spare_pool(self) -> SparePool:
        try:
            command = python_command(self.spec.entrypoint)
        except ValueError as e:
            raise GroupError(
                f"group {self.spec.name}: prewarm needs a Python entrypoint: {e}"
            ) from None
        return SparePool(
            self.spec.name,
            command,
            list(self.spec.prewarm),
            events=self.events,
            rank_env=self._spare_env,
            cwd=self.spec.cwd,
            cold=CommandStarter(self.spec),
        )

    def _spare_env(self, local_rank: int) -> dict[str, str]:
        """What a spare for ``local_rank`` starts with: all a worker gets but the attempt's."""
        unplaced = Placement(
            group_rank=0, group_world_size=1, master_addr="", master_port=0, run_id=""
        )
        env = worker_env(
            self.spec,
            unplaced,
            local_rank,
            0,
            base=dict(os.environ),
            cuda_visible=self.gpus[local_rank],
            socket_path=self.endpoints.socket_path,
            fifo_path=self.endpoints.fifo_path,
            error_path=Path(os.devnull),
        )
        return rank_stable_env(env)

    def _assign_gpus(self) -> dict[int, str | None]:
        try:
            return gpu_assignment(self.spec, visible_gpus())
        except ValueError as e:
            raise GroupError(f"group {self.spec.name}: {e}") from None

    async def _bind_numa(self) -> None:
        """Decide each rank's CPUs; GroupError naming the rank and why when that can't be done."""
        mode = self.spec.numa_binding
        if mode is None or self.cpus is not None:
            return
        environ = {**os.environ, **self.spec.env}
        visible = group_devices(self.spec, visible_gpus(), environ)

        def decide() -> dict[int, frozenset[int]]:
            try:
                gpus = self.hardware.gpus()
            except NumaError as e:
                ranks = "local rank 0" + (f"-{self.spec.nproc - 1}" if self.spec.nproc > 1 else "")
                raise NumaError(f"cannot find the GPUs of {ranks}: {e}") from None
            devices = cuda_devices(gpus, visible, environ.get("CUDA_DEVICE_ORDER"))
            topology = self.hardware.topology([gpu.bus_id for gpu in devices])
            return bind(mode, devices, self.spec.nproc, topology)

        what = f"group {self.spec.name}: numa binding {mode!r}"
        try:
            with anyio.fail_after(_HARDWARE_TIMEOUT):
                self.cpus = await anyio.to_thread.run_sync(decide, abandon_on_cancel=True)
        except NumaError as e:
            gpus = "every GPU" if visible is None else f"CUDA_VISIBLE_DEVICES={','.join(visible)}"
            raise GroupError(f"{what}: {e}; the group's GPUs: {gpus}") from None
        except TimeoutError:
            raise GroupError(
                f"{what}: NVML or sysfs did not answer within {_HARDWARE_TIMEOUT:.0f} s"
            ) from None
        self.events.emit(
            "numa_binding",
            group=self.spec.name,
            mode=mode,
            cpus=" ".join(f"{r}:{format_cpulist(c)}" for r, c in sorted(self.cpus.items())),
        )

    # -- control -----------------------------------------------------------------

    def stop(self) -> None:
        self._control("stop")

    def restart(self) -> None:
        self._control("restart")

    def signalled(self, signum: int) -> None:
        """The launcher received ``signum``: pass it to the workers and stop the group."""
        self._control("signal", signum)

    def inject(self, fault: Fault) -> None:
        """Inject ``fault`` ``fault.after`` seconds from now; GroupError if it cannot be."""
        if self.faults is None:
            raise GroupError(f"group {self.spec.name} started before fault injection was enabled")
        local = sorted(worker.rank for worker in self.workers.values())
        if fault.rank not in local:
            raise GroupError(
                f"group {self.spec.name}: rank {fault.rank} does not run on this node "
                f"(its ranks here: {', '.join(map(str, local)) or 'none yet'})"
            )
        self.faults.schedule(fault)

    def _running_rank(self, rank: int) -> RankProcess | None:
        """The injector's view of global rank ``rank``'s worker, while it runs."""
        for worker in self.workers.values():
            if worker.rank == rank and worker.exitcode is None:
                return RankProcess(worker.pid, worker.pidfd, worker.local_rank)
        return None

    def mark_unhealthy(self, reason: str) -> None:
        self._reason = reason
        self._control("unhealthy")

    def uses_gpu(self, index: int) -> bool:
        """Whether any worker may see GPU ``index`` (all of them, if unrestricted)."""
        return any(
            devices is None or str(index) in devices.split(",") for devices in self.gpus.values()
        )

    def _control(self, command: str, value: int = -1) -> None:
        if self.finished.is_set():
            raise GroupError(f"group {self.spec.name} is not running ({self.state.value})")
        self._inbox_send.send_nowait((command, -1, value))

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
                WorkerInfo(local_rank=w.local_rank, rank=w.rank, pid=w.pid, exitcode=w.exitcode)
                for w in self.workers.values()
            ],
            last_failure=self.last_failure,
            rendezvous=self.rendezvous.info(),
            spares=self.spares.infos() if self.spares is not None else [],
            started_at=self.started_at,
        )

    # -- the loop ----------------------------------------------------------------

    async def run(self) -> GroupState:
        """Run the group to a final state (or STOPPED); every worker is gone on return."""
        try:
            async with self.rendezvous, anyio.create_task_group() as tg:
                tg.start_soon(self.rendezvous.watch, self._membership_changed)
                if self.stragglers is not None:
                    tg.start_soon(self._share_stragglers, self.stragglers)
                if self.spares is not None:
                    tg.start_soon(self.spares.keep_ready)
                if self.faults is not None:
                    tg.start_soon(self.faults.run)
                # Caught here, inside the task group, or it would leave wrapped in a group.
                try:
                    final = await self._run_attempts()
                except RendezvousError as e:
                    final = await self._cannot_run(str(e), exitcode=1)
                except GroupError as e:  # an attempt that cannot start: no restart helps
                    self.events.emit("group_error", group=self.spec.name, reason=str(e))
                    final = await self._cannot_run(str(e), exitcode=127)
                await self.rendezvous.finish(final)
                tg.cancel_scope.cancel()
            return final
        finally:
            with anyio.CancelScope(shield=True):
                await self._kill_everything()
                if self.spares is not None:
                    await self.spares.aclose()
                if self.logs_specs is not None:
                    await self.logs_specs.aclose()
            self._drop_run_dir()
            if self.faults is not None:
                self.faults.close()
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
        self.last_failure = Failure(
            local_rank=-1, rank=-1, pid=0, exitcode=exitcode, reason=reason, timestamp=time.time()
        )
        await self._apply(self.machine.error(reason))
        return GroupState.FAILED

    async def _run_attempts(self) -> GroupState:
        final = await self._apply(self.machine.start())
        while final is None:
            final = await self._apply(await self._next_input())
        return final

    def _membership_changed(self, change: Change) -> None:
        if self.finished.is_set():
            return
        match change:
            case "waiting":
                self._control("restart")  # scale-up: a new round, not a failure
            case "lost":
                self._reason = "a node of the job was lost"
                self._control("fail")
            case "fenced":
                self._reason = "fenced: this node's lease on the rendezvous could not be renewed"
                self._control("fail")
            case "closed":
                self._control("stop")

    async def _share_stragglers(self, share: StragglerShare) -> None:
        """Each publish interval, while placed in a multi-node round: this node's straggler
        summary out through the rendezvous, the other nodes' in (none with ``static``)."""
        job = self.spec.name
        seq = 0
        try:
            while True:
                await anyio.sleep(share.publish_interval)
                placement = self.placement
                if placement is None or placement.group_world_size < 2:
                    share.received(job, {})  # no other node (any more) to tell or hear
                    continue
                seq += 1
                summary = share.summary(job, placement.group_rank, seq)
                found = await self.rendezvous.share(encode_summary(summary))
                if found is None:
                    return
                decoded = {key: decode_summary(value) for key, value in found.items()}
                share.received(job, {k: v for k, v in decoded.items() if v is not None})
        finally:
            share.received(job, {})

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
        wakes = [t for t in (self.machine.next_wake(),) if t is not None]
        if self._detector is not None:
            wakes.append(time.monotonic() + self._detector.sample_interval())
        delay = max(0.0, min(wakes) - time.monotonic()) if wakes else math.inf
        with anyio.move_on_after(delay):
            kind, local_rank, value = await self._inbox.receive()
            now = time.monotonic()
            match kind:
                case "exit":
                    return self._on_exit(local_rank, value, now)
                case "stop":
                    return self.machine.stop(now)
                case "signal":
                    return self.machine.signalled(value, now)
                case "restart":
                    return self.machine.restart(now)
                case "unhealthy":
                    return self.machine.unhealthy(self._reason, now)
                case "fail":
                    return self.machine.fail(self._reason, now)
        now = time.monotonic()
        return self.machine.tick(now) + self._sample_d_state(now)

    def _sample_d_state(self, now: float) -> list[Action]:
        if self._detector is None:
            return []
        states = {}
        for worker in self.workers.values():
            if worker.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    states[worker.local_rank] = read_stat(worker.pid).state
        actions: list[Action] = []
        for local_rank in self._detector.observe(states, now):
            worker = self.workers[local_rank]
            self._record_failure(worker, 0, "stuck in uninterruptible sleep (D state)")
            actions += self.machine.worker_stuck(local_rank, now)
        return actions

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
                        hostname=self.hostname,
                        agent_restarts=self.machine.restarts_used,
                    )
                case Spawn(attempt, restart_count):
                    await self._start_attempt(attempt, restart_count)
                case Signal(local_ranks, signum):
                    for local_rank in local_ranks:
                        self._signal(self.workers[local_rank], signum)
                case Finished(state):
                    final = state
        return final

    # -- processes ---------------------------------------------------------------

    async def _start_attempt(self, attempt: int, restart_count: int) -> None:
        await self._bind_numa()  # before rendezvous: a node that cannot start holds nobody up
        self.workers = {}  # the last attempt's are all gone: none is shown while nodes meet
        self.attempt_failures = {}
        if self.spares is not None:
            self.spares.fill(self.spec.nproc, self.cpus)  # warming while the nodes meet
        waiting_since = time.monotonic()
        placement, restart_count = await self.rendezvous.next_round(restart_count)
        self.placement = placement
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
            hostname=self.hostname,
        )
        base = dict(os.environ)
        recorder_dir = None
        if self.spec.flight_recorder:
            # The ranks' pipes live here: the daemon's uid only, so nobody else makes them dump.
            recorder_dir = self.run_dir / f"attempt_{attempt}" / "flight_recorder"
            mkdir = partial(recorder_dir.mkdir, mode=0o700, parents=True, exist_ok=True)
            await anyio.to_thread.run_sync(mkdir)
        envs = {
            local_rank: worker_env(
                self.spec,
                placement,
                local_rank,
                restart_count,
                base=base,
                cuda_visible=self.gpus[local_rank],
                socket_path=self.endpoints.socket_path,
                fifo_path=self.endpoints.fifo_path,
                error_path=self.run_dir / f"attempt_{attempt}" / str(local_rank) / "error.json",
                recorder_dir=recorder_dir,
            )
            for local_rank in range(self.spec.nproc)
        }
        if self.faults is not None:
            for local_rank, env in envs.items():
                env.update(self.faults.env(local_rank))
        routes = await self._log_routes(attempt, envs, base)
        # Off the loop: a log directory on NFS may take its time.
        targets = await anyio.to_thread.run_sync(self._open_logs, envs, routes)
        try:
            for local_rank, env in envs.items():
                rank = placement.rank(local_rank, self.spec.nproc)
                opened = targets.pop(local_rank)
                worker = await self._spawn(
                    local_rank, rank, attempt, env, routes[local_rank], opened
                )
                worker.error_file = env.get("TORCHELASTIC_ERROR_FILE") or None
                self.workers[local_rank] = worker
                spec = self.spec
                supervised = SupervisedWorker(
                    spec.name, rank, attempt, spec.idle_timeout, spec.job_key, spec.deadlines
                )
                self.index.add(worker.pid, supervised, self._recorder(env, worker))
                aio.watch_readable(worker.pidfd, partial(self._on_pidfd, worker))
                self.events.emit_at(logging.DEBUG, "worker_started", **self._about(worker))
            if self.faults is not None:
                self.faults.workers_started()
        finally:
            for pair in targets.values():  # ranks that never started
                for target in pair:
                    target.close()

    @staticmethod
    def _recorder(env: dict[str, str], worker: _Worker) -> Recorder | None:
        """The rank's NCCL flight recorder, if its environment turns one on."""
        paths = recorder_paths(env, worker.rank)
        if paths is None:
            return None
        # The worker runs as the daemon does: its pipe and trace are the daemon's uid's.
        return Recorder(worker.rank, worker.pid, *paths, uid=os.geteuid())

    async def _log_routes(
        self, attempt: int, envs: dict[int, dict[str, str]], base: dict[str, str]
    ) -> dict[int, tuple[StreamRoute, StreamRoute]]:
        """Each rank's streams this attempt; a ``LogsSpecs`` may set variables in ``envs``."""
        if self.logs_specs is None:
            return stream_routes(self.spec, attempt_dir(self.spec, attempt))
        # torch's agent hands reify its own variables, not the environment they inherit.
        own = {
            rank: {k: v for k, v in env.items() if base.get(k) != v} for rank, env in envs.items()
        }
        reified = await self.logs_specs.reify(own)
        for rank, env in envs.items():
            env.update(reified.envs.get(rank, {}))
        return routes_from_logs_dest(self.spec, reified.dest)

    def _open_logs(
        self, envs: dict[int, dict[str, str]], routes: dict[int, tuple[StreamRoute, StreamRoute]]
    ) -> dict[int, tuple[Target, Target]]:
        """Every rank's open streams, or GroupError naming the one that cannot be opened."""
        opened: dict[int, tuple[Target, Target]] = {}
        try:
            for local_rank, (out_route, err_route) in routes.items():
                if self.logs_specs is None:  # watchdogd's layout: the error file is ours
                    error_path = Path(envs[local_rank]["TORCHELASTIC_ERROR_FILE"])
                    error_path.parent.mkdir(parents=True, exist_ok=True)  # the rank's log dir too
                    error_path.unlink(missing_ok=True)  # an earlier run's, in a log dir used again
                stdout = open_target(out_route)
                try:
                    opened[local_rank] = (stdout, open_target(err_route))
                except OSError:
                    stdout.close()
                    raise
        except OSError as e:
            for pair in opened.values():
                for target in pair:
                    target.close()
            raise GroupError(
                f"group {self.spec.name}: cannot open {e.filename}: {e.strerror}"
            ) from None
        return opened

    async def _spawn(
        self,
        local_rank: int,
        rank: int,
        attempt: int,
        env: dict[str, str],
        routes: tuple[StreamRoute, StreamRoute],
        targets: tuple[Target, Target],
    ) -> _Worker:
        """Start one worker on its opened streams, which are closed or handed on either way."""
        cpus = self.cpus.get(local_rank) if self.cpus is not None else None
        start = partial(self.starter.start, local_rank, attempt, env, targets, cpus)
        try:
            started = await anyio.to_thread.run_sync(start) if self.starter.off_loop else start()
        except BaseException as e:
            for target in targets:
                target.close()
            if not isinstance(e, OSError | GroupError):
                raise
            why = e.strerror if isinstance(e, OSError) else e
            raise GroupError(
                f"group {self.spec.name}: cannot start {self.spec.entrypoint[0]!r}: {why}"
            ) from None
        prefix = log_prefix(self.spec, local_rank, rank, self.hostname).encode()
        for route, target, fd in zip(routes, targets, started[1:], strict=True):
            if fd is not None:
                self.copiers.append(start_copier(fd, target, route, prefix))
            else:
                target.close()  # the worker holds its own descriptor
        return _Worker(local_rank, rank, attempt, started.process)

    def _signal(self, worker: _Worker, signum: int) -> None:
        if worker.exitcode is not None or pidfd_exited(worker.pidfd):
            return  # gone (its pidfd says so first): its exit is being handled
        # Alive, so its pid names its process group once it leads one; a callable's
        # worker makes its own as it starts: before that, only the pidfd reaches it.
        try:
            os.killpg(worker.pid, signum)
        except ProcessLookupError:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(worker.pidfd, signum)

    def _on_pidfd(self, worker: _Worker) -> None:
        # Still a zombie: its process group id cannot be reused yet.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(worker.pid, signal.SIGKILL)
        self._reap(worker, exited=True)
        worker.exited.set()
        self._inbox_send.send_nowait(("exit", worker.local_rank, worker.attempt))

    def _reap(self, worker: _Worker, *, exited: bool) -> None:
        """Stop watching ``worker`` and collect its exit status.

        Only a worker its pidfd says ``exited`` is waited for; one that
        SIGKILL could not end (stuck in uninterruptible sleep) is left to the
        kernel rather than hang the event loop.
        """
        with contextlib.suppress(ValueError, OSError):
            aio.unwatch(worker.pidfd)
            os.close(worker.pidfd)
        worker.exitcode = worker.process.wait() if exited else worker.process.poll()
        if worker.exitcode is None:
            log.warning("worker pid %d did not exit after SIGKILL; left behind", worker.pid)
        self.index.remove(worker.pid)

    def _on_exit(self, local_rank: int, attempt: int, now: float) -> list[Action]:
        worker = self.workers.get(local_rank)
        if worker is None or worker.attempt != attempt or worker.exitcode is None:
            return []
        exitcode = worker.exitcode
        expired_scope = self.index.take_expired_scope(worker.pid)
        injected = self.faults.injected.pop(worker.pid, None) if self.faults else None
        failed = exitcode != 0 and self.machine.state is GroupState.HEALTHY
        if failed:
            reason = describe_exit(exitcode)
            if expired_scope is not None:
                reason += f" (watchdogd: timer {expired_scope!r} expired)"
            if injected is not None:
                reason += f" (injected fault: {injected})"
            self._record_failure(worker, exitcode, reason)
        self.events.emit_at(
            logging.WARNING if failed else logging.DEBUG,
            "worker_failed" if failed else "worker_exited",
            **self._about(worker),
            exitcode=exitcode,
            reason=self.last_failure.reason if failed and self.last_failure else None,
            total_run_time=round(time.time() - worker.started, 3),
            raw_error=self.last_failure.error_message if failed and self.last_failure else None,
        )
        return self.machine.worker_exited(local_rank, exitcode, now)

    def _about(self, worker: _Worker) -> dict[str, str | int | float | bool | None]:
        """torch's worker event metadata."""
        return {
            "group": self.spec.name,
            "run_id": self.spec.rendezvous.run_id,
            "global_rank": worker.rank,
            "group_rank": self.placement.group_rank if self.placement else -1,
            "local_rank": worker.local_rank,
            "worker_id": worker.pid,
            "role": self.spec.role,
            "hostname": self.hostname,
            "attempt": worker.attempt,
        }

    def _record_failure(self, worker: _Worker, exitcode: int, reason: str) -> None:
        self.last_failure = self.attempt_failures[worker.local_rank] = Failure(
            local_rank=worker.local_rank,
            rank=worker.rank,
            pid=worker.pid,
            exitcode=exitcode,
            reason=reason,
            error_file=worker.error_file,
            error_message=read_error_file(worker.error_file),
            timestamp=time.time(),
        )

    async def _kill_everything(self) -> None:
        """On the way out: no worker survives, no output is lost."""
        for worker in self.workers.values():
            self._signal(worker, signal.SIGKILL)
        with anyio.move_on_after(_DRAIN_TIMEOUT) as drain:
            for worker in self.workers.values():
                await worker.exited.wait()
            for copier in self.copiers:
                await copier.done.wait()
            # The consoles' threads may still be writing what the copiers handed them.
            for console in {c.console for c in self.copiers if c.console is not None}:
                left = drain.deadline - anyio.current_time()
                await anyio.to_thread.run_sync(console.flush, left)
        for copier in self.copiers:
            copier.close()
        for worker in self.workers.values():
            if not worker.exited.is_set():
                self._reap(worker, exited=False)
