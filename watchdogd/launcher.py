"""torch's launch API over watchdogd's group runner: ``elastic_launch(config, entrypoint)(*args)``.

The shapes are ``torch.distributed.launcher.api``'s: :class:`LaunchConfig`
with torch 2.13's fields and defaults, :class:`elastic_launch` and
:func:`launch_agent`. ``entrypoint`` is a callable (each worker runs
``entrypoint(*args)``; the call returns ``{global_rank: return_value}`` for
this node's ranks), or a program (a path or a name on ``PATH``, run as
``[entrypoint, *args]``; the values are ``None``). ``${local_rank}`` in a
string argument becomes the worker's local rank.

Underneath is the group runner of ``watchdogd run``: torchrun's environment,
timers and their kills, stack dumps, restarts, D-state, rendezvous and
events. Its loop runs in a thread of its own, so a caller's event loop is
never nested, and the call blocks until the job ends, as torch's does
(:func:`launch_agent_async` waits without blocking the caller's loop). A
callable's workers are started by ``multiprocessing`` in this process
(``spawn``, torch's default, or ``forkserver``), so the caller's functions
and arguments — a ``multiprocessing`` queue among them — reach them; they
run as the caller, with the caller's environment plus torchrun's variables.

Past ``max_restarts`` the call raises torch's own ``ChildFailedError`` when
torch is importable (``except ChildFailedError`` and ``@record`` see what
they expect), else :class:`ChildFailedError` of the same shape from here.
A run that ended because its restarts made no progress, or whose every
attempt failed the same way before any step (a bad program), raises
``NoProgressError`` (:mod:`watchdogd.launch_failures`), a subclass of that
``ChildFailedError``: code that catches torch's error keeps working, and
code that must not requeue catches this one first. Its ``reason`` names
each rank's failure and how often; ``exit_code`` is the command line's (93).
Run options beyond ``LaunchConfig``'s fields (``max_no_progress_restarts``,
``progress_scope``, ``prewarm``, …) are keywords of :class:`elastic_launch`
and :func:`launch_agent`.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial
from multiprocessing import reduction
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread

from watchdogd.core.config import Config, ConfigError
from watchdogd.core.ports import GroupError
from watchdogd.core.run_options import (
    DEFAULT_RDZV_TIMEOUT,
    DEFAULT_SIGNALS,
    OptionsError,
    RunOptions,
    daemon_config,
    default_shutdown_timeout,
    group_spec,
    handled_signals,
    run_options,
    unread_rdzv_conf,
)
from watchdogd.foreground import check_entrypoint, run_group, this_host
from watchdogd.groups.starters import CallableStarter
from watchdogd.launch_failures import (
    ChildFailedError,
    ProcessFailure,
    child_failed,
    no_progress_error_type,
    process_failures,
)
from watchdogd_client.groups import Failure, GroupSpec, GroupState

__all__ = [
    "ChildFailedError",
    "DefaultLogsSpecs",
    "LaunchConfig",
    "LaunchError",
    "NoProgressError",  # noqa: F822 - made on first use (module __getattr__)
    "ProcessFailure",
    "Result",
    "Std",
    "child_failed",
    "elastic_launch",
    "launch_agent",
    "launch_agent_async",
    "launch_options",
    "process_failures",
    "run_launch",
]

log = logging.getLogger("watchdogd.launcher")


@dataclass
class LaunchConfig:
    """torch 2.13's ``LaunchConfig``: the same fields, defaults and ``__post_init__``.

    Differences: ``logs_specs`` may be None or torch's ``DefaultLogsSpecs``
    (its ``log_dir``, ``redirects``, ``tee`` and ``local_ranks_filter`` are
    honoured; None is torch's ``DefaultLogsSpecs()``: streams on the console);
    ``metrics_cfg`` must stay empty; ``numa_options`` is not set for you when
    CUDA is available (watchdogd never imports torch for it: set it, or
    leave it None for no binding); ``shutdown_timeout`` may be a fraction.
    """

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    logs_specs: Any = None
    run_id: str = ""
    role: str = "default_role"
    rdzv_endpoint: str = ""
    rdzv_backend: str = "etcd"
    rdzv_configs: dict[str, Any] = field(default_factory=dict)
    rdzv_timeout: int = -1
    max_restarts: int = 3
    monitor_interval: float = 0.1
    start_method: str = "spawn"
    log_line_prefix_template: str | None = None
    metrics_cfg: dict[str, str] = field(default_factory=dict)
    local_addr: str | None = None
    event_log_handler: str = "null"
    numa_options: Any = None
    signals_to_handle: str = DEFAULT_SIGNALS
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    virtual_local_rank: bool = False
    shutdown_timeout: float | None = None

    def __post_init__(self) -> None:
        if self.rdzv_timeout != -1:
            self.rdzv_configs["timeout"] = self.rdzv_timeout
        elif "timeout" not in self.rdzv_configs:
            self.rdzv_configs["timeout"] = DEFAULT_RDZV_TIMEOUT
        if self.shutdown_timeout is None:  # torch's LaunchConfig reads it, as torchrun does
            self.shutdown_timeout = default_shutdown_timeout(os.environ)
        elif self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be non-negative, got {self.shutdown_timeout}")


# -- failures ------------------------------------------------------------------------------


class LaunchError(RuntimeError):
    """The group could not run at all (a rendezvous that failed, a worker that cannot start)."""


def __getattr__(name: str) -> Any:
    # Made on first use: whether it subclasses torch's error is known only once torch
    # is looked for, which a plain import of this module must not pay for.
    if name == "NoProgressError":
        return no_progress_error_type()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# -- torch's log settings ---------------------------------------------------------------


class Std(enum.IntFlag):
    """torch's ``Std``: which streams ``redirects`` and ``tee`` take."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


class DefaultLogsSpecs:
    """torch's ``DefaultLogsSpecs``, without torch: where the workers' logs go.

    ``log_dir``: a directory per run in it, ``<run id>_<random>``, as torch's,
    holding per-attempt, per-rank files (``<role>/attempt_<n>/<local rank>/``);
    None: only error files, in a directory of the group's own. ``redirects`` sends
    streams to files only, ``tee`` to files and the console;
    ``local_ranks_filter`` keeps other ranks off the console.
    """

    def __init__(
        self,
        log_dir: str | None = None,
        redirects: Std | dict[int, Std] = Std.NONE,
        tee: Std | dict[int, Std] = Std.NONE,
        local_ranks_filter: set[int] | None = None,
    ) -> None:
        # torch's attribute names: the launcher reads torch's DefaultLogsSpecs by them too.
        self._root_log_dir = log_dir
        self._redirects = redirects
        self._tee = tee
        self._local_ranks_filter = local_ranks_filter

    @property
    def root_log_dir(self) -> str | None:
        return self._root_log_dir


# -- the config as run options ----------------------------------------------------------


def _std(value: Any) -> str:
    """torch's ``Std`` (or a map of local rank to ``Std``) as a ``redirects`` value."""
    if isinstance(value, dict):
        return ",".join(f"{rank}:{int(std)}" for rank, std in sorted(value.items()))
    return str(int(value))


def _logs_options(logs_specs: Any) -> dict[str, object]:
    if logs_specs is None:
        return {}
    kind = type(logs_specs)
    torchs = kind.__name__ == "DefaultLogsSpecs" and kind.__module__.startswith("torch.")
    if not torchs and kind is not DefaultLogsSpecs:
        raise ValueError(
            f"logs_specs: a {kind.__name__} cannot be honoured here, only torch's "
            "DefaultLogsSpecs (its log_dir, redirects, tee, local_ranks_filter) or None"
        )
    # torch's own attributes: DefaultLogsSpecs offers no public accessor for them.
    return {
        "redirects": _std(logs_specs._redirects),
        "tee": _std(logs_specs._tee),
        "log_dir": logs_specs._root_log_dir,
        "local_ranks_filter": sorted(logs_specs._local_ranks_filter or ()) or None,
    }


def _single_node(config: LaunchConfig) -> bool:
    """One node on a store of its own: nobody to meet, so no rendezvous server to run."""
    host = config.rdzv_endpoint.rpartition(":")[0] or config.rdzv_endpoint
    return config.max_nodes == 1 and host in ("", "localhost", "127.0.0.1", "::1")


def _rendezvous_options(config: LaunchConfig) -> dict[str, object]:
    if _single_node(config):
        return {"standalone": True}
    conf = dict(config.rdzv_configs)
    fields: dict[str, object] = {
        "rdzv_backend": config.rdzv_backend,
        "rdzv_endpoint": config.rdzv_endpoint,
    }
    if config.rdzv_backend == "static":
        return {**fields, "node_rank": conf.pop("rank", 0)}
    if config.rdzv_backend == "c10d" and conf.get("timeout") == DEFAULT_RDZV_TIMEOUT:
        del conf["timeout"]  # __post_init__'s, which torch's c10d backend never reads
    return {**fields, "rdzv_conf": {key: str(value) for key, value in conf.items()}}


# Options the config names otherwise (the rest: the same name).
_FIELD_OF = {
    "script": "entrypoint",
    "script_args": "args",
    "rdzv_conf": "rdzv_configs",
    "numa_binding": "numa_options",
    "redirects": "logs_specs",
    "tee": "logs_specs",
    "log_dir": "logs_specs",
    "local_ranks_filter": "logs_specs",
}


def _in_config_words(error: ValueError) -> ValueError:
    if isinstance(error, OptionsError):
        return ValueError(f"{_FIELD_OF.get(error.field, error.field)}: {error.message}")
    return error


def launch_options(config: LaunchConfig, command: list[str], **options: object) -> RunOptions:
    """The run ``config`` asks for, of ``command``; ``options``: fields beyond the config's
    (the agent's ``master_addr``, ``exit_barrier_timeout``, …). No ``PET_*`` variable is
    read. ValueError names a field it cannot honour."""
    if config.metrics_cfg:
        raise ValueError("metrics_cfg: torch's metrics handlers are not supported; use /metrics")
    fields = {
        "script": command[0],
        "script_args": command[1:],
        "no_python": True,
        "min_nodes": config.min_nodes,
        "max_nodes": config.max_nodes,
        "nproc_per_node": config.nproc_per_node,
        "max_restarts": config.max_restarts,
        "role": config.role,
        "run_id": config.run_id,
        "monitor_interval": config.monitor_interval,
        "start_method": config.start_method,
        "local_addr": config.local_addr or None,
        "log_line_prefix_template": config.log_line_prefix_template,
        "event_log_handler": config.event_log_handler,
        "signals_to_handle": config.signals_to_handle,
        "duplicate_stdout_filters": config.duplicate_stdout_filters or [],
        "duplicate_stderr_filters": config.duplicate_stderr_filters or [],
        "virtual_local_rank": config.virtual_local_rank,
        "shutdown_timeout": config.shutdown_timeout,
        **_rendezvous_options(config),
        **_logs_options(config.logs_specs),
        **options,
    }
    if config.numa_options is not None:
        fields["numa_binding"] = config.numa_options.affinity_mode.value
    try:
        return run_options(fields)
    except OptionsError as e:
        raise _in_config_words(e) from None


def _entrypoint_name(entrypoint: Callable[..., Any] | str, args: list[Any]) -> str:
    """As torch's launcher names a job: a callable's ``__name__``; for the Python
    interpreter, its first argument that is no option (the script); else the program."""
    if not isinstance(entrypoint, str):
        return getattr(entrypoint, "__name__", None) or repr(entrypoint)
    if entrypoint == sys.executable:
        return next((str(a) for a in args if not str(a).startswith("-")), "")
    return entrypoint


def _check_callable(entrypoint: Callable[..., Any], start_method: str) -> None:
    """A callable the workers cannot be sent is refused before anything starts."""
    try:
        reduction.ForkingPickler.dumps(entrypoint)
    except Exception as e:
        raise ValueError(
            f"entrypoint {_entrypoint_name(entrypoint, [])!r} cannot be sent to workers started "
            f"with {start_method!r} (it is pickled by reference: define it at the top level "
            f"of an importable module, not as a lambda or a nested function): {e}"
        ) from None


# -- the call ---------------------------------------------------------------------------


@dataclass
class Result:
    """How a launch ended: the group's final state, return values and failures by rank."""

    name: str
    state: GroupState
    values: dict[int, Any]
    failures: list[Failure]
    reason: str | None
    """Why the group could not run, when no worker failed."""
    no_progress: str | None = None
    """Why the run must not be requeued: its restarts made no progress, or it is a bad
    program (None: not so)."""


def launch_agent(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str | None,
    args: list[Any],
    **options: object,
) -> dict[int, Any]:
    """Run the job on this node; ``{global_rank: return_value}`` for its ranks.

    ``options``: run options beyond the config's fields. Raises
    ``ChildFailedError`` past ``max_restarts`` (``NoProgressError`` when its
    restarts made no progress, or it is a bad program), :class:`LaunchError` when the group cannot
    run, ValueError on a config or entrypoint it cannot honour (before
    anything starts).
    """
    result = run_launch(config, entrypoint, args, **options)
    if result.state is GroupState.SUCCEEDED:
        return result.values
    if result.no_progress is not None and result.failures:
        failures = process_failures(result.failures)
        raise no_progress_error_type()(result.name, failures, result.no_progress)
    if result.failures:
        raise child_failed(result.name, result.failures)
    raise LaunchError(result.reason or f"group {result.state.value}")


def run_launch(
    config: LaunchConfig,
    entrypoint: Callable[..., Any] | str | None,
    args: list[Any],
    **options: object,
) -> Result:
    """Run the job on this node to its end; ``options`` are run options beyond the
    config's (the agent's ``master_addr``, ``exit_barrier_timeout``, …)."""
    if entrypoint is None:
        raise ValueError("entrypoint: a callable or a program, not None")
    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
        log.warning("config has no run_id, generated a random run_id: %s", config.run_id)
    name = _entrypoint_name(entrypoint, args)
    if isinstance(entrypoint, str):
        command = [entrypoint, *map(str, args)]
    else:
        command = [f"{entrypoint.__module__}:{getattr(entrypoint, '__qualname__', name)}"]
    run = launch_options(config, command, **options)
    try:
        if isinstance(entrypoint, str):
            check_entrypoint(run)
        spec = group_spec(run, this_host())
    except ValueError as e:
        raise _in_config_words(e) from None
    unread = unread_rdzv_conf(run)
    if unread:
        log.warning("rdzv_configs %s: not read by torch's c10d backend, ignored", unread)
    if isinstance(entrypoint, str):
        return _launch(run, spec, name, None)
    results = Path(tempfile.mkdtemp(prefix="watchdogd-launch-"))
    try:
        try:
            starter = CallableStarter(entrypoint, args, config.start_method, results)
        except GroupError as e:  # a start method it cannot use
            raise ValueError(str(e)) from None
        try:
            _check_callable(entrypoint, config.start_method)
            return _launch(run, spec, name, starter)
        finally:
            starter.close()
    finally:
        shutil.rmtree(results, ignore_errors=True)


def _launch(
    run: RunOptions,
    spec: GroupSpec,
    name: str,
    starter: CallableStarter | None,
) -> Result:
    try:
        config = daemon_config(run, Config())
        with (
            _signals_forwarded(handled_signals(run.signals_to_handle)) as forward,
            _log_level(run.log_level),
        ):
            outcome = run_group(config, spec, starter=starter, on_started=forward)
    except ConfigError as e:  # an event_log_handler that cannot be had
        raise ValueError(str(e)) from None

    if outcome.dumps is not None:
        log.warning("stacks of hung workers in %s", outcome.dumps)
    if outcome.error is not None:
        raise LaunchError(outcome.error)
    runner = outcome.runner
    assert runner is not None and outcome.state is not None
    succeeded = outcome.state is GroupState.SUCCEEDED
    if outcome.signal is not None and not succeeded:  # torch's agent raises SignalException
        received = signal.Signals(outcome.signal).name
        state = outcome.state.value
        raise LaunchError(f"{received} received, passed to the workers; group {state}")
    if not succeeded:
        failure = runner.failures.last
        reason = failure.reason if failure is not None else None
        failures = list(runner.failures.attempt.values())
        if not runner.do_not_requeue:
            return Result(name, outcome.state, {}, failures, reason)
        no_progress = "\n  ".join(runner.do_not_requeue)
        return Result(name, outcome.state, {}, failures, reason, no_progress)
    values: dict[int, Any] = {}
    for worker in runner.workers.values():
        if starter is None:
            values[worker.rank] = None
            continue
        path = starter.result_path(worker.attempt, worker.local_rank)
        try:
            values[worker.rank] = pickle.loads(path.read_bytes())
        except (OSError, pickle.UnpicklingError, EOFError) as e:
            raise LaunchError(f"rank {worker.rank} exited 0 but left no return value: {e}") from e
    return Result(name, outcome.state, values, [], None)


@contextlib.contextmanager
def _log_level(level: str | None) -> Iterator[None]:
    """watchdogd's logger at ``level`` for the run, if one was asked; else the caller's
    logging decides, as it does for torch's launcher."""
    if level is None:
        yield
        return
    logger = logging.getLogger("watchdogd")
    previous = logger.level
    logger.setLevel(level.upper())
    try:
        yield
    finally:
        logger.setLevel(previous)


@contextlib.contextmanager
def _signals_forwarded(
    signals: list[signal.Signals],
) -> Iterator[Callable[[Callable[[int], object]], None]]:
    """Take ``signals`` in the main thread for the group, as torch's agent does.

    The group's loop runs in a thread of its own, where no signal arrives:
    the main thread's handler passes each one on (one that came before the
    loop was up waits for it). From another thread the caller's handlers
    stay as they are.
    """
    pending: list[int] = []
    target: list[Callable[[int], object]] = []

    def handle(signum: int, _frame: object) -> None:
        if not target:
            pending.append(signum)
            return
        with contextlib.suppress(RuntimeError):  # the loop is stopping: nobody to tell
            target[0](signum)

    def connect(signalled: Callable[[int], object]) -> None:
        target.append(signalled)
        while pending:
            signalled(pending.pop(0))

    if threading.current_thread() is not threading.main_thread():
        yield connect
        return
    previous = {signum: signal.signal(signum, handle) for signum in signals}
    try:
        yield connect
    finally:
        target.clear()
        for signum, handler in previous.items():
            signal.signal(signum, handler)


class elastic_launch:  # noqa: N801 - torch's name
    """``elastic_launch(config, entrypoint)(*args)``: :func:`launch_agent`, as torch spells it."""

    def __init__(
        self,
        config: LaunchConfig,
        entrypoint: Callable[..., Any] | str | None,
        **options: object,
    ) -> None:
        """``options``: run options beyond the config's fields (``max_no_progress_restarts``)."""
        self._config = config
        self._entrypoint = entrypoint
        self._options = options

    def __call__(self, *args: Any) -> dict[int, Any]:
        return launch_agent(self._config, self._entrypoint, list(args), **self._options)


async def launch_agent_async(
    config: LaunchConfig, entrypoint: Callable[..., Any] | str | None, *args: Any
) -> dict[int, Any]:
    """:func:`launch_agent` awaited from an event loop, which goes on meanwhile.

    The job runs to its end: cancelling the caller waits for it.
    """
    call = partial(launch_agent, config, entrypoint, list(args))
    return await anyio.to_thread.run_sync(call)
