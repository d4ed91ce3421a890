"""The wire protocol between trainers, operators and the daemon.

Two channels, one module, so that client and daemon can never disagree:

FIFO (torch compatible)
    Newline-delimited JSON, one :class:`FileTimerRequest` per line, exactly
    what ``torch.distributed.elastic.timer.FileTimerClient`` writes::

        {"version": 1, "pid": 4242, "scope_id": "step", "expiration_time": 1.7e9, "signal": 9}

    A negative ``expiration_time`` releases the timer. Every line stands
    alone: a malformed line is reported and skipped, never the lines around it.

Unix stream socket
    Frames of a 4-byte big-endian length followed by that many bytes of
    msgpack, each a tagged Struct (``{"op": "acquire", ...}``). The first
    request on a connection is :class:`Hello`; every request after it gets
    the next sequence number (Hello is 0). Replies name the ``seq`` they
    answer. ``acquire``, ``release``, ``release_all``, ``device_time`` and
    ``progress`` are answered only when they fail, so a client can pipeline
    them without waiting for a round trip; ``sync`` is answered once
    everything before it is processed.

Error codes (stable, see :data:`ERROR_CODES`) tell a program what went wrong;
the message tells a person.
"""

from __future__ import annotations

import signal as _signal
from typing import Annotated, Final, Literal

import msgspec

from .events import Event
from .framing import HEADER_SIZE, frame
from .groups import Fault, GroupInfo, GroupSpec

__all__ = [
    "DUMP_MARKER",
    "ERROR_CODES",
    "FRAME_HEADER_SIZE",
    "MAX_FRAME_SIZE",
    "PROTOCOL_VERSION",
    "Acquire",
    "ClearQuarantine",
    "DeviceTime",
    "DumpInfo",
    "DumpList",
    "DumpText",
    "DumpTrace",
    "EndpointOwner",
    "Error",
    "EventBatch",
    "FileTimerRequest",
    "GetDump",
    "GetEvents",
    "GetStatus",
    "GetStragglers",
    "GetTimeline",
    "GpuInfo",
    "GpuProcess",
    "GroupList",
    "Hello",
    "InjectFault",
    "ListDumps",
    "ListGroups",
    "ListTimers",
    "Ok",
    "Progress",
    "Release",
    "ReleaseAll",
    "Reply",
    "Request",
    "RestartGroup",
    "StatusInfo",
    "StopGroup",
    "StragglerInfo",
    "StragglerList",
    "SubmitGroup",
    "Sync",
    "Synced",
    "Timeline",
    "TimerInfo",
    "TimerList",
    "TimerSpan",
    "TraceInfo",
    "Welcome",
    "frame",
]

PROTOCOL_VERSION: Final = 1
FRAME_HEADER_SIZE: Final = HEADER_SIZE
# Large enough for a status or a list of thousands of timers in a reply;
# requests are tiny, and the daemon enforces its own (smaller) request cap.
MAX_FRAME_SIZE: Final = 64 * 1024 * 1024
# What a client's handler appends to its faulthandler file once faulthandler's
# dump is written (``Hello.dump_marker``). faulthandler escapes every control
# character it prints, so NUL bytes never occur in a dump.
DUMP_MARKER: Final = b"\x00watchdogd: end of dump\x00\n"

ErrorCode = Literal[
    "bad_frame",
    "bad_request",
    "hello_required",
    "version_mismatch",
    "refused",
    "no_such_process",
    "limit_exceeded",
    "group_error",
    "internal",
]
ERROR_CODES: Final[tuple[str, ...]] = ErrorCode.__args__  # type: ignore[attr-defined]

_SIGKILL: Final = int(_signal.SIGKILL)


class FileTimerRequest(msgspec.Struct):
    """One line on the FIFO: torch's ``FileTimerRequest.to_json()`` shape."""

    version: int
    pid: int
    scope_id: str
    expiration_time: float
    signal: int = 0


class EndpointOwner(msgspec.Struct, frozen=True):
    """What ``PATH.lock`` beside an endpoint holds: the daemon serving it.

    ``pid`` and ``start_time`` (``/proc/PID/stat`` field 22) name the daemon
    even after its pid is reused; ``dev``/``ino`` are the endpoint's inode
    (0 until it is open), which cannot be reused while the daemon holds it
    open. A FIFO client keeps its descriptor only when the FIFO it opened is
    this inode of a daemon that still runs (see ``FileTimerClient``).
    """

    pid: int
    start_time: int
    dev: int = 0
    ino: int = 0


