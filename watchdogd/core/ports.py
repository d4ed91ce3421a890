"""The narrow interfaces the daemon's parts are handed, instead of the daemon.

Pure typing: each part names what it needs from another as a
``typing.Protocol`` here, and ``daemon.py`` (the composition root) passes the
object that has it. The timer service (``service/``) and the worker groups
(``groups/``) are siblings that never import each other; they meet only
through these ports.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from watchdogd.core.flight_recorder import Recorder
from watchdogd.core.numa import Gpu, Topology
from watchdogd_client.groups import GroupInfo, GroupSpec

__all__ = ["EventSink", "GroupControl", "GroupError", "Hardware", "Metadata", "Supervision"]

Metadata = str | int | float | bool | None


class GroupError(Exception):
    """A group cannot be started, found or controlled as asked (the message says why)."""


class EventSink(Protocol):
    """Where a part records what happened (the event ring, the logs, torch's handlers)."""

    def emit(self, name: str, /, **metadata: Metadata) -> None: ...

    def emit_at(self, level: int, name: str, /, **metadata: Metadata) -> None: ...


class Supervision(Protocol):
    """What the timer service asks of whoever launches workers."""

    def is_supervised(self, pid: int) -> bool:
        """Whether ``pid`` is a worker the daemon launched (FIFO requests may target it)."""
        ...

    def rank_of(self, pid: int) -> tuple[str, int] | None:
        """``(group, global rank)`` of a worker the daemon launched; None for any other."""
        ...

    def idle_timeout(self, pid: int) -> float | None:
        """How long worker ``pid`` may hold no timer, after its first (None: for ever)."""
        ...

    def timer_fired(self, pid: int, scope_id: str) -> None:
        """The timer ``scope_id`` signalled ``pid``: the group's failure report names it."""
        ...

    def flight_recorders(self, pid: int) -> list[Recorder]:
        """The NCCL flight recorders of every rank of ``pid``'s group on this node.

        Empty unless ``pid`` is a worker whose group's environment turns them on:
        a hang in a collective is the whole group's, so every rank is asked.
        """
        ...


class GroupControl(Protocol):
    """What operators may do to worker groups over the socket; GroupError when refused."""

    def submit(self, spec: GroupSpec) -> object: ...

    def stop(self, name: str) -> None: ...

    def restart(self, name: str) -> None: ...

    def infos(self) -> list[GroupInfo]: ...


class Hardware(Protocol):
    """What NUMA binding reads of the node; both calls may block (NVML, sysfs)."""

    def gpus(self) -> list[Gpu]:
        """Every GPU with its PCI bus id, in NVML's order; NumaError when that is unknown."""
        ...

    def topology(self, bus_ids: Sequence[str]) -> Topology:
        """The NUMA nodes, their CPUs, and the nodes of these GPUs."""
        ...
