"""What each worker gets: torchrun's environment contract, GPUs, stream routing. Pure.

Every worker of attempt ``n`` sees torchrun's variables (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``TORCHELASTIC_*``, …), plus
``TORCHELASTIC_TIMER_FILE`` and ``WATCHDOGD_SOCKET`` so that an unmodified
trainer's ``expires()`` reaches the daemon that supervises it.
"""

from __future__ import annotations

import os
import string
from collections.abc import Mapping
from pathlib import Path
from typing import Literal

import msgspec

from watchdogd.core.flight_recorder import flight_recorder_env, trace_server_env
from watchdogd_client.groups import GroupSpec

__all__ = [
    "ATTEMPT_VARIABLES",
    "LogsDest",
    "Placement",
    "PythonCommand",
    "StreamRoute",
    "apply_env_knobs",
    "attempt_dir",
    "gpu_assignment",
    "group_devices",
    "log_prefix",
    "python_command",
    "rank_stable_env",
    "routes_from_logs_dest",
    "stream_routes",
    "worker_env",
]

DEFAULT_PREFIX = "[$role_name$rank]:"


class Placement(msgspec.Struct, frozen=True, kw_only=True):
    """Where this node's workers sit in the job (from rendezvous)."""

    group_rank: int
    group_world_size: int
    master_addr: str
    master_port: int
    run_id: str
    first_rank: int | None = None
    """``RANK`` of local rank 0; None: ``group_rank * nproc`` (every node runs nproc)."""
    world_size: int | None = None
    """``WORLD_SIZE``; None: ``group_world_size * nproc``."""
    role_first_rank: int | None = None
    """``ROLE_RANK`` of local rank 0; None: as ``RANK`` (one role)."""
    role_world_size: int | None = None
    """``ROLE_WORLD_SIZE``; None: as ``WORLD_SIZE``."""
    use_agent_store: bool = False
    """``TORCHELASTIC_USE_AGENT_STORE``: a process outside the ranks serves the
    store on ``MASTER_PORT``, so every rank is its client."""

    def rank(self, local_rank: int, nproc: int) -> int:
        first = self.group_rank * nproc if self.first_rank is None else self.first_rank
        return first + local_rank

    def world(self, nproc: int) -> int:
        return self.group_world_size * nproc if self.world_size is None else self.world_size

    def role_rank(self, local_rank: int, nproc: int) -> int:
        if self.role_first_rank is None:
            return self.rank(local_rank, nproc)
        return self.role_first_rank + local_rank

    def role_world(self, nproc: int) -> int:
        return self.world(nproc) if self.role_world_size is None else self.role_world_size


class StreamRoute(msgspec.Struct, frozen=True):
    """Where one worker stream goes: its log file, the console, a filtered copy."""

    name: Literal["stdout", "stderr"]
    file: str | None
    """The log file it is written to, whole (None: none)."""
    console: Literal["none", "plain", "prefixed"]
    filters: tuple[str, ...] = ()
    filtered_file: str | None = None
    """Where lines matching ``filters`` are copied (None: nowhere)."""

    @property
    def piped(self) -> bool:
        """Through the daemon (a pipe it reads), not straight to a file or the console."""
        return bool(self.filters and self.filtered_file) or self.console == "prefixed"


class LogsDest(msgspec.Struct, frozen=True, kw_only=True):
    """torch's ``LogsDest``: what a ``LogsSpecs`` decided for one attempt, rank by rank.

    A stream's path ``""`` is the console as it is, ``os.devnull`` nowhere; a
    rank in ``tee_*`` also shows that stream on the console, prefixed.
    """

    stdouts: dict[int, str]
    stderrs: dict[int, str]
    tee_stdouts: dict[int, str]
    tee_stderrs: dict[int, str]
    error_files: dict[int, str]
    filtered_stdout: str = ""
    filtered_stderr: str = ""


