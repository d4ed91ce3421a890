"""What one run of a worker group in the foreground takes: :class:`RunOptions`, and its group.

Rules:

- One model, two fronts. ``watchdogd run``'s flags (``cli/run.py``) and
  torch's ``LaunchConfig`` (``launcher.py``) each map into a
  :class:`RunOptions` through :func:`run_options`, the one place options are
  checked; :func:`group_spec` is the one way from options to a
  :class:`~watchdogd_client.groups.GroupSpec`, and :func:`daemon_config` to the
  private daemon's :class:`~watchdogd.core.config.Config`.
- The defaults are torchrun's command line's. Where torch's ``LaunchConfig``
  differs by design (``max_restarts`` 3, role ``default_role``, backend
  ``etcd``), it keeps its own defaults and passes every field.
- Pure: what the host contributes (its environment, visible GPUs, CPU count,
  interpreter, a directory for logs) comes in as a :class:`Host`. No
  ``PET_*`` variable is read here: the command line reads them, as torchrun
  does, and the Python API never does.
- An option that cannot be honoured raises :class:`OptionsError` (a
  ValueError) with the field as named here; each front names it in its own
  words (``--max-restarts``; ``max_restarts``).
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from watchdogd.core.config import Config, ConfigError, override
from watchdogd.core.numa import AffinityMode
from watchdogd.core.workerenv import apply_env_knobs
from watchdogd_client.groups import C10dConf, DeadlineRule, Fault, GroupSpec

__all__ = [
    "DEFAULT_RDZV_TIMEOUT",
    "DEFAULT_SHUTDOWN_TIMEOUT",
    "DEFAULT_SIGNALS",
    "SHUTDOWN_TIMEOUT_ENV",
    "Host",
    "OptionsError",
    "RunOptions",
    "daemon_config",
    "default_shutdown_timeout",
    "group_spec",
    "handled_signals",
    "memory_bytes",
    "parse_nnodes",
    "run_options",
    "unread_rdzv_conf",
]

DEFAULT_SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torch's, CLI and LaunchConfig alike
DEFAULT_RDZV_TIMEOUT = 900  # LaunchConfig's rdzv_configs["timeout"] unless told
SHUTDOWN_TIMEOUT_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
_OVERRIDES = "run options"  # how a ConfigError names the config keys the options set

NonNegative = Annotated[int, msgspec.Meta(ge=0)]
Positive = Annotated[int, msgspec.Meta(ge=1)]

# etcd's ``rdzv_conf`` keys, torch's spellings included, as RendezvousSpec names them.
_ETCD_CONF = {
    "join_timeout": "join_timeout",
    "timeout": "join_timeout",
    "last_call_timeout": "last_call",
    "last_call": "last_call",
    "lease_ttl": "lease_ttl",
}


class OptionsError(ValueError):
    """``field`` (as :class:`RunOptions` names it) cannot be honoured; ``message`` says why."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class RunOptions(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One group run in the foreground: torchrun's flags, ``LaunchConfig``'s fields, ours."""

    script: str | None = None
    """The program, script or module to run (None: nothing given yet)."""
    script_args: list[str] = []
    no_python: bool = False
    """Run ``script`` as a program, not with the Python interpreter."""
    module: bool = False
    """Run ``script`` as ``python -m``."""
    run_path: bool = False
    nproc_per_node: Positive | Literal["gpu", "cpu", "auto"] = 1
    min_nodes: Positive = 1
    max_nodes: Positive = 1
    node_rank: NonNegative = 0
    master_addr: str = "127.0.0.1"
    master_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] | None = None
    standalone: bool = False
    rdzv_backend: Literal["static", "c10d", "etcd", "etcd-v2", "etcd-v3"] = "static"
    rdzv_endpoint: str = ""
    run_id: str = "none"
    rdzv_conf: dict[str, str] = {}
    local_addr: str | None = None
    monitor_interval: Annotated[float, msgspec.Meta(gt=0)] = 0.1
    max_restarts: NonNegative = 0
    max_no_progress_restarts: NonNegative = 3
    """Restarts in a row without progress before the run ends "do not requeue" (0: off)."""
    progress_scope: str | None = None
    """The scope whose release is a step (None: any scope's)."""
    node_name: str | None = None
    """etcd: this node's stable name in the job (None: the host name)."""
    quarantine_after: NonNegative = 3
    """etcd: node failures within ``quarantine_window`` that set the node aside (0: off)."""
    quarantine_window: Annotated[float, msgspec.Meta(gt=0)] = 60.0
    """Minutes."""
    replace_stragglers_after: Annotated[float, msgspec.Meta(gt=0)] | None = None
    """etcd: seconds one of this node's ranks stays named a straggler before the node steps
    aside for a waiting standby (None: off)."""
    role: str = "default"
    start_method: str = "spawn"
    log_dir: str | None = None
    logs_specs: str | None = None
    """A ``torchrun.logs_specs`` entry point's name (None and ``default``: our layout)."""
    redirects: str = "0"
    tee: str = "0"
    local_ranks_filter: list[NonNegative] | None = None
    duplicate_stdout_filters: list[str] = []
    duplicate_stderr_filters: list[str] = []
    log_line_prefix_template: str | None = None
    virtual_local_rank: bool = False
    numa_binding: AffinityMode | None = None
    shutdown_timeout: Annotated[float, msgspec.Meta(ge=0)] | None = None
    """None: ``$TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else 30 s."""
    signals_to_handle: str = DEFAULT_SIGNALS
    exit_barrier_timeout: Annotated[float, msgspec.Meta(gt=0)] | None = None
    """Multi-node: how long a finished node waits for the others (None: the group's default)."""
    uninterruptible_state_timeout: Annotated[float, msgspec.Meta(gt=0)] | None = None
    gpu_release_timeout: Annotated[float, msgspec.Meta(ge=0)] | None = None
    """None: the group's default (30 s)."""
    idle_timeout: Annotated[float, msgspec.Meta(gt=0)] | None = None
    job_key: str | None = None
    deadlines: list[DeadlineRule] = []
    faults: list[Fault] = []
    fault_injection: bool = False
    """Allow drills on the run (``watchdogctl inject``); ``faults`` allow them too."""
    prewarm: list[str] = []
    flight_recorder: bool = False
    event_log_handler: str = "null"
    event_log: str | None = None
    metrics_listen: str | None = None
    """``PORT`` or ``HOST:PORT``: the run's ``/metrics`` and ``/healthz`` (None: none)."""
    trace: str | None = None
    """At exit, write the run's timeline as a Chrome trace here (the command line's)."""
    log_level: Literal["debug", "info", "warning", "error"] | None = None
    """How much of watchdogd's own log is shown, never the workers' output (None: the
    command line's ``info``; the launch API leaves the caller's logging as it is)."""
    straggler_window: int | None = None
    straggler_publish_interval: float | None = None
    process_containment: Literal["auto", "session"] | None = None
    """None: the config's (``auto``)."""
    worker_memory_max: int | str | None = None
    """Each worker's memory cap: bytes, or a size such as ``50M`` (K, M, G, T: powers of
    1024, as the kernel reads them); None: no cap."""

    def __post_init__(self) -> None:
        # Raised as "field: message" so that run_options() can tell the field.
        if self.min_nodes > self.max_nodes:
            raise ValueError(f"min_nodes: {self.min_nodes} is above max_nodes {self.max_nodes}")
        handled_signals(self.signals_to_handle)
        if self.worker_memory_max is not None:
            memory_bytes(self.worker_memory_max)
        if self.no_python and self.module and not self.run_path:  # torchrun's check, its words
            raise ValueError(
                "module: Don't use both the '--no-python' flag and the '--module' flag "
                "at the same time."
            )