# --- requests ---------------------------------------------------------------


class Hello(msgspec.Struct, tag="hello", tag_field="op"):
    """Open a session: the client's protocol version and a name for logs.

    ``stack_signal``: the client will register :mod:`faulthandler` on this
    signal; the daemon answers with a descriptor (``SCM_RIGHTS``) of a file
    it names for the client's pid, to write the dump into.
    ``dump_marker``: after faulthandler's output, the client writes
    :data:`DUMP_MARKER` into that file, so the daemon need not wait for the
    file to stop growing to know that the dump is complete.
    """

    version: int = PROTOCOL_VERSION
    client: str = ""
    stack_signal: int | None = None
    dump_marker: bool = False


class Acquire(msgspec.Struct, tag="acquire", tag_field="op"):
    """Arm (or re-arm) the timer ``(pid, scope_id)``.

    ``expiration_time`` is absolute wall-clock time (``time.time()``), as in
    torch; the daemon converts it to its monotonic clock on receipt. ``pid``
    defaults to the caller's own (from ``SO_PEERCRED``). A signal ``<= 0``
    records the expiry without killing. A negative ``expiration_time`` is a
    release. Answered only on failure.

    ``learn``: the daemon derives the deadline from the scope's history
    (``expires(after=LEARN)``); ``expiration_time`` is then the call's
    initial deadline, used while the scope is still being learned, and
    ``inf`` when the call gave none.
    """

    scope_id: str
    expiration_time: float
    signal: int = _SIGKILL
    pid: int | None = None
    learn: bool = False


class Release(msgspec.Struct, tag="release", tag_field="op"):
    """Disarm the timer ``(pid, scope_id)``; a missing timer is not an error."""

    scope_id: str
    pid: int | None = None


class ReleaseAll(msgspec.Struct, tag="release_all", tag_field="op"):
    """Disarm every timer of ``pid`` (default: the caller)."""

    pid: int | None = None


class Sync(msgspec.Struct, tag="sync", tag_field="op"):
    """Answered with :class:`Synced` once every earlier request is processed."""


class ListTimers(msgspec.Struct, tag="list_timers", tag_field="op"):
    """Answered with :class:`TimerList`: every active timer, soonest first."""


class GetStatus(msgspec.Struct, tag="status", tag_field="op"):
    """Answered with :class:`StatusInfo`."""


class GetEvents(msgspec.Struct, tag="events", tag_field="op", kw_only=True):
    """Recent events (at or after ``since_ms``, at most ``limit``) as :class:`EventBatch`.

    With ``follow``, more batches with the same ``seq`` keep coming as events
    happen, until either side closes the connection; ``dropped`` counts the
    events a slow reader missed.
    """

    since_ms: int | None = None
    limit: int | None = None
    follow: bool = False


class ListDumps(msgspec.Struct, tag="list_dumps", tag_field="op"):
    """Answered with :class:`DumpList`: the saved stack dumps, oldest first."""


class GetDump(msgspec.Struct, tag="get_dump", tag_field="op"):
    """Answered with :class:`DumpText`: one saved stack dump.

    With ``trace``, answered with :class:`DumpTrace` instead: the NCCL
    flight-recorder trace kept with that dump for global rank ``trace``.
    """

    id: str
    trace: int | None = None


class GetTimeline(msgspec.Struct, tag="timeline", tag_field="op"):
    """Answered with :class:`Timeline`: the recent timers, from arming to their end."""


class GetScopes(msgspec.Struct, tag="scopes", tag_field="op"):
    """Answered with :class:`ScopeList`: how long each named scope takes, per job and rank."""


class GetStragglers(msgspec.Struct, tag="stragglers", tag_field="op"):
    """Answered with :class:`StragglerList`: each worker rank's straggler scores per scope.

    ``job``: the whole job of each group with ranks here, every node's ranks
    as they last published them (multi-node etcd and c10d groups).
    """

    job: bool = False


class DeviceTime(msgspec.Struct, tag="device_time", tag_field="op"):
    """How long the GPU took for the caller's last completed ``scope_id`` (CUDA events).

    The daemon scores that scope's stragglers on device time instead of host
    time from then on. Answered only on failure.
    """

    scope_id: str
    seconds: float


class Progress(msgspec.Struct, tag="progress", tag_field="op"):
    """The caller, a worker of a group, completed training step ``step`` (absolute: a
    resumed run counts on from its checkpoint's step).

    Its group counts an attempt as progress only if some worker got past the
    highest step the earlier attempts reported; from a process that is no
    worker it is ignored. Answered only on failure.
    """

    step: Annotated[int, msgspec.Meta(ge=0)]


