"""torch's local elastic agent, in its shape, over watchdogd's group runner.

For code written against ``torch.distributed.elastic.agent``:
:class:`WorkerSpec`, :class:`LocalElasticAgent` and ``.run()`` returning a
:class:`RunResult`, with torch 2.13's names and fields. The run itself is
:mod:`watchdogd.launcher`'s (the same runner as ``watchdogd run``).

Differences from torch's:

- ``WorkerSpec.rdzv_handler`` is optional (None: this node alone). It is
  what :func:`get_rendezvous_handler` returns for torch's
  ``RendezvousParameters`` (c10d, etcd or static), or one of torch's own
  handlers for a single node (more nodes: use ours, which watchdogd drives
  itself);
- ``LocalElasticAgent(spec, logs_specs=None, …, log_dir=None)``: torch
  requires ``logs_specs``; None here is torch's ``DefaultLogsSpecs()``, or
  ``DefaultLogsSpecs(log_dir=log_dir)``. A start-method name in the
  ``logs_specs`` slot, as torch's documentation writes
  ``LocalElasticAgent(spec, start_method)``, is taken as the start method
  (torch 2.13 crashes on it);
- ``health_check_server`` must be None (watchdogd serves ``/healthz`` on
  ``TORCHELASTIC_HEALTH_CHECK_PORT`` itself);
- ``run()`` raises :class:`~watchdogd.launcher.LaunchError` when the group
  cannot run at all, where torch raises the rendezvous' own error.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from watchdogd.groups.starters import START_METHODS
from watchdogd.launcher import (
    DefaultLogsSpecs,
    LaunchConfig,
    LaunchError,
    Std,
    process_failures,
    run_launch,
)
from watchdogd_client.groups import GroupState

__all__ = [
    "DefaultLogsSpecs",
    "LocalElasticAgent",
    "RendezvousHandler",
    "RendezvousParameters",
    "RunResult",
    "Std",
    "WorkerSpec",
    "WorkerState",
    "get_rendezvous_handler",
]


class WorkerState(enum.StrEnum):
    """torch's ``WorkerState``."""

    UNKNOWN = "UNKNOWN"
    INIT = "INIT"
    HEALTHY = "HEALTHY"
    UNHEALTHY = "UNHEALTHY"
    STOPPED = "STOPPED"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"


class RendezvousParameters:
    """torch's ``RendezvousParameters``: which rendezvous, and its settings (``**kwargs``)."""

    def __init__(
        self,
        backend: str,
        endpoint: str,
        run_id: str,
        min_nodes: int,
        max_nodes: int,
        local_addr: str | None = None,
        **kwargs: Any,
    ) -> None:
        if not backend:
            raise ValueError("The rendezvous backend name must be a non-empty string.")
        if min_nodes < 1 or max_nodes < min_nodes:
            raise ValueError(f"min_nodes {min_nodes}, max_nodes {max_nodes}: need 1 <= min <= max")
        self.backend = backend
        self.endpoint = endpoint
        self.run_id = run_id
        self.min_nodes = min_nodes
        self.max_nodes = max_nodes
        self.local_addr = local_addr
        self.config = kwargs


class RendezvousHandler:
    """A rendezvous watchdogd joins for the agent (:func:`get_rendezvous_handler`)."""

    def __init__(self, params: RendezvousParameters) -> None:
        self.params = params

    def get_backend(self) -> str:
        return self.params.backend

    def get_run_id(self) -> str:
        return self.params.run_id


def get_rendezvous_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torch's registry call: the handler for ``params``."""
    return RendezvousHandler(params)


@dataclass
class WorkerSpec:
    """torch's ``WorkerSpec``; ``rdzv_handler`` may be None (this node alone)."""

    role: str
    local_world_size: int
    rdzv_handler: Any = None
    fn: Callable[..., Any] | None = None
    entrypoint: Callable[..., Any] | str | None = None
    args: tuple[Any, ...] = ()
    max_restarts: int = 3
    monitor_interval: float = 0.1
    master_port: int | None = None
    master_addr: str | None = None
    local_addr: str | None = None
    event_log_handler: str = "null"
    numa_options: Any = None
    duplicate_stdout_filters: list[str] | None = None
    duplicate_stderr_filters: list[str] | None = None
    virtual_local_rank: bool = False

    def __post_init__(self) -> None:
        if self.local_world_size <= 0:
            raise ValueError(f"local_world_size must be positive, got {self.local_world_size}")
        if self.monitor_interval <= 0:
            raise ValueError(f"monitor_interval must be positive, got {self.monitor_interval}")
        if self.fn is not None:
            self.entrypoint = self.fn  # torch's deprecated alias
        if not self.entrypoint:
            raise ValueError("entrypoint (or fn): a callable or a program")

    def get_entrypoint_name(self) -> str:
        """As torch names it: a program's base name, a callable's ``__name__``."""
        if isinstance(self.entrypoint, str):
            return os.path.basename(self.entrypoint)
        return getattr(self.entrypoint, "__name__", repr(self.entrypoint))


