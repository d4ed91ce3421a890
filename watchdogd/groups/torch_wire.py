"""What the daemon and its torch helper say to each other. Pure: messages only.

The helper (:mod:`watchdogd.groups.torch_helper`) runs torch's own code in a
process of its own; the daemon (:mod:`watchdogd.groups.helper_process`)
speaks to it over the helper's stdin (requests) and stdout (replies), in
frames (``watchdogd_client.framing``) of msgpack-encoded tagged Structs.

The helper speaks first, unasked: :class:`Ready`. After that each request
gets exactly one reply, in order: the one its docstring names, or
:class:`Failed`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from watchdogd.core.workerenv import LogsDest

__all__ = [
    "MAX_FRAME",
    "Done",
    "Failed",
    "Finish",
    "HostStore",
    "Hosting",
    "LoadLogsSpecs",
    "NextRound",
    "Open",
    "Opened",
    "Poll",
    "Polled",
    "Ready",
    "Reified",
    "Reify",
    "Reply",
    "Request",
    "Round",
    "Share",
    "Shared",
]

MAX_FRAME = 1 << 24  # a Reify of thousands of ranks' variables fits


# -- requests ------------------------------------------------------------------


class HostStore(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Serve the job's store (a ``TCPStore``) on ``fd``, a socket the daemon bound to
    ``port`` and handed over, or (``fd`` None) on a port of the helper's own (a store
    already served is dropped: the new one is empty); replies :class:`Hosting`, with
    the port, once it serves."""

    fd: int | None = None
    port: int = 0


class Open(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Create torch's c10d rendezvous handler and agent, as torchrun would for these
    flags (connecting to, or hosting, the rendezvous store); replies :class:`Opened`."""

    endpoint: str
    run_id: str
    min_nodes: int
    max_nodes: int
    local_addr: str | None
    conf: dict[str, str]
    """``--rdzv-conf`` as torch parses it: strings."""
    role: str
    nproc: int
    max_restarts: int
    monitor_interval: float
    entrypoint: str
    exit_barrier_timeout: float


class NextRound(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """The agent's rendezvous: the next round, then ranks; replies :class:`Round`."""

    restart_count: int


class Poll(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """What the agent checks while its workers run; replies :class:`Polled`."""


class Finish(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """The group is done: wait at the exit barrier if it succeeded, then shut the
    rendezvous down (closing it), as torch's agent ends; replies :class:`Done`."""

    barrier: bool


class LoadLogsSpecs(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Load the ``torchrun.logs_specs`` entry point ``name`` and make it as torchrun
    does from these flags (strings as torchrun takes them); replies :class:`Opened`."""

    name: str
    log_dir: str | None
    redirects: str
    tee: str
    local_ranks_filter: list[int] | None


class Reify(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """One attempt's ``LogsSpecs.reify(envs)``; replies :class:`Reified`."""

    envs: dict[int, dict[str, str]]
    """Per local rank, torchrun's variables (not the environment they inherit)."""


class Share(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """Write ``value`` at ``key`` in the current round's store, then read each of ``peers``
    that exists (never waiting for one); replies :class:`Shared`."""

    key: str
    value: bytes
    peers: list[str]


Request = HostStore | Open | NextRound | Poll | Finish | LoadLogsSpecs | Reify | Share


# -- replies -------------------------------------------------------------------


class Ready(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """The helper runs; ``torch``: whether its interpreter can import torch."""

    torch: bool
    python: str


class Hosting(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    port: int


class Opened(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    pass


class Round(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """This node's place in a complete round, as torch's agent assigned it."""

    round: int
    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int
    first_rank: int
    world_size: int
    role_first_rank: int
    role_world_size: int
    use_agent_store: bool


class Polled(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    waiting: int
    """torch's ``num_nodes_waiting()``: nodes queued for the next round."""
    closed: bool
    missing: list[str]
    """Members of this node's round no longer in the rendezvous in any role."""


class Done(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    waited: float
    """Seconds spent at the exit barrier."""


class Reified(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    dest: LogsDest
    envs: dict[int, dict[str, str]]
    """``envs`` after ``reify``, which may set variables (torch's: ``TORCHELASTIC_ERROR_FILE``)."""


class Failed(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    """A request failed: ``kind`` sorts torch's exception, ``message`` says what happened."""

    kind: Literal["closed", "graceful", "timeout", "connection", "torch", "error"]
    """``graceful``: torch's ``RendezvousGracefulExitError``, the run closed while this
    node waited in its redundancy list (beyond ``max_nodes``)."""
    message: str


class Shared(msgspec.Struct, tag=True, frozen=True, kw_only=True):
    values: dict[str, bytes]
    """Each of the peers' keys found, with its value."""


Reply = Ready | Hosting | Opened | Round | Polled | Done | Reified | Shared | Failed