def _assigned(spec: GroupSpec, visible: list[str] | None) -> list[str] | None:
    if spec.gpus is None:
        return visible if spec.virtual_local_rank and visible is not None else None
    if spec.gpus == "all":
        if visible is None:
            raise ValueError("gpus = 'all' but no GPU is visible to the daemon")
        return visible
    return [str(d) for d in spec.gpus]


def gpu_assignment(spec: GroupSpec, visible: list[str] | None) -> dict[int, str | None]:
    """``CUDA_VISIBLE_DEVICES`` per local rank (None: leave it alone).

    ``visible`` is what the daemon itself sees (its ``CUDA_VISIBLE_DEVICES``
    or the driver's device list), used for ``gpus = "all"``.
    """
    devices = _assigned(spec, visible)
    if devices is None:
        if spec.virtual_local_rank:
            return {rank: str(rank) for rank in range(spec.nproc)}
        return dict.fromkeys(range(spec.nproc))
    if not spec.virtual_local_rank:
        joined = ",".join(devices)
        return dict.fromkeys(range(spec.nproc), joined)
    if spec.nproc > len(devices):
        raise ValueError(
            f"virtual_local_rank gives each worker one GPU, but nproc {spec.nproc} > "
            f"{len(devices)} devices ({','.join(devices)})"
        )
    return {rank: devices[rank] for rank in range(spec.nproc)}


def group_devices(
    spec: GroupSpec, visible: list[str] | None, environ: Mapping[str, str]
) -> list[str] | None:
    """The ``CUDA_VISIBLE_DEVICES`` entries local rank *i* takes entry *i* of (None: every GPU).

    The devices the spec assigns, else the ``CUDA_VISIBLE_DEVICES`` the
    workers inherit (the spec's ``env``, then ``environ``, the daemon's).
    """
    devices = _assigned(spec, visible)
    if devices is not None:
        return devices
    inherited = {**environ, **spec.env}.get("CUDA_VISIBLE_DEVICES")
    return None if inherited is None else [d.strip() for d in inherited.split(",") if d.strip()]


def _selector(value: str, nproc: int) -> dict[int, int]:
    if ":" not in value:
        return dict.fromkeys(range(nproc), int(value))
    chosen = dict.fromkeys(range(nproc), 0)
    for item in value.split(","):
        rank, _, streams = item.partition(":")
        chosen[int(rank)] = int(streams)
    return chosen


def stream_routes(
    spec: GroupSpec, directory: Path | None
) -> dict[int, tuple[StreamRoute, StreamRoute]]:
    """Per local rank, (stdout, stderr) routes, as torchrun reads its flags.

    ``--redirects`` (1 stdout, 2 stderr, 3 both) sends a stream to its log
    file only (``directory/LOCAL_RANK/<stream>.log``); ``--tee`` to the file
    and to the console with a prefix; neither leaves it on the console as
    is. ``local_ranks_filter`` keeps other ranks off the console (not out of
    their files). ``duplicate_*_filters`` copy the matching lines to
    ``filtered_<stream>.log`` beside the rank's logs.
    """
    redirects = _selector(spec.redirects, spec.nproc)
    tee = _selector(spec.tee, spec.nproc)
    shown = set(spec.local_ranks_filter) if spec.local_ranks_filter is not None else None
    filters = _filters(spec)
    routes = {}
    for rank in range(spec.nproc):
        rank_dir = directory / str(rank) if directory is not None else None
        pair = []
        for bit, name in ((1, "stdout"), (2, "stderr")):
            to_file = bool((redirects[rank] | tee[rank]) & bit)
            console: Literal["none", "plain", "prefixed"]
            if shown is not None and rank not in shown:
                console = "none"
            elif tee[rank] & bit:
                console = "prefixed"
            else:
                console = "none" if to_file else "plain"
            file = str(rank_dir / f"{name}.log") if to_file and rank_dir else None
            filtered = str(rank_dir / f"filtered_{name}.log") if rank_dir else None
            pair.append(StreamRoute(name, file, console, filters[name], filtered))  # type: ignore[arg-type]
        routes[rank] = (pair[0], pair[1])
    return routes


