"""What only some groups have, as parts the runner iterates instead of asking whether each is on.

A :class:`Feature` hooks into a group's life; every hook does nothing
unless the feature overrides it:

- :meth:`~Feature.prepare`: before each attempt meets its nodes (a NUMA
  binding is decided, spares warm up meanwhile);
- :meth:`~Feature.environment`: what each worker of a local rank gets;
- :meth:`~Feature.workers_started`: an attempt's workers run;
- :meth:`~Feature.failure_note`: what a worker's failure report adds;
- :meth:`~Feature.start`: its tasks, for the group's life;
- :meth:`~Feature.aclose`: on the way out (shielded), after every worker is gone.

The runner builds the list from the spec (:func:`group_features`) and
holds two of them by role as well: the CPU binding (a worker's CPUs) and
fault injection (``watchdogctl inject``), each with a stand-in when off.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import anyio
import anyio.abc

from watchdogd.core.dstate import DStateDetector
from watchdogd.core.group_machine import Input, WorkerStuck
from watchdogd.core.job_stragglers import decode_summary, encode_summary
from watchdogd.core.numa import AffinityMode, NumaError, bind, cuda_devices, format_cpulist
from watchdogd.core.ports import EventSink, GroupError, Hardware, StragglerShare
from watchdogd.core.workerenv import (
    Placement,
    group_devices,
    python_command,
    rank_stable_env,
    worker_env,
)
from watchdogd.groups.child import Cell
from watchdogd.groups.faults import FaultInjector
from watchdogd.groups.rendezvous import Rendezvous
from watchdogd.groups.spares import SparePool
from watchdogd.groups.starters import CommandStarter
from watchdogd.groups.workers import Endpoints, Worker, visible_gpus
from watchdogd.linux.procs import read_stat
from watchdogd_client.groups import Fault, GroupSpec, SpareInfo

__all__ = [
    "CpuBinding",
    "DStateWatch",
    "FaultInjection",
    "Feature",
    "NoFaultInjection",
    "NumaBinding",
    "StragglerSharing",
    "WarmSpares",
]

# NVML's init can take a second or more on GPUs without persistence mode.
_HARDWARE_TIMEOUT = 30.0


class Feature:
    """A part of some groups; each hook defaults to nothing."""

    async def prepare(self) -> None:
        """Before each attempt's rendezvous; GroupError when the attempt cannot start."""

    def environment(self, local_rank: int) -> dict[str, str]:
        return {}

    def workers_started(self) -> None:
        pass

    def failure_note(self, pid: int) -> str | None:
        return None

    def start(self, tg: anyio.abc.TaskGroup) -> None:
        pass

    def spare_infos(self) -> list[SpareInfo]:
        return []

    async def aclose(self) -> None:
        pass


# -- CPUs ------------------------------------------------------------------------


class CpuBinding(Feature):
    """No binding: every worker may run on any CPU."""

    def cpus(self, local_rank: int) -> frozenset[int] | None:
        return None

    def decided(self) -> dict[int, frozenset[int]] | None:
        return None


class NumaBinding(CpuBinding):
    """``numa_binding``: each worker starts bound to the CPUs near its GPU.

    :mod:`watchdogd.core.numa` decides, from the ``Hardware`` port, once per
    group, in a thread since NVML and sysfs block.
    """

    def __init__(
        self, spec: GroupSpec, mode: AffinityMode, hardware: Hardware, events: EventSink
    ) -> None:
        self.spec = spec
        self.mode = mode
        self.hardware = hardware
        self.events = events
        self._cpus: dict[int, frozenset[int]] | None = None

    def cpus(self, local_rank: int) -> frozenset[int] | None:
        return None if self._cpus is None else self._cpus.get(local_rank)

    def decided(self) -> dict[int, frozenset[int]] | None:
        return self._cpus

    async def prepare(self) -> None:
        """Decide each rank's CPUs; GroupError naming the rank and why when that can't be done."""
        if self._cpus is not None:
            return
        spec, mode = self.spec, self.mode
        environ = {**os.environ, **spec.env}
        visible = group_devices(spec, visible_gpus(), environ)

        def decide() -> dict[int, frozenset[int]]:
            try:
                gpus = self.hardware.gpus()
            except NumaError as e:
                ranks = "local rank 0" + (f"-{spec.nproc - 1}" if spec.nproc > 1 else "")
                raise NumaError(f"cannot find the GPUs of {ranks}: {e}") from None
            devices = cuda_devices(gpus, visible, environ.get("CUDA_DEVICE_ORDER"))
            topology = self.hardware.topology([gpu.bus_id for gpu in devices])
            return bind(mode, devices, spec.nproc, topology)

        what = f"group {spec.name}: numa binding {mode!r}"
        try:
            with anyio.fail_after(_HARDWARE_TIMEOUT):
                cpus = await anyio.to_thread.run_sync(decide, abandon_on_cancel=True)
        except NumaError as e:
            gpus = "every GPU" if visible is None else f"CUDA_VISIBLE_DEVICES={','.join(visible)}"
            raise GroupError(f"{what}: {e}; the group's GPUs: {gpus}") from None
        except TimeoutError:
            raise GroupError(
                f"{what}: NVML or sysfs did not answer within {_HARDWARE_TIMEOUT:.0f} s"
            ) from None
        self._cpus = cpus
        self.events.emit(
            "numa_binding",
            group=spec.name,
            mode=mode,
            cpus=" ".join(f"{r}:{format_cpulist(c)}" for r, c in sorted(cpus.items())),
        )


# -- spares, faults, stragglers, D state ---------------------------------------------


