"""The narrow interfaces the daemon's parts are handed, instead of the daemon.

Pure typing: each part names what it needs from another as a
``typing.Protocol`` here, and ``daemon.py`` (the composition root) passes the
object that has it. The timer service (``service/``) and the worker groups
(``groups/``) are siblings that never import each other; they meet only
through these ports.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

from watchdogd.core.flight_recorder import Recorder
from watchdogd.core.job_stragglers import NodeSummary
from watchdogd.core.numa import Gpu, Topology
from watchdogd_client.groups import DeadlineRule, Fault, GroupInfo, GroupSpec

__all__ = [
    "EventSink",
    "GpuHolder",
    "GroupControl",
    "GroupError",
    "GroupRuns",
    "Hardware",
    "Metadata",
    "StepReports",
    "StragglerShare",
    "SupervisedWorker",
    "Supervision",
]

Metadata = str | int | float | bool | None


class GroupError(Exception):
    """A group cannot be started, found or controlled as asked (the message says why)."""


class EventSink(Protocol):
    """Where a part records what happened (the event ring, the logs, torch's handlers)."""

    def emit(self, name: str, /, **metadata: Metadata) -> None: ...

    def emit_at(self, level: int, name: str, /, **metadata: Metadata) -> None: ...


class SupervisedWorker(NamedTuple):
    """A worker the daemon launched, as the timer service needs to know it."""

    group: str
    rank: int
    """Its global rank."""
    attempt: int
    idle_timeout: float | None
    """How long it may hold no timer, after its first (None: for ever)."""
    job_key: str | None
    deadlines: Sequence[DeadlineRule]
    """The group's rules for learned deadlines."""


class Supervision(Protocol):
    """What the timer service asks of whoever launches workers."""

    def is_supervised(self, pid: int) -> bool:
        """Whether ``pid`` is a worker the daemon launched (FIFO requests may target it)."""
        ...

    def worker(self, pid: int) -> SupervisedWorker | None:
        """Worker ``pid``; None for a process the daemon did not launch."""
        ...

    def timer_fired(self, pid: int, scope_id: str) -> None:
        """The timer ``scope_id`` signalled ``pid``: the group's failure report names it."""
        ...

    def injected(self, pid: int) -> bool:
        """Whether a drill's fault was injected into worker ``pid``: what it causes (an
        expiry, a straggler flag) is marked as the drill's, so alerts can tell it."""
        ...

    def flight_recorders(self, pid: int) -> list[Recorder]:
        """The NCCL flight recorders of every rank of ``pid``'s group on this node.

        Empty unless ``pid`` is a worker whose group's environment turns them on:
        a hang in a collective is the whole group's, so every rank is asked.
        """
        ...


class StepReports(Protocol):
    """Where a worker's reported steps (``wd.progress``) reach its group."""

    def step_reported(self, pid: int, step: int) -> None:
        """``pid`` completed step ``step``; ignored unless ``pid`` is a worker."""
        ...


class StragglerShare(Protocol):
    """What a multi-node group's rendezvous carries between nodes of its straggler scores."""

    publish_interval: float
    """Seconds between publications (``straggler_publish_interval``)."""

    def summary(self, job: str, node_rank: int, seq: int) -> NodeSummary:
        """This node's ranks of ``job``, to publish as node ``node_rank``'s ``seq``-th."""
        ...

    def received(self, job: str, summaries: Mapping[str, NodeSummary]) -> None:
        """The other nodes' summaries of ``job``, by store key, as the store holds them now
        (empty: the group is over here)."""
        ...

    def fresh_peers(self, job: str) -> list[NodeSummary]:
        """The other nodes' summaries of ``job`` that are not stale, as last received."""
        ...

    def stepped_aside(self, job: str, node: str, reason: str) -> None:
        """This node left ``job`` for its straggler (``replace_stragglers_after``): the
        event and the count."""
        ...


class GroupRuns(Protocol):
    """What the timer service keeps per run of a group, told when one starts and ends."""

    def run_started(self, group: str) -> None:
        """A new run of ``group``: what an earlier run of that name learned goes."""
        ...

    def run_ended(self, group: str) -> None:
        """``group``'s run is over: its learned deadlines are saved and stop counting."""
        ...


class GroupControl(Protocol):
    """What operators may do to worker groups over the socket; GroupError when refused."""

    def submit(self, spec: GroupSpec) -> object: ...

    def stop(self, name: str) -> None: ...

    def restart(self, name: str) -> None: ...

    def inject(self, name: str, fault: Fault) -> None: ...

    def clear_quarantine(self, node: str) -> str: ...

    def infos(self) -> list[GroupInfo]: ...


class GpuHolder(NamedTuple):
    """A process that holds memory on a GPU, as NVML lists it."""

    gpu: int
    """NVML's index of the GPU."""
    pid: int
    used_mib: int | None
    """None where NVML cannot say (no permission, MIG)."""


class Hardware(Protocol):
    """What the runner reads of the node (NUMA binding, GPU memory before a restart);
    every call may block (NVML, sysfs)."""

    def gpus(self) -> list[Gpu]:
        """Every GPU with its PCI bus id, in NVML's order; NumaError when that is unknown."""
        ...

    def topology(self, bus_ids: Sequence[str]) -> Topology:
        """The NUMA nodes, their CPUs, and the nodes of these GPUs."""
        ...

    def gpu_holders(self) -> tuple[list[GpuHolder], str | None]:
        """Every process holding memory on any GPU (NVML's per-process lists); or, with an
        empty list, why that cannot be known (no NVML, no driver, no GPU)."""
        ...