def _located(error: msgspec.ValidationError) -> tuple[str, list[str]]:
    """msgspec's message, and the names on its path (``$.a[0].b``: a, b; none: [])."""
    message, at, path = str(error).partition(" - at `$.")
    return message, [part.split("[")[0] for part in path.rstrip("`").split(".")] if at else []


def run_options(fields: Mapping[str, Any]) -> RunOptions:
    """``fields`` (strings are read as the field's type: ``"3"`` is 3) as checked options."""
    try:
        return msgspec.convert(fields, RunOptions, strict=False)
    except msgspec.ValidationError as e:
        text, names = _located(e)
        if names:
            raise OptionsError(names[0], text) from None
        field, _, message = text.partition(": ")
        if field in RunOptions.__struct_fields__:
            raise OptionsError(field, message) from None
        raise OptionsError("options", text) from None


def parse_nnodes(value: str) -> tuple[int, int]:
    """torchrun's ``--nnodes``: ``N`` or ``MIN:MAX``, as (min, max)."""
    low, _, high = value.partition(":")
    if not low.isdigit() or (high and not high.isdigit()):
        raise OptionsError("min_nodes", f"{value!r}: expected N or MIN:MAX")
    return int(low), int(high or low)


def handled_signals(value: str) -> list[signal.Signals]:
    """``signals_to_handle``: signal names, as torchrun reads them (``SIGTERM,SIGUSR1``)."""
    chosen: list[signal.Signals] = []
    for name in filter(None, (item.strip() for item in value.split(","))):
        try:
            signum = signal.Signals[name]
        except KeyError:
            raise OptionsError("signals_to_handle", f"{name!r} is not a signal name") from None
        if signum in (signal.SIGKILL, signal.SIGSTOP):
            raise OptionsError("signals_to_handle", f"{name} cannot be handled")
        chosen.append(signum)
    return chosen