def routes_from_logs_dest(
    spec: GroupSpec, dest: LogsDest
) -> dict[int, tuple[StreamRoute, StreamRoute]]:
    """Per local rank, (stdout, stderr) routes where a ``LogsSpecs`` sent them.

    As torch's agent reads a ``LogsDest``: a stream with a path is written
    there, one without stays on the console, and a tee'd one is also shown,
    prefixed. A rank the ``LogsDest`` leaves out keeps its streams on the console.
    """
    filters = _filters(spec)
    routes = {}
    for rank in range(spec.nproc):
        pair = []
        for name, paths, tees, filtered in (
            ("stdout", dest.stdouts, dest.tee_stdouts, dest.filtered_stdout),
            ("stderr", dest.stderrs, dest.tee_stderrs, dest.filtered_stderr),
        ):
            path = paths.get(rank, "")
            console: Literal["none", "plain", "prefixed"]
            if tees.get(rank, os.devnull) != os.devnull:
                console = "prefixed"
            else:
                console = "plain" if path == "" else "none"
            file = path if path not in ("", os.devnull) else None
            pair.append(StreamRoute(name, file, console, filters[name], filtered or None))  # type: ignore[arg-type]
        routes[rank] = (pair[0], pair[1])
    return routes


def _filters(spec: GroupSpec) -> dict[str, tuple[str, ...]]:
    return {
        "stdout": tuple(spec.duplicate_stdout_filters),
        "stderr": tuple(spec.duplicate_stderr_filters),
    }


def apply_env_knobs(spec: GroupSpec, environ: Mapping[str, str]) -> GroupSpec:
    """torch agent's environment knobs, from ``environ`` then the group's own ``env``.

    ``TORCHELASTIC_ENABLE_FILE_TIMER=0`` keeps ``TORCHELASTIC_TIMER_FILE``
    from the workers; ``TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT`` sets
    the D-state timeout and ``TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE`` the
    console prefix (torchrun's only way to set it) when the spec does not.
    """
    knobs = {**environ, **spec.env}
    changes: dict[str, object] = {}
    if knobs.get("TORCHELASTIC_ENABLE_FILE_TIMER", "1").strip() == "0":
        changes["file_timer"] = False
    prefix = knobs.get("TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE")
    if prefix is not None and spec.log_line_prefix_template is None:
        changes["log_line_prefix_template"] = prefix
    d_state = knobs.get("TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT", "").strip()
    if d_state and spec.uninterruptible_state_timeout is None:
        try:
            changes["uninterruptible_state_timeout"] = float(d_state)
        except ValueError:
            raise ValueError(
                f"TORCHELASTIC_UNINTERRUPTIBLE_STATE_TIMEOUT={d_state!r} is not a number"
            ) from None
    return msgspec.structs.replace(spec, **changes) if changes else spec


def log_prefix(spec: GroupSpec, local_rank: int, rank: int, hostname: str) -> str:
    template = spec.log_line_prefix_template or DEFAULT_PREFIX
    return string.Template(template).safe_substitute(
        role_name=spec.role, local_rank=local_rank, rank=rank, hostname=hostname
    )


def attempt_dir(spec: GroupSpec, attempt: int) -> Path | None:
    if spec.log_dir is None:
        return None
    return Path(spec.log_dir) / spec.name / f"attempt_{attempt}"


