"""The daemon's configuration: TOML decoded into Structs, in one call.

Every field has a default, so an empty file (or none) is the embedded
default. Unknown keys and bad values raise :class:`ConfigError` naming the
key (``limits.max_frame``); nothing here exits the process.

A Config is frozen, and changed only through :func:`override`, which
validates the result as a file's would be. Each part of the daemon sees
only its own view of it (``config.reaper_settings()`` and the like,
:class:`ReaperSettings`): frozen Structs holding the few settings that
part reads, built from the one validated Config when the daemon starts
and again at every reload (the part's ``reconfigure(settings)``). The
views are not a file layout: the TOML keys stay where they are.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from watchdogd_client._paths import FIFO_NAME, SOCKET_NAME, default_runtime_dir
from watchdogd_client.groups import DeadlineRule, GroupSpec

__all__ = [
    "AdmissionLimits",
    "Config",
    "ConfigError",
    "FifoSettings",
    "LearnedSettings",
    "Limits",
    "NoisySettings",
    "PersistenceSettings",
    "PolicyConfig",
    "QuerySettings",
    "ReaperSettings",
    "ScopeSettings",
    "SocketSettings",
    "StragglerSettings",
    "SupervisorSettings",
    "TimelineSettings",
    "TimerSettings",
    "decode_config",
    "override",
]

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


class ConfigError(Exception):
    """A config file or option is invalid; the message names the key."""


class Limits(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    max_line: Annotated[int, msgspec.Meta(ge=128)] = 64 * 1024
    """Longest FIFO line kept; longer ones are dropped and reported."""
    max_frame: Annotated[int, msgspec.Meta(ge=128)] = 64 * 1024
    """Largest socket request frame; a larger declared length closes the connection."""
    max_scope_len: PositiveInt = 1024
    max_timers_per_pid: PositiveInt = 10_000
    max_timers: PositiveInt = 2_000_000
    max_connections: PositiveInt = 1024
    max_connections_per_uid: PositiveInt = 64
    """Socket connections one uid may hold open; root and the admin group are bounded
    only by ``max_connections``."""
    max_noisy_events_per_s: PositiveInt = 10
    """``bad_input``, ``request_refused`` and ``connection_refused`` events recorded per
    second for one source (the event, its transport and the peer's uid); the rest are
    counted, and summarised in one ``<event>_suppressed`` event a second."""
    max_pending_bytes: Annotated[int, msgspec.Meta(ge=4096)] = 1024 * 1024
    """Replies held for one connection before the daemon stops reading from it."""
    max_listed_timers: PositiveInt = 100_000
    """Most timers one ``list_timers`` reply carries (soonest first; marked truncated)."""
    max_scope_stats_per_uid: PositiveInt = 1_000
    """Duration sketches (``watchdogctl scopes``) one uid's scopes may create, and as many
    learned scopes (``expires(after=LEARN)``)."""
    max_scope_stats_per_job: PositiveInt = 10_000
    """Duration sketches one worker group may create (scopes times ranks)."""
    fifo_pipe_size: Annotated[int, msgspec.Meta(ge=4096)] = 1024 * 1024
    """Requested FIFO buffer (``F_SETPIPE_SZ``), capped by ``/proc/sys/fs/pipe-max-size``."""


class PolicyConfig(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    protected_pids: list[Annotated[int, msgspec.Meta(ge=1)]] = []
    fifo_allowed_uids: list[Annotated[int, msgspec.Meta(ge=0)]] | None = None
    """uids whose processes FIFO requests may target; default: the daemon's own uid."""
    allowed_signals: list[Annotated[int, msgspec.Meta(ge=1, le=64)]] | None = None
    """Signals a timer may carry; default: every valid signal."""
    admin_group: str | None = "watchdogd"
    """Members may arm timers on any unprotected process, like root."""


FileMode = Annotated[int, msgspec.Meta(ge=0, le=0o777)]
StackDumps = Literal["auto", "faulthandler", "py-spy", "off"]


# -- the parts' views -------------------------------------------------------------------
# Field names are the part's own; the docstring names the keys they come from.


class AdmissionLimits(msgspec.Struct, frozen=True, kw_only=True):
    """``limits.max_scope_len``, ``max_timers``, ``max_timers_per_pid``."""

    max_scope_len: int
    max_timers: int
    max_timers_per_pid: int


class TimerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The timer core's: what arming is admitted against, and who may target whom."""

    admission: AdmissionLimits
    policy: PolicyConfig


class ReaperSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The reaper's: ``stack_dumps``, ``stack_dump_timeout``, ``flight_recorder_timeout``,
    ``kill_grace``."""

    stack_dumps: StackDumps
    stack_dump_timeout: float
    flight_recorder_timeout: float
    kill_grace: float | None


class StragglerSettings(msgspec.Struct, frozen=True, kw_only=True):
    """``straggler_window``, ``straggler_threshold``, ``straggler_windows``,
    ``straggler_publish_interval``."""

    window: int
    threshold: float
    windows: int
    publish_interval: float


class ScopeSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The scope recorder's: ``limits.max_scope_stats_per_uid`` and ``_per_job``,
    ``scope_stats_half_life``, ``deadlines``, and the stragglers'."""

    max_per_uid: int
    max_per_job: int
    half_life: float
    deadlines: tuple[DeadlineRule, ...]
    stragglers: StragglerSettings


class SocketSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The socket front's: ``limits.max_connections``, ``max_connections_per_uid``,
    ``max_frame``, ``max_pending_bytes``, and ``policy.admin_group``."""

    max_connections: int
    max_connections_per_uid: int
    max_frame: int
    max_pending_bytes: int
    admin_group: str | None


class FifoSettings(msgspec.Struct, frozen=True, kw_only=True):
    """The FIFO front's: ``limits.max_line``."""

    max_line: int


class NoisySettings(msgspec.Struct, frozen=True, kw_only=True):
    """``limits.max_noisy_events_per_s``."""

    max_per_s: int


class TimelineSettings(msgspec.Struct, frozen=True, kw_only=True):
    """``timeline_size``."""

    size: int


class QuerySettings(msgspec.Struct, frozen=True, kw_only=True):
    """``limits.max_listed_timers``."""

    max_listed: int


class PersistenceSettings(msgspec.Struct, frozen=True, kw_only=True):
    """``snapshot_interval`` (the snapshot's place is fixed until a restart)."""

    interval: float


class LearnedSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Where learned deadlines are kept (``learned_dir``, resolved)."""

    directory: Path


class SupervisorSettings(msgspec.Struct, frozen=True, kw_only=True):
    """``fault_injection``."""

    fault_injection: bool


class Config(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    runtime_dir: str | None = None
    """Holds the socket and FIFO unless they are set; default per user (docs/operations.md)."""
    socket: str | None = None
    fifo: str | None = None
    socket_mode: FileMode = 0o660
    fifo_mode: FileMode = 0o620
    group: str | None = "watchdogd"
    """Group owning the socket and FIFO; if no such group exists, the daemon's own."""
    state_dir: str | None = None
    """Where the timer snapshot lives; default ``$STATE_DIRECTORY`` (systemd), else runtime_dir."""
    snapshot_interval: Annotated[float, msgspec.Meta(ge=0.01)] = 0.5
    """Most often the snapshot is rewritten (seconds); it is written only after changes."""
    event_log: str | None = None
    """Append every event as one JSON line to this file."""
    event_log_handler: str = "null"
    """Also record every event to this torch event handler (torchrun's ``--event-log-handler``)."""
    event_handlers: dict[str, str] = {}
    """Handlers by name, ``"module:attribute"``: a ``logging.Handler`` or a callable making one."""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = "text"
    """``text``: ``name key=value …`` lines; ``json``: each event as one JSON object."""
    stack_dumps: StackDumps = "auto"
    """Capture a hung process's stacks before killing it (auto: faulthandler, else py-spy)."""
    stack_dump_timeout: Annotated[float, msgspec.Meta(gt=0)] = 2.0
    dumps_kept: PositiveInt = 100
    flight_recorder_timeout: Annotated[float, msgspec.Meta(gt=0)] = 3.0
    """How long, before a kill, to wait for the group's ranks' NCCL flight-recorder traces."""
    scope_stats_half_life: Annotated[float, msgspec.Meta(ge=1)] = 10_000
    """Samples after which a scope's maximum counts half (``watchdogctl scopes``)."""
    deadlines: list[DeadlineRule] = []
    """How learned deadlines are derived (``[[deadlines]]`` tables), after a group's own."""
    learned_dir: str | None = None
    """Where what jobs with a ``job_key`` learned is kept across runs; default
    ``$STATE_DIRECTORY/learned`` (systemd), else ``/var/lib/watchdogd/learned`` as root,
    else ``$XDG_STATE_HOME/watchdogd/learned`` (``~/.local/state``)."""
    straggler_window: Annotated[int, msgspec.Meta(ge=2)] = 50
    """Releases of one rank's scope per straggler window (a sliding one, scored every half)."""
    straggler_threshold: Annotated[float, msgspec.Meta(gt=0, le=1)] = 0.85
    """A rank scoring under this (relative or individual, 0-1) is slow."""
    straggler_windows: PositiveInt = 2
    """Consecutive slow scorings that flag a straggler (and good ones that clear it)."""
    straggler_publish_interval: Annotated[float, msgspec.Meta(ge=0.1)] = 10.0
    """Seconds between a node's publications of its ranks' straggler summaries to a
    multi-node job's rendezvous store (one write per node and job); set it alike on
    every node: a summary unchanged for 3 intervals is stale."""
    timeline_size: Annotated[int, msgspec.Meta(ge=0)] = 10_000
    """Timers that ended kept for a job's timeline (``watchdogctl events --trace``); 0: none."""
    kill_grace: Annotated[float, msgspec.Meta(ge=0)] | None = 10.0
    """SIGKILL a process still alive this long after its timer's signal (None: never)."""
    fault_injection: bool = False
    """Allow injected faults (``watchdogctl inject``, a group's ``faults``): for drills only."""
    gpu_health: bool = False
    """Watch NVML for XID and double-bit ECC errors; groups on a faulty GPU go UNHEALTHY."""
    metrics_listen: str | None = None
    """``PORT`` (loopback) or ``HOST:PORT`` for ``/metrics`` and ``/healthz``; None: off."""
    health_max_lag: Annotated[float, msgspec.Meta(gt=0)] = 1.0
    """``/healthz`` answers 503 once the event loop has stalled this long."""
    event_ring_size: PositiveInt = 10_000
    """Recent events kept for ``watchdogctl events``."""
    loop_realtime: bool = True
    """From 50 ms before a deadline until its signals are sent, the event loop's thread
    runs ``SCHED_FIFO`` (priority 1), ahead of every trainer's thread; plain otherwise.
    Needs ``CAP_SYS_NICE`` or ``LimitRTPRIO=1``."""
    loop_nice: Annotated[int, msgspec.Meta(ge=-20, le=19)] | None = None
    """The event loop thread's nice value (workers start at 0 or above); None: as started.
    Below 0 a trainer's request preempts the trainer for the loop's turn (docs/operations.md)."""
    process_containment: Literal["auto", "session"] = "auto"
    """How a worker and all it starts are ended: ``auto``, a cgroup v2 per worker where the
    hierarchy may be written (else ``session``); ``session``, the weaker mode: its process
    group and a sweep of ``/proc`` (docs/operations.md, "Containment"). Read at start."""
    limits: Limits = msgspec.field(default_factory=Limits)
    policy: PolicyConfig = msgspec.field(default_factory=PolicyConfig)
    groups: list[GroupSpec] = []
    """Worker groups started with the daemon (``[[groups]]`` tables)."""

    def __post_init__(self) -> None:
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"group names must be unique, got {names}")

    # -- the parts' views ------------------------------------------------------------

    def timer_settings(self) -> TimerSettings:
        limits = self.limits
        admission = AdmissionLimits(
            max_scope_len=limits.max_scope_len,
            max_timers=limits.max_timers,
            max_timers_per_pid=limits.max_timers_per_pid,
        )
        return TimerSettings(admission=admission, policy=self.policy)

    def reaper_settings(self) -> ReaperSettings:
        return ReaperSettings(
            stack_dumps=self.stack_dumps,
            stack_dump_timeout=self.stack_dump_timeout,
            flight_recorder_timeout=self.flight_recorder_timeout,
            kill_grace=self.kill_grace,
        )

    def scope_settings(self) -> ScopeSettings:
        stragglers = StragglerSettings(
            window=self.straggler_window,
            threshold=self.straggler_threshold,
            windows=self.straggler_windows,
            publish_interval=self.straggler_publish_interval,
        )
        return ScopeSettings(
            max_per_uid=self.limits.max_scope_stats_per_uid,
            max_per_job=self.limits.max_scope_stats_per_job,
            half_life=self.scope_stats_half_life,
            deadlines=tuple(self.deadlines),
            stragglers=stragglers,
        )

    def socket_settings(self) -> SocketSettings:
        limits = self.limits
        return SocketSettings(
            max_connections=limits.max_connections,
            max_connections_per_uid=limits.max_connections_per_uid,
            max_frame=limits.max_frame,
            max_pending_bytes=limits.max_pending_bytes,
            admin_group=self.policy.admin_group,
        )

    def fifo_settings(self) -> FifoSettings:
        return FifoSettings(max_line=self.limits.max_line)

    def noisy_settings(self) -> NoisySettings:
        return NoisySettings(max_per_s=self.limits.max_noisy_events_per_s)

    def timeline_settings(self) -> TimelineSettings:
        return TimelineSettings(size=self.timeline_size)

    def query_settings(self) -> QuerySettings:
        return QuerySettings(max_listed=self.limits.max_listed_timers)

    def persistence_settings(self) -> PersistenceSettings:
        return PersistenceSettings(interval=self.snapshot_interval)

    def learned_settings(self) -> LearnedSettings:
        return LearnedSettings(directory=self.learned_path())

    def supervisor_settings(self) -> SupervisorSettings:
        return SupervisorSettings(fault_injection=self.fault_injection)

    # -- paths ------------------------------------------------------------------------

    def runtime_path(self) -> Path:
        return Path(self.runtime_dir) if self.runtime_dir else default_runtime_dir()

    def socket_path(self) -> Path:
        return Path(self.socket) if self.socket else self.runtime_path() / SOCKET_NAME

    def fifo_path(self) -> Path:
        return Path(self.fifo) if self.fifo else self.runtime_path() / FIFO_NAME

    def learned_path(self) -> Path:
        """The persistent directory for learned deadlines (never a temporary one)."""
        if self.learned_dir:
            return Path(self.learned_dir)
        systemd_state = os.environ.get("STATE_DIRECTORY")
        if systemd_state:
            return Path(systemd_state.split(":")[0]) / "learned"
        if os.geteuid() == 0:
            return Path("/var/lib/watchdogd/learned")
        xdg = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
        return Path(xdg) / "watchdogd" / "learned"

    def state_path(self) -> Path:
        if self.state_dir:
            return Path(self.state_dir)
        systemd_state = os.environ.get("STATE_DIRECTORY")
        if systemd_state:
            return Path(systemd_state.split(":")[0])
        return self.socket_path().parent


def _explain(error: msgspec.ValidationError | msgspec.DecodeError) -> str:
    message = str(error)
    if " - at `$." in message:
        text, _, where = message.partition(" - at `$.")
        return f"{where.rstrip('`')}: {text}"
    return message


def decode_config(data: bytes, source: str) -> Config:
    """TOML ``data`` (read from ``source``, named in errors) as a :class:`Config`."""
    try:
        return msgspec.toml.decode(data, type=Config)
    except (msgspec.ValidationError, msgspec.DecodeError) as e:
        raise ConfigError(f"{source}: {_explain(e)}") from None


def override(config: Config, source: str, **values: object) -> Config:
    """``config`` with ``values`` laid over it, checked as a file's would be (a plain
    ``structs.replace`` checks nothing); ConfigError names ``source`` and the key."""
    try:
        return msgspec.convert({**msgspec.to_builtins(config), **values}, Config)
    except msgspec.ValidationError as e:
        raise ConfigError(f"{source}: {_explain(e)}") from None