class ListGroups(msgspec.Struct, tag="list_groups", tag_field="op"):
    """Answered with :class:`GroupList`."""


class SubmitGroup(msgspec.Struct, tag="submit_group", tag_field="op"):
    """Start a worker group (root or the admin group only). Answered with :class:`Ok`."""

    spec: GroupSpec


class StopGroup(msgspec.Struct, tag="stop_group", tag_field="op"):
    """Stop a group's workers (SIGTERM, then SIGKILL). Answered with :class:`Ok`."""

    name: str


class RestartGroup(msgspec.Struct, tag="restart_group", tag_field="op"):
    """Restart a group's workers without spending a restart. Answered with :class:`Ok`."""

    name: str


class ClearQuarantine(msgspec.Struct, tag="clear_quarantine", tag_field="op"):
    """Bring node ``node``, set aside by its etcd job, back into the job (root or the admin
    group). Answered with :class:`Ok`."""

    node: str


class InjectFault(msgspec.Struct, tag="inject", tag_field="op"):
    """Inject ``fault`` into group ``name`` ``fault.after`` seconds from now (root or the
    admin group, and only where the config enables ``fault_injection``). Answered with
    :class:`Ok`."""

    name: str
    fault: Fault


Request = (
    Hello
    | GetScopes
    | GetStragglers
    | DeviceTime
    | Progress
    | Acquire
    | Release
    | ReleaseAll
    | Sync
    | ListTimers
    | GetStatus
    | GetEvents
    | ListDumps
    | GetDump
    | GetTimeline
    | ListGroups
    | SubmitGroup
    | StopGroup
    | RestartGroup
    | ClearQuarantine
    | InjectFault
)


# --- replies ----------------------------------------------------------------


class Welcome(msgspec.Struct, tag="welcome", tag_field="op"):
    """Reply to :class:`Hello`: the daemon's identity and how it sees the peer."""

    seq: int
    version: int
    daemon_pid: int
    peer_pid: int
    peer_uid: int
    stack_dumps: bool = False
    """A faulthandler file descriptor came with this reply."""


class Synced(msgspec.Struct, tag="synced", tag_field="op"):
    seq: int


class TimerInfo(msgspec.Struct, kw_only=True):
    pid: int
    scope_id: str
    remaining_s: float
    expiration_time: float
    signal: int
    source: Literal["fifo", "socket"]
    uid: int | None


class TimerList(msgspec.Struct, tag="timer_list", tag_field="op"):
    """The soonest timers (at most the daemon's ``max_listed_timers``) and how many exist."""

    seq: int
    timers: list[TimerInfo]
    total: int


class GpuProcess(msgspec.Struct, kw_only=True):
    pid: int
    used_mib: int | None
    group: str | None = None
    rank: int | None = None


class GpuInfo(msgspec.Struct, kw_only=True):
    index: int
    name: str
    memory_used_mib: int
    memory_total_mib: int
    temperature_c: int
    processes: list[GpuProcess]


class StatusInfo(msgspec.Struct, tag="status_info", tag_field="op", kw_only=True):
    seq: int
    version: str
    pid: int
    uptime_s: float
    socket_path: str
    fifo_path: str
    timers: int
    processes: int
    connections: int
    requests: dict[str, int]
    expired: int
    signalled: int
    refused: int
    bad_input: int
    connections_refused: dict[str, int] = {}
    """Socket connections refused at accept, by the limit they met."""
    suppressed: dict[str, int] = {}
    """Events counted but not recorded (over ``max_noisy_events_per_s``), by name."""
    gpus: list[GpuInfo] = []
    gpu_note: str | None = None
    """Why there is no GPU information (no NVML, no driver, no GPU)."""
    containment: str = ""
    """How workers and all they start are ended: a cgroup per worker, or the weaker mode
    and why."""


class EventBatch(msgspec.Struct, tag="event_batch", tag_field="op"):
    seq: int
    events: list[Event]
    dropped: int = 0


class TraceInfo(msgspec.Struct, kw_only=True):
    """One rank's NCCL flight-recorder trace, taken with a dump: kept, or why not."""

    rank: int
    pid: int
    size: int = 0
    """Bytes kept (torch's pickle, as the rank wrote it); 0: none."""
    problem: str = ""
    """Why there is no trace, or why the one kept may be incomplete."""