_SIZE = re.compile(r"(\d+)([KMGT]?)", re.IGNORECASE)


def memory_bytes(size: int | str) -> int:
    """``size`` (``52428800``, ``"50M"``) in bytes, as ``memory.max`` reads it."""
    match = _SIZE.fullmatch(str(size).strip())
    if match is None:
        raise OptionsError("worker_memory_max", f"{size!r}: expected bytes or a size like 50M")
    return int(match[1]) << (10 * " KMGT".index(match[2].upper() or " "))


def default_shutdown_timeout(environ: Mapping[str, str]) -> float:
    """torch's ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, else torch's 30 s."""
    value = environ.get(SHUTDOWN_TIMEOUT_ENV)
    if value is None:
        return DEFAULT_SHUTDOWN_TIMEOUT
    try:
        return float(value)
    except ValueError:
        raise OptionsError(
            "shutdown_timeout", f"{SHUTDOWN_TIMEOUT_ENV}={value!r} is not a number"
        ) from None


@dataclass(frozen=True)
class Host:
    """What the machine contributes to a group spec (``foreground.this_host()``)."""

    environ: Mapping[str, str]
    gpus: list[str] | None
    """The visible GPUs (None: no driver, nothing said)."""
    cpus: int
    executable: str
    """The Python interpreter a script runs with, unless ``$PYTHON_EXEC`` says otherwise."""
    make_log_dir: Callable[[str | None, str], str]
    """A new directory for one run's logs, as torch's ``DefaultLogsSpecs`` makes it:
    ``<run id>_<random>`` in the directory given (a temporary one for None), so a
    ``--log-dir`` used again never mixes two runs' files."""


def _nproc(options: RunOptions, host: Host) -> int:
    value = options.nproc_per_node
    if isinstance(value, int):
        return value
    if value == "gpu":
        if not host.gpus:
            raise OptionsError("nproc_per_node", "gpu: no GPU is visible")
        return len(host.gpus)
    if value == "cpu":
        return host.cpus
    return len(host.gpus) if host.gpus else host.cpus  # auto


def _entrypoint(options: RunOptions, host: Host) -> list[str]:
    if options.script is None:
        raise OptionsError("script", "nothing to run")
    if options.no_python:
        return [options.script, *options.script_args]
    python = host.environ.get("PYTHON_EXEC", host.executable)  # torchrun's choice
    if options.module:
        return [python, "-u", "-m", options.script, *options.script_args]
    return [python, "-u", options.script, *options.script_args]