@dataclass
class RunResult:
    """torch's ``RunResult``: ``return_values`` and ``failures`` by global rank."""

    state: WorkerState
    return_values: dict[int, Any] = field(default_factory=dict)
    failures: dict[int, Any] = field(default_factory=dict)

    def is_failed(self) -> bool:
        return self.state == WorkerState.FAILED


def _rendezvous(handler: Any, local_addr: str | None) -> dict[str, Any]:
    """The ``LaunchConfig`` fields of the rendezvous ``handler`` stands for."""
    if handler is None:
        return {"min_nodes": 1, "max_nodes": 1, "local_addr": local_addr}
    if isinstance(handler, RendezvousHandler):
        params = handler.params
        return {
            "min_nodes": params.min_nodes,
            "max_nodes": params.max_nodes,
            "rdzv_backend": params.backend,
            "rdzv_endpoint": params.endpoint,
            "run_id": params.run_id,
            "local_addr": params.local_addr or local_addr,
            "rdzv_configs": dict(params.config),
        }
    # One of torch's handlers: its node count, where it says it (dynamic: settings; static).
    settings = getattr(handler, "settings", None)
    nodes = getattr(settings, "max_nodes", None) or getattr(handler, "world_size", None)
    if nodes == 1:
        run_id = handler.get_run_id() if hasattr(handler, "get_run_id") else ""
        return {"min_nodes": 1, "max_nodes": 1, "run_id": run_id, "local_addr": local_addr}
    raise ValueError(
        f"rdzv_handler: torch's {type(handler).__name__} for more than one node cannot be "
        "joined from here; pass watchdogd.agent.get_rendezvous_handler("
        "RendezvousParameters(...)) with the same parameters"
    )


class LocalElasticAgent:
    """torch's ``LocalElasticAgent``: ``run()`` supervises the spec's workers on this node."""

    def __init__(
        self,
        spec: WorkerSpec,
        logs_specs: Any = None,
        start_method: str = "spawn",
        exit_barrier_timeout: float = 300,
        log_line_prefix_template: str | None = None,
        shutdown_timeout: int = 30,
        health_check_server: Any = None,
        uninterruptible_state_timeout: float | None = None,
        log_dir: str | None = None,
    ) -> None:
        if isinstance(logs_specs, str) and logs_specs in START_METHODS:
            logs_specs, start_method = None, logs_specs  # LocalElasticAgent(spec, "fork")
        if health_check_server is not None:
            raise ValueError(
                "health_check_server: watchdogd serves /healthz on "
                "TORCHELASTIC_HEALTH_CHECK_PORT itself; pass None"
            )
        if logs_specs is None and log_dir is not None:
            logs_specs = DefaultLogsSpecs(log_dir=log_dir)
        self._spec = spec
        self._logs_specs = logs_specs
        self._start_method = start_method
        self._exit_barrier_timeout = exit_barrier_timeout
        self._log_line_prefix_template = log_line_prefix_template
        self._shutdown_timeout = shutdown_timeout
        self._uninterruptible_state_timeout = uninterruptible_state_timeout

    def run(self, role: str = "default") -> RunResult:
        """Run the workers to the end: restarts, kills and failures as torch's agent has them."""
        spec = self._spec
        config = LaunchConfig(
            nproc_per_node=spec.local_world_size,
            logs_specs=self._logs_specs,
            role=spec.role,
            max_restarts=spec.max_restarts,
            monitor_interval=spec.monitor_interval,
            start_method=self._start_method,
            log_line_prefix_template=self._log_line_prefix_template,
            event_log_handler=spec.event_log_handler,
            numa_options=spec.numa_options,
            duplicate_stdout_filters=spec.duplicate_stdout_filters,
            duplicate_stderr_filters=spec.duplicate_stderr_filters,
            virtual_local_rank=spec.virtual_local_rank,
            shutdown_timeout=self._shutdown_timeout,
            **_rendezvous(spec.rdzv_handler, spec.local_addr),
        )
        master = {"master_addr": spec.master_addr, "master_port": spec.master_port}
        result = run_launch(
            config,
            spec.entrypoint,
            list(spec.args),
            exit_barrier_timeout=self._exit_barrier_timeout,
            uninterruptible_state_timeout=self._uninterruptible_state_timeout,
            **{key: value for key, value in master.items() if value is not None},
        )
        if result.state is GroupState.SUCCEEDED:
            return RunResult(WorkerState.SUCCEEDED, return_values=result.values)
        if not result.failures:
            raise LaunchError(result.reason or f"group {result.state.value}")
        # An UNHEALTHY group (D state, a GPU fault) failed too: torch's agent says FAILED.
        return RunResult(WorkerState.FAILED, failures=process_failures(result.failures))
