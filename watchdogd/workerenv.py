"""What each worker gets: torchrun's environment contract, GPUs, stream routing. Pure.

Every worker of attempt ``n`` sees torchrun's variables (``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``TORCHELASTIC_*``, …), plus
``TORCHELASTIC_TIMER_FILE`` and ``WATCHDOGD_SOCKET`` so that an unmodified
trainer's ``expires()`` reaches the daemon that supervises it.
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from pathlib import Path

import msgspec

from watchdogd_client.groups import GroupSpec

__all__ = [
    "Placement",
    "StreamRoutes",
    "attempt_dir",
    "gpu_assignment",
    "log_prefix",
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


class StreamRoutes(msgspec.Struct, frozen=True):
    """Per stream: write to a file, and copy to the console with a prefix."""

    stdout_file: bool
    stderr_file: bool
    stdout_tee: bool
    stderr_tee: bool


def gpu_assignment(spec: GroupSpec, visible: list[str] | None) -> dict[int, str | None]:
    """``CUDA_VISIBLE_DEVICES`` per local rank (None: leave it alone).

    ``visible`` is what the daemon itself sees (its ``CUDA_VISIBLE_DEVICES``
    or the driver's device list), used for ``gpus = "all"``.
    """
    if spec.gpus is None:
        devices = visible if spec.virtual_local_rank and visible is not None else None
    elif spec.gpus == "all":
        if visible is None:
            raise ValueError("gpus = 'all' but no GPU is visible to the daemon")
        devices = visible
    else:
        devices = [str(d) for d in spec.gpus]
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


def _selector(value: str, nproc: int) -> dict[int, int]:
    if ":" not in value:
        return dict.fromkeys(range(nproc), int(value))
    chosen = dict.fromkeys(range(nproc), 0)
    for item in value.split(","):
        rank, _, streams = item.partition(":")
        chosen[int(rank)] = int(streams)
    return chosen


def stream_routes(spec: GroupSpec) -> dict[int, StreamRoutes]:
    """torchrun's ``--redirects``/``--tee`` (1 stdout, 2 stderr, 3 both) per local rank."""
    redirects = _selector(spec.redirects, spec.nproc)
    tee = _selector(spec.tee, spec.nproc)
    shown = set(spec.local_ranks_filter) if spec.local_ranks_filter is not None else None
    routes = {}
    for rank in range(spec.nproc):
        to_file = redirects[rank] | tee[rank]
        to_console = tee[rank] if shown is None or rank in shown else 0
        routes[rank] = StreamRoutes(
            stdout_file=bool(to_file & 1),
            stderr_file=bool(to_file & 2),
            stdout_tee=bool(to_console & 1),
            stderr_tee=bool(to_console & 2),
        )
    return routes


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
    attempt: int,
    *,
    base: Mapping[str, str],
    cuda_visible: str | None,
    socket_path: str,
    fifo_path: str,
) -> dict[str, str]:
    """The full environment of one worker: ``base`` (the daemon's), the spec's, torchrun's."""
    rank = placement.group_rank * spec.nproc + local_rank
    world_size = placement.group_world_size * spec.nproc
    env = {**base, **spec.env}
    env.update(
        {
            "LOCAL_RANK": "0" if spec.virtual_local_rank else str(local_rank),
            "RANK": str(rank),
            "GROUP_RANK": str(placement.group_rank),
            "GROUP_WORLD_SIZE": str(placement.group_world_size),
            "ROLE_RANK": str(rank),
            "ROLE_WORLD_SIZE": str(world_size),
            "ROLE_NAME": spec.role,
            "LOCAL_WORLD_SIZE": str(spec.nproc),
            "WORLD_SIZE": str(world_size),
            "MASTER_ADDR": placement.master_addr,
            "MASTER_PORT": str(placement.master_port),
            "TORCHELASTIC_RUN_ID": placement.run_id,
            "TORCHELASTIC_RESTART_COUNT": str(restart_count),
            "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": base.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            "TORCHELASTIC_TIMER_FILE": fifo_path,
            "WATCHDOGD_SOCKET": socket_path,
            "PYTHONUNBUFFERED": env.get("PYTHONUNBUFFERED", "1"),
        }
    )
    directory = attempt_dir(spec, attempt)
    if directory is not None:
        env["TORCHELASTIC_ERROR_FILE"] = str(directory / str(local_rank) / "error.json")
    if cuda_visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible
    return env