def unread_rdzv_conf(options: RunOptions) -> list[str]:
    """``rdzv_conf`` keys torch's c10d backend does not read (c10d drops them; say so)."""
    if options.rdzv_backend != "c10d" or options.standalone:
        return []
    return [key for key in options.rdzv_conf if key not in C10dConf.__struct_fields__]


def _c10d_conf(options: RunOptions) -> C10dConf:
    unread = unread_rdzv_conf(options)
    read = {key: value for key, value in options.rdzv_conf.items() if key not in unread}
    try:
        return msgspec.convert(read, C10dConf, strict=False)  # "5" is 5, "true" is True
    except msgspec.ValidationError as e:
        message, names = _located(e)
        raise OptionsError("rdzv_conf", ": ".join([*names, message])) from None


def _etcd_conf(options: RunOptions) -> dict[str, float]:
    conf = {}
    for key, value in options.rdzv_conf.items():
        if key not in _ETCD_CONF:
            raise OptionsError("rdzv_conf", f"{key!r}: known keys are {', '.join(_ETCD_CONF)}")
        try:
            conf[_ETCD_CONF[key]] = float(value)
        except ValueError:
            raise OptionsError("rdzv_conf", f"{key}={value!r} is not a number") from None
    return conf


def _rendezvous(options: RunOptions, host: Host) -> dict[str, object]:
    """The rendezvous fields, ``nnodes`` and friends, as a RendezvousSpec table."""
    # torchrun's --standalone is c10d on a store of its own; one node needs no
    # store to meet on: static, on a free port (its own store, as torchrun's).
    backend = "static" if options.standalone else options.rdzv_backend
    python = host.environ.get("PYTHON_EXEC")
    shared = {
        "nnodes": options.max_nodes,
        "min_nodes": options.min_nodes,
        "run_id": options.run_id,
        "advertise_addr": options.local_addr,
    }
    endpoint = options.rdzv_endpoint
    if backend == "c10d":
        return {
            **shared,
            "backend": "c10d",
            "endpoints": [endpoint] if endpoint else [],
            "c10d": _c10d_conf(options),
            "monitor_interval": options.monitor_interval,
            "python": python,
        }
    if backend != "static":  # etcd, whichever version torch's name says
        if not endpoint:
            raise OptionsError("rdzv_endpoint", "the etcd backend needs HOST:PORT[,HOST:PORT…]")
        return {**shared, "backend": "etcd", "endpoints": endpoint.split(","),
                "node_name": options.node_name, **_etcd_conf(options)}  # fmt: skip
    if options.min_nodes != options.max_nodes:
        raise OptionsError("min_nodes", "the static backend needs a fixed node count")
    master_addr, master_port = options.master_addr, options.master_port
    if endpoint and not options.standalone:
        host_name, _, port = endpoint.rpartition(":")
        if port and not port.isdigit():
            raise OptionsError("rdzv_endpoint", f"{endpoint!r}: expected HOST[:PORT]")
        master_addr, master_port = host_name or endpoint, int(port) if port else master_port
    return {
        "nnodes": options.max_nodes,
        "node_rank": options.node_rank,
        "master_addr": master_addr,
        "master_port": master_port,
        "run_id": options.run_id,
        "python": python,
    }


# GroupSpec's (and its RendezvousSpec's) names for options named otherwise.
_OPTION_OF = {
    "name": "role",
    "nproc": "nproc_per_node",
    "entrypoint": "script",
    "nnodes": "max_nodes",
    "endpoints": "rdzv_endpoint",
    "advertise_addr": "local_addr",
    "c10d": "rdzv_conf",
}


def _spec_error(error: msgspec.ValidationError) -> ValueError:
    """A GroupSpec's complaint about one of its fields, as the option's."""
    message, names = _located(error)
    if names in ([], ["rendezvous"]):  # a rule across fields: the message names them
        return ValueError(message)
    name = names[-1] if names[0] == "rendezvous" else names[0]
    return OptionsError(_OPTION_OF.get(name, name), message)


