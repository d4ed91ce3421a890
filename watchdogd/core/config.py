"""The daemon's configuration: TOML decoded into Structs, in one call.

Every field has a default, so an empty file (or none) is the embedded
default. Unknown keys and bad values raise :class:`ConfigError` naming the
key (``limits.max_frame``); nothing here exits the process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Literal

import msgspec

from watchdogd_client._paths import FIFO_NAME, SOCKET_NAME, default_runtime_dir
from watchdogd_client.groups import DeadlineRule, GroupSpec

__all__ = ["Config", "ConfigError", "Limits", "PolicyConfig", "decode_config", "override"]

PositiveInt = Annotated[int, msgspec.Meta(ge=1)]


class ConfigError(Exception):
    """A config file or option is invalid; the message names the key."""


class Limits(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
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


class PolicyConfig(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    protected_pids: list[Annotated[int, msgspec.Meta(ge=1)]] = []
    fifo_allowed_uids: list[Annotated[int, msgspec.Meta(ge=0)]] | None = None
    """uids whose processes FIFO requests may target; default: the daemon's own uid."""
    allowed_signals: list[Annotated[int, msgspec.Meta(ge=1, le=64)]] | None = None
    """Signals a timer may carry; default: every valid signal."""
    admin_group: str | None = "watchdogd"
    """Members may arm timers on any unprotected process, like root."""


FileMode = Annotated[int, msgspec.Meta(ge=0, le=0o777)]


class Config(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    runtime_dir: str | None = None
    """Holds the socket and FIFO unless they are set; default per user (see README)."""
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
    stack_dumps: Literal["auto", "faulthandler", "py-spy", "off"] = "auto"
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
    Below 0 a trainer's request preempts the trainer for the loop's turn (README)."""
    limits: Limits = msgspec.field(default_factory=Limits)
    policy: PolicyConfig = msgspec.field(default_factory=PolicyConfig)
    groups: list[GroupSpec] = []
    """Worker groups started with the daemon (``[[groups]]`` tables)."""

    def __post_init__(self) -> None:
        names = [g.name for g in self.groups]
        if len(set(names)) != len(names):
            raise ValueError(f"group names must be unique, got {names}")

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