class WarmSpares(Feature):
    """``prewarm``: the pool warms a spare per rank while the nodes meet (after the binding,
    whose CPUs the spares start on). Its pool is the group's :class:`WorkerStarter`; it
    replaces the spares an attempt took once every worker of it is at work (:meth:`at_work`,
    which the group's ``WorkerIndex`` calls)."""

    @classmethod
    def for_group(
        cls,
        spec: GroupSpec,
        events: EventSink,
        endpoints: Endpoints,
        gpus: dict[int, str | None],
        binding: CpuBinding,
        cells: Callable[[str], Cell],
    ) -> WarmSpares:
        try:
            command = python_command(spec.entrypoint)
        except ValueError as e:
            raise GroupError(f"group {spec.name}: prewarm needs a Python entrypoint: {e}") from None

        def spare_env(local_rank: int) -> dict[str, str]:
            """What a spare for ``local_rank`` starts with: all a worker gets but the attempt's."""
            unplaced = Placement(
                group_rank=0, group_world_size=1, master_addr="", master_port=0, run_id=""
            )
            env = worker_env(
                spec,
                unplaced,
                local_rank,
                0,
                base=dict(os.environ),
                cuda_visible=gpus[local_rank],
                socket_path=endpoints.socket_path,
                fifo_path=endpoints.fifo_path,
                error_path=Path(os.devnull),
            )
            return rank_stable_env(env)

        pool = SparePool(
            spec.name,
            command,
            list(spec.prewarm),
            events=events,
            rank_env=spare_env,
            cwd=spec.cwd,
            cold=CommandStarter(spec),
            cells=cells,
        )
        return cls(pool, spec.nproc, binding)

    def __init__(self, pool: SparePool, nproc: int, binding: CpuBinding) -> None:
        self.pool = pool
        self.nproc = nproc
        self.binding = binding
        self._at_work: set[int] | None = None
        """The workers of the latest attempt seen at work, by pid, until all are."""

    def workers_started(self) -> None:
        self._at_work = set()  # the last attempt's are gone from the index: these are new

    def at_work(self, pid: int) -> None:
        """Worker ``pid`` of the group released a timer or reported a step."""
        if self._at_work is None:
            return
        self._at_work.add(pid)
        if len(self._at_work) >= self.nproc:
            self._at_work = None
            self.pool.at_work()

    async def prepare(self) -> None:
        self._at_work = None  # nobody of the next attempt yet
        self.pool.fill(self.nproc, self.binding.decided())

    def start(self, tg: anyio.abc.TaskGroup) -> None:
        tg.start_soon(self.pool.keep_ready)

    def spare_infos(self) -> list[SpareInfo]:
        return self.pool.infos()

    async def aclose(self) -> None:
        await self.pool.aclose()


class NoFaultInjection:
    """The daemon allows no injected faults."""

    def __init__(self, group: str) -> None:
        self.group = group

    def inject(self, fault: Fault, ranks: list[int]) -> None:
        raise GroupError(f"group {self.group} started before fault injection was enabled")


class FaultInjection(Feature):
    """The spec's faults, and ``watchdogctl inject``'s, delivered by a :class:`FaultInjector`."""

    def __init__(self, injector: FaultInjector, faults: list[Fault]) -> None:
        self.injector = injector
        for fault in faults:
            injector.schedule(fault)

    def inject(self, fault: Fault, ranks: list[int]) -> None:
        """Inject ``fault`` ``fault.after`` seconds from now, if its rank is one of ``ranks``."""
        if fault.rank not in ranks:
            raise GroupError(
                f"group {self.injector.group}: rank {fault.rank} does not run on this node "
                f"(its ranks here: {', '.join(map(str, ranks)) or 'none yet'})"
            )
        self.injector.schedule(fault)

    def environment(self, local_rank: int) -> dict[str, str]:
        return self.injector.env(local_rank)

    def workers_started(self) -> None:
        self.injector.workers_started()

    def failure_note(self, pid: int) -> str | None:
        injected = self.injector.injected.pop(pid, None)
        return None if injected is None else f"injected fault: {injected}"

    def start(self, tg: anyio.abc.TaskGroup) -> None:
        tg.start_soon(self.injector.run)

    async def aclose(self) -> None:
        self.injector.close()


class StragglerSharing(Feature):
    """Each publish interval, while placed in a multi-node round: this node's straggler
    summary out through the rendezvous, the other nodes' in (none with ``static``)."""

    def __init__(
        self,
        share: StragglerShare,
        job: str,
        rendezvous: Rendezvous,
        placement: Callable[[], Placement | None],
    ) -> None:
        self.share = share
        self.job = job
        self.rendezvous = rendezvous
        self.placement = placement

    def start(self, tg: anyio.abc.TaskGroup) -> None:
        tg.start_soon(self._run)

    async def _run(self) -> None:
        share, job = self.share, self.job
        seq = 0
        try:
            while True:
                await anyio.sleep(share.publish_interval)
                placement = self.placement()
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


class DStateWatch(Feature):
    """``uninterruptible_state_timeout``: the running workers' states, sampled; one stuck
    in D state past the timeout is a :class:`WorkerStuck` input to the group."""

    def __init__(
        self,
        timeout: float,
        workers: Callable[[], Mapping[int, Worker]],
        post: Callable[[Input], None],
    ) -> None:
        self.detector = DStateDetector(timeout)
        self.workers = workers
        self.post = post

    def start(self, tg: anyio.abc.TaskGroup) -> None:
        tg.start_soon(self._run)

    async def _run(self) -> None:
        while True:
            await anyio.sleep(self.detector.sample_interval())
            states = {}
            for worker in self.workers().values():
                if worker.exitcode is None:
                    with contextlib.suppress(ProcessLookupError):
                        states[worker.local_rank] = read_stat(worker.pid).state
            for local_rank in self.detector.observe(states, anyio.current_time()):
                self.post(WorkerStuck(local_rank))
