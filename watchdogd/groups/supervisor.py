"""The daemon's worker groups, by name: submitted, controlled, stopped together.

:class:`Supervisor` is what the rest of the daemon sees of the groups: the
socket's ``GroupControl`` port, the timer service's ``Supervision`` (its
:class:`~watchdogd.groups.workers.WorkerIndex`), GPU faults, and the states
metrics read; it hands each group the ``StragglerShare`` port. Each group runs as a task of its own
(:class:`~watchdogd.groups.runner.GroupRunner`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable

import anyio
import anyio.abc

from watchdogd.core.config import SupervisorSettings
from watchdogd.core.ports import EventSink, GroupError, GroupRuns, Hardware, StragglerShare
from watchdogd.core.workerenv import apply_env_knobs
from watchdogd.groups.containment import Containment
from watchdogd.groups.runner import GroupRunner
from watchdogd.groups.starters import WorkerStarter
from watchdogd.groups.workers import Endpoints, WorkerIndex
from watchdogd.linux.numa import NodeHardware
from watchdogd_client.groups import Fault, GroupInfo, GroupSpec, GroupState

__all__ = ["CONFIG_CONSENT", "Supervisor"]

CONFIG_CONSENT = "set fault_injection = true in the daemon's config"
"""How a served daemon's operator allows injected faults (``watchdogd run`` has a flag)."""


class Supervisor:
    """The daemon's worker groups, by name: the socket's ``GroupControl`` port."""

    def __init__(
        self,
        events: EventSink,
        endpoints: Endpoints,
        hardware: Hardware | None = None,
        *,
        settings: SupervisorSettings,
        workers: WorkerIndex | None = None,
        stragglers: StragglerShare | None = None,
        runs: GroupRuns | None = None,
        fault_consent: str = CONFIG_CONSENT,
    ) -> None:
        """``fault_consent``: how this daemon's operator allows injected faults, which
        a refusal names (the config's key, or the flag of the command that runs it)."""
        self.events = events
        self.endpoints = endpoints
        self.hardware: Hardware = hardware if hardware is not None else NodeHardware()
        self.workers = workers if workers is not None else WorkerIndex()
        self.stragglers = stragglers
        """Where multi-node groups' straggler summaries come from and go (None: nowhere)."""
        self.runs = runs
        """Told when each group's run starts and ends (the timer service's learned state)."""
        self.groups: dict[str, GroupRunner] = {}
        """In start order."""
        self.containment: Containment | None = None
        self._task_group: anyio.abc.TaskGroup | None = None
        self.settings = settings
        self.fault_consent = fault_consent
        self.on_finished: Callable[[GroupRunner, GroupState], None] | None = None

    def attach(self, task_group: anyio.abc.TaskGroup) -> None:
        self._task_group = task_group

    async def open_containment(self, cgroups: bool) -> None:
        """Before any group: end what a dead daemon left, and take this one's cgroup
        (``cgroups``: where it may be written; else the weaker mode)."""
        self.containment = await Containment.open(self.events, cgroups_allowed=cgroups)

    def close_containment(self) -> None:
        """After every group: this daemon's cgroup goes, its keeper stands down."""
        if self.containment is not None:
            self.containment.close()

    def containment_info(self) -> str:
        return "" if self.containment is None else self.containment.describe()

    def reconfigure(self, settings: SupervisorSettings) -> None:
        """Reloaded settings, for the groups submitted from now on and for ``inject``."""
        self.settings = settings

    def submit(self, spec: GroupSpec, starter: WorkerStarter | None = None) -> GroupRunner:
        """Start a group; GroupError if its name is running already or the spec cannot run.

        ``starter`` starts its workers (None: each is the spec's command).
        """
        existing = self.groups.get(spec.name)
        if existing is not None and not existing.finished.is_set():
            raise GroupError(f"group {spec.name!r} is already running ({existing.state.value})")
        if self._task_group is None or self.containment is None:
            raise GroupError("the supervisor is not running")
        if spec.faults and not self.settings.fault_injection:
            raise GroupError(
                f"group {spec.name}: fault injection is disabled: {self.fault_consent}"
            )
        try:
            spec = apply_env_knobs(spec, os.environ)
        except ValueError as e:
            raise GroupError(f"group {spec.name}: {e}") from None
        runner = GroupRunner(
            spec,
            events=self.events,
            endpoints=self.endpoints,
            workers=self.workers,
            hardware=self.hardware,
            containment=self.containment,
            starter=starter,
            fault_injection=self.settings.fault_injection,
            stragglers=self.stragglers,
        )
        self.groups.pop(spec.name, None)  # a name submitted again starts last
        self.groups[spec.name] = runner
        if self.runs is not None:
            self.runs.run_started(spec.name)
        self._task_group.start_soon(self._run, runner, name=f"group {spec.name}")
        return runner

    async def _run(self, runner: GroupRunner) -> None:
        state = await runner.run()
        if self.runs is not None:
            self.runs.run_ended(runner.spec.name)
        if self.on_finished is not None:
            self.on_finished(runner, state)

    def get(self, name: str) -> GroupRunner:
        runner = self.groups.get(name)
        if runner is None:
            raise GroupError(f"no group named {name!r}")
        return runner

    def stop(self, name: str) -> None:
        self.get(name).stop()

    def restart(self, name: str) -> None:
        self.get(name).restart()

    def inject(self, name: str, fault: Fault) -> None:
        if not self.settings.fault_injection:
            raise GroupError(f"fault injection is disabled: {self.fault_consent}")
        self.get(name).inject(fault)

    def clear_quarantine(self, node: str) -> str:
        """Bring ``node`` back into the etcd job of the first running group that keeps
        a quarantine (one job per daemon, in practice)."""
        for runner in self.groups.values():
            if runner.quarantine is not None and not runner.finished.is_set():
                return runner.quarantine.clear(node)
        raise GroupError("no running group keeps a quarantine (an etcd job with one)")

    def infos(self) -> list[GroupInfo]:
        return [runner.info() for runner in self.groups.values()]

    def states(self) -> list[tuple[GroupState, int]]:
        """Each group's state and the restarts it used (for metrics)."""
        return [(r.state, r.machine.restarts_used) for r in self.groups.values()]

    def worker_ranks(self) -> dict[int, tuple[str, int]]:
        """Each running worker's pid, with its group and rank."""
        return {
            worker.pid: (runner.spec.name, worker.rank)
            for runner in self.groups.values()
            for worker in runner.workers.values()
        }

    def running(self) -> int:
        return sum(1 for r in self.groups.values() if not r.finished.is_set())

    def gpu_fault(self, index: int, description: str) -> None:
        """A GPU reported a fatal error: the groups that may use it are UNHEALTHY."""
        self.events.emit("gpu_fault", gpu=index, fault=description)
        if index < 0:
            return
        for runner in self.groups.values():
            if not runner.finished.is_set() and runner.uses_gpu(index):
                with contextlib.suppress(GroupError):
                    runner.mark_unhealthy(f"GPU {index}: {description}")

    async def stop_all(self) -> None:
        """Stop every group gracefully (SIGTERM, then SIGKILL after its timeout), in the
        reverse of their start order: each is gone before the one started before it is
        told, as supervisord stops its groups (a later group may depend on an earlier)."""
        for runner in reversed(self.groups.values()):
            if not runner.finished.is_set():
                runner.stop()
                await runner.finished.wait()