class DumpInfo(msgspec.Struct, kw_only=True):
    """A saved dump: whose, which timer, how its stacks were taken, the ranks' traces."""

    id: str
    pid: int
    scope_id: str
    method: str
    """``faulthandler`` or ``py-spy``; ``""``: no stacks, only traces."""
    timestamp: float
    size: int
    traces: list[TraceInfo] = []
    """With a group whose workers run torch's flight recorder: one per rank on this node."""


class DumpList(msgspec.Struct, tag="dump_list", tag_field="op"):
    seq: int
    dumps: list[DumpInfo]


class DumpText(msgspec.Struct, tag="dump_text", tag_field="op"):
    seq: int
    info: DumpInfo
    text: str


class DumpTrace(msgspec.Struct, tag="dump_trace", tag_field="op"):
    seq: int
    info: DumpInfo
    rank: int
    data: bytes
    """The trace as the rank wrote it: a pickle, to decode without building objects."""


class TimerSpan(msgspec.Struct, kw_only=True):
    """One timer's life: armed, then released, expired or dropped (its process exited)."""

    pid: int
    scope_id: str
    armed: float
    """``time.time()`` when armed (or, restored from a snapshot, when restored)."""
    ended: float | None
    """When it ended; None: still armed."""
    outcome: Literal["released", "expired", "dropped", "armed"]
    uid: int | None


class ScopeInfo(msgspec.Struct, kw_only=True):
    """Durations of one scope's released timers, for one rank of one job."""

    job: str
    """The worker group of a supervised process; empty for any other."""
    scope: str
    rank: int
    """The global rank in ``job``; the pid when ``job`` is empty."""
    uid: int
    count: int
    p50_s: float
    p99_s: float
    max_s: float
    """The maximum, decayed (a half-life of ``scope_stats_half_life`` samples)."""
    mean_s: float
    deadline_s: float | None = None
    """What ``expires(after=LEARN)`` arms now (None: no initial yet, or not learned)."""
    deadline_source: str = ""
    """Where that comes from: ``learning (K of N)``, ``learned``, ``floor``, …; empty: no LEARN."""


class ScopeList(msgspec.Struct, tag="scope_list", tag_field="op"):
    """Every scope's statistics the peer may see, and the sketches refused by the caps."""

    seq: int
    scopes: list[ScopeInfo]
    refused: int


class StragglerInfo(msgspec.Struct, kw_only=True):
    """One rank's straggler scores for one scope of a worker group, as of its last window."""

    group: str
    scope: str
    rank: int
    """The global rank in ``group``."""
    uid: int
    windows: int
    """Windows of ``straggler_window`` releases completed."""
    relative: float
    """The fastest rank's window median / this rank's (0-1, 1: the fastest)."""
    individual: float
    """This rank's best window median / its current one (0-1, 1: its best)."""
    p50_s: float
    """The median of this rank's last window."""
    device: bool
    """Scored on device time (CUDA events the client reported), not host time."""
    flagged: bool
    """Flagged by the node that runs the rank (which alone raises its event)."""
    hostname: str = ""
    """The node that runs the rank."""
    node_rank: int = -1
    """That node's group rank (-1: not known yet, before its first publication)."""
    stale: bool = False
    """Its node's summary stopped changing: the scores are that node's last, not rescored."""


class StragglerList(msgspec.Struct, tag="straggler_list", tag_field="op"):
    """Every scored rank the peer may see, and the settings that score them."""

    seq: int
    stragglers: list[StragglerInfo]
    window: int
    threshold: float
    windows: int
    """Consecutive windows under ``threshold`` that flag a rank (and above, that clear it)."""


class Timeline(msgspec.Struct, tag="timeline", tag_field="op"):
    """The last ``timeline_size`` timers that ended, oldest first, then those still armed."""

    seq: int
    spans: list[TimerSpan]


class GroupList(msgspec.Struct, tag="group_list", tag_field="op"):
    seq: int
    groups: list[GroupInfo]


class Ok(msgspec.Struct, tag="ok", tag_field="op"):
    seq: int
    message: str = ""


class Error(msgspec.Struct, tag="error", tag_field="op"):
    """A request failed; ``seq`` names which one (``-1``: the stream itself)."""

    seq: int
    code: ErrorCode
    message: str


Reply = (
    Welcome
    | ScopeList
    | StragglerList
    | Synced
    | TimerList
    | StatusInfo
    | EventBatch
    | DumpList
    | DumpText
    | DumpTrace
    | Timeline
    | GroupList
    | Ok
    | Error
)