def worker_env(
    spec: GroupSpec,
    placement: Placement,
    local_rank: int,
    restart_count: int,
    *,
    base: Mapping[str, str],
    cuda_visible: str | None,
    socket_path: str,
    fifo_path: str,
    error_path: Path,
    recorder_dir: Path | None = None,
) -> dict[str, str]:
    """The full environment of one worker: ``base`` (the daemon's), the spec's, torchrun's.

    ``recorder_dir``: where torch's flight recorder puts its pipes, traces and
    sockets (``flight_recorder`` in the spec); None: the variables are left as they are.
    """
    rank = placement.rank(local_rank, spec.nproc)
    world_size = placement.world(spec.nproc)
    env = {**base, **spec.env}
    env.update(
        {
            "LOCAL_RANK": "0" if spec.virtual_local_rank else str(local_rank),
            "RANK": str(rank),
            "GROUP_RANK": str(placement.group_rank),
            "GROUP_WORLD_SIZE": str(placement.group_world_size),
            "ROLE_RANK": str(placement.role_rank(local_rank, spec.nproc)),
            "ROLE_WORLD_SIZE": str(placement.role_world(spec.nproc)),
            "ROLE_NAME": spec.role,
            "LOCAL_WORLD_SIZE": str(spec.nproc),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": placement.master_addr,
            "MASTER_PORT": str(placement.master_port),
            "TORCHELASTIC_RUN_ID": placement.run_id,
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "TORCHELASTIC_USE_AGENT_STORE": str(placement.use_agent_store),
            "TORCHELASTIC_ERROR_FILE": str(error_path),
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "WATCHDOGD_SOCKET": socket_path,
            "PYTHONUNBUFFERED": env.get("PYTHONUNBUFFERED", "1"),
        }
    )
    if spec.file_timer:
        env["TORCHELASTIC_TIMER_FILE"] = fifo_path
    else:
        env.pop("TORCHELASTIC_TIMER_FILE", None)
    if cuda_visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible
    if recorder_dir is not None:
        env.update(flight_recorder_env(str(recorder_dir), env))
        env.update(trace_server_env(str(recorder_dir), rank))
    return env


ATTEMPT_VARIABLES = frozenset(
    {
        "RANK",
        "GROUP_RANK",
        "GROUP_WORLD_SIZE",
        "ROLE_RANK",
        "ROLE_WORLD_SIZE",
        "WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_USE_AGENT_STORE",
        "TORCHELASTIC_ERROR_FILE",
    }
)
"""What each attempt decides anew (rendezvous, restarts): a warm spare learns it last."""


def rank_stable_env(env: Mapping[str, str]) -> dict[str, str]:
    """A worker's environment without what only the attempt knows: a spare starts with it."""
    return {key: value for key, value in env.items() if key not in ATTEMPT_VARIABLES}


# Interpreter options a spare is started with as the worker would be; others change
# how a script is found or run, and are refused rather than half honoured.
_PYTHON_OPTIONS = frozenset({"-u", "-B", "-O", "-OO", "-s", "-E", "-b", "-bb"})


class PythonCommand(msgspec.Struct, frozen=True, kw_only=True):
    """An entrypoint that starts Python on a script or a module."""

    python: str
    options: tuple[str, ...]
    mode: Literal["script", "module"]
    target: str
    args: tuple[str, ...]

    def command_line(self) -> list[str]:
        """The entrypoint it was read from: what a fresh worker's ``ps`` line shows."""
        module = ["-m"] if self.mode == "module" else []
        return [self.python, *self.options, *module, self.target, *self.args]


def python_command(entrypoint: list[str]) -> PythonCommand:
    """``PYTHON [OPTS] SCRIPT ARGS`` or ``PYTHON [OPTS] -m MODULE ARGS``; ValueError otherwise."""
    python, *rest = entrypoint
    if not Path(python).name.startswith("python"):
        raise ValueError(f"{python!r} is not a Python interpreter (SCRIPT or -m MODULE is needed)")
    options = []
    while rest and rest[0].startswith("-") and rest[0] != "-m":
        if rest[0] not in _PYTHON_OPTIONS:
            raise ValueError(
                f"interpreter option {rest[0]!r}: a spare takes only {sorted(_PYTHON_OPTIONS)}"
            )
        options.append(rest.pop(0))
    if rest[:1] == ["-m"] and len(rest) > 1:
        return PythonCommand(
            python=python,
            options=tuple(options),
            mode="module",
            target=rest[1],
            args=tuple(rest[2:]),
        )
    if not rest:
        raise ValueError("no script or -m MODULE after the interpreter")
    return PythonCommand(
        python=python, options=tuple(options), mode="script", target=rest[0], args=tuple(rest[1:])
    )