def group_spec(options: RunOptions, host: Host) -> GroupSpec:
    """The group torchrun would launch for ``options`` on ``host``; ValueError names a field."""
    nproc = _nproc(options, host)
    # torchrun's agent exports this, so a launcher nested in a worker handles the same.
    env = {"TORCHELASTIC_SIGNALS_TO_HANDLE": options.signals_to_handle}
    if nproc > 1 and "OMP_NUM_THREADS" not in host.environ:
        env["OMP_NUM_THREADS"] = "1"  # torchrun's default, so workers don't oversubscribe
    logs_specs = None if options.logs_specs == "default" else options.logs_specs
    filters = options.duplicate_stdout_filters or options.duplicate_stderr_filters
    writes_files = options.redirects != "0" or options.tee != "0" or filters
    log_dir = options.log_dir
    if logs_specs is None and (log_dir is not None or writes_files):
        log_dir = host.make_log_dir(log_dir, options.run_id)  # a LogsSpecs makes its own
    shutdown_timeout = options.shutdown_timeout
    if shutdown_timeout is None:
        shutdown_timeout = default_shutdown_timeout(host.environ)
    table = {
        "name": options.role,
        "entrypoint": _entrypoint(options, host),
        "nproc": nproc,
        "max_restarts": options.max_restarts,
        "max_no_progress_restarts": options.max_no_progress_restarts,
        "progress_scope": options.progress_scope,
        "quarantine_after": options.quarantine_after,
        "quarantine_window": options.quarantine_window * 60,
        "replace_stragglers_after": options.replace_stragglers_after,
        "role": options.role,
        "env": env,
        "log_dir": log_dir,
        "logs_specs": logs_specs,
        "redirects": options.redirects,
        "tee": options.tee,
        "local_ranks_filter": options.local_ranks_filter,
        "log_line_prefix_template": options.log_line_prefix_template,
        "virtual_local_rank": options.virtual_local_rank,
        "numa_binding": options.numa_binding,
        "shutdown_timeout": shutdown_timeout,
        "uninterruptible_state_timeout": options.uninterruptible_state_timeout,
        "duplicate_stdout_filters": options.duplicate_stdout_filters,
        "duplicate_stderr_filters": options.duplicate_stderr_filters,
        "prewarm": options.prewarm,
        "flight_recorder": options.flight_recorder,
        "idle_timeout": options.idle_timeout,
        "job_key": options.job_key,
        "deadlines": options.deadlines,
        "faults": options.faults,
        "rendezvous": _rendezvous(options, host),
    }
    for optional in ("exit_barrier_timeout", "gpu_release_timeout"):
        if (value := getattr(options, optional)) is not None:
            table[optional] = value
    if options.worker_memory_max is not None:
        table["worker_memory_max"] = memory_bytes(options.worker_memory_max)
    try:
        spec = msgspec.convert(table, GroupSpec)
    except msgspec.ValidationError as e:
        raise _spec_error(e) from None
    return apply_env_knobs(spec, host.environ)


def daemon_config(options: RunOptions, config: Config) -> Config:
    """``config`` with what ``options`` ask of the run's daemon laid over it, checked
    as a config file's keys are (OptionsError names the option)."""
    given: dict[str, object] = {
        key: value
        for key, value in (
            ("event_log", options.event_log),
            ("metrics_listen", options.metrics_listen),
            ("straggler_window", options.straggler_window),
            ("straggler_publish_interval", options.straggler_publish_interval),
            ("process_containment", options.process_containment),
        )
        if value is not None
    }
    if options.event_log_handler != "null":
        given["event_log_handler"] = options.event_log_handler
    if options.faults or options.fault_injection:  # the operator's consent to drills
        given["fault_injection"] = True
    try:
        return override(config, _OVERRIDES, **given) if given else config
    except ConfigError as e:  # "run options: KEY: why", and each key here is the option's name
        key, _, message = str(e).removeprefix(f"{_OVERRIDES}: ").partition(": ")
        if key in given:
            raise OptionsError(key, message) from None
        raise
