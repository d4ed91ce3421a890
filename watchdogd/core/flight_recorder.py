"""torch's flight recorder, seen from outside: where each rank listens, what it writes. Pure.

Rules (torch 2.13, ``ProcessGroupNCCL.hpp`` and ``FlightRecorder.hpp``)
----------------------------------------------------------------------
- A rank listens when ``TORCH_NCCL_DEBUG_INFO_PIPE_FILE`` is set and its
  ring buffer is on (``TORCH_FR_BUFFER_SIZE``, else
  ``TORCH_NCCL_TRACE_BUFFER_SIZE``, > 0; the first that is set wins, as
  measured with the installed torch). It then replaces
  ``<PIPE_FILE><global rank>.pipe`` with a FIFO of its own, opened
  ``O_RDONLY|O_NONBLOCK``, which a monitor thread reads every
  ``TORCH_NCCL_COORD_CHECK_MILSEC`` (1 s): anything read makes it dump.
- The dump goes to ``<prefix><global rank>``, the prefix being
  ``TORCH_FR_DUMP_TEMP_FILE``, else ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``,
  else ``/tmp/nccl_trace_rank_``. It is written in place (truncated, then
  written), so a reader may see it half written.
- The dump is a protocol-2 pickle of plain values only (dicts, lists,
  tuples, strings, numbers, None): ``version``, ``pg_config``,
  ``pg_status``, ``entries`` (one per collective: ``profiling_name``,
  ``state``, ``collective_seq_id``, ``process_group``, sizes, ``frames``…).
  :func:`decode_trace` reads exactly that and refuses any pickle that
  names a class or function, so an untrusted file can build nothing but
  values.
- No other backend listens on that pipe: gloo records its collectives
  in the same ring, but torch only serves it from its worker server
  (``_WorkerServer``, a C++ HTTP server on a Unix socket, so it answers
  while the main thread is blocked in a collective): ``POST
  /handler/fr_trace_json`` answers the trace as JSON, the same dict.
  torch's ``worker_main()`` starts it at ``TORCH_WORKER_SERVER_SOCKET``;
  the client starts another at ``WATCHDOGD_TRACE_SERVER`` for trainers
  that do not enter ``worker_main()`` (two paths: torch's refuses one
  that exists, and would fail a trainer that entered it late).
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Mapping
from datetime import datetime

import msgspec

__all__ = [
    "DEFAULT_TRACE_PREFIX",
    "TRACE_COLUMNS",
    "TRACE_SERVER_VARIABLES",
    "Recorder",
    "TraceError",
    "decode_trace",
    "flight_recorder_env",
    "recorder_paths",
    "summarize_trace",
    "trace_header",
    "trace_rows",
    "trace_server_env",
    "trace_servers",
]

DEFAULT_TRACE_PREFIX = "/tmp/nccl_trace_rank_"
# torch's example size; large enough for the last few hundred steps' collectives.
DEFAULT_BUFFER_SIZE = 2000
# torch's own (worker_main), then the client's: the sockets a rank's trace is served on.
TRACE_SERVER_VARIABLES = ("TORCH_WORKER_SERVER_SOCKET", "WATCHDOGD_TRACE_SERVER")
# sockaddr_un's sun_path holds 108 bytes, its NUL included: a longer path cannot be bound.
_MAX_SOCKET_PATH = 107


class Recorder(msgspec.Struct, frozen=True):
    """One rank's flight recorder: the pipe that makes it dump, the file it dumps to."""

    rank: int
    pid: int
    pipe: str
    trace: str
    uid: int
    """Who must own both files (the worker's uid): a file of anyone else's is not its trace."""
    servers: tuple[str, ...] = ()
    """The Unix sockets of its worker servers, asked in turn when no pipe answers (gloo)."""


class TraceError(ValueError):
    """The bytes are not a flight-recorder trace (or ask to build something)."""


def _buffer_size(env: Mapping[str, str]) -> int:
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        value = env.get(name)
        if value is not None:
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def recorder_paths(env: Mapping[str, str], rank: int) -> tuple[str, str] | None:
    """The pipe and trace file of global rank ``rank`` under ``env``; None: it has none."""
    stem = env.get("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", "")
    if not stem or _buffer_size(env) <= 0:
        return None
    prefix = (
        env.get("TORCH_FR_DUMP_TEMP_FILE")
        or env.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
        or DEFAULT_TRACE_PREFIX
    )
    return f"{stem}{rank}.pipe", f"{prefix}{rank}"


def trace_servers(env: Mapping[str, str]) -> tuple[str, ...]:
    """The sockets a rank under ``env`` serves its trace on, if it records one."""
    if _buffer_size(env) <= 0:
        return ()
    return tuple(env[name] for name in TRACE_SERVER_VARIABLES if env.get(name))


def trace_server_env(directory: str, rank: int) -> dict[str, str]:
    """Where global rank ``rank`` serves its trace under ``--flight-recorder``: a socket per
    server in ``directory``, none whose path is too long to bind (torch's would fail the rank)."""
    paths = {
        "TORCH_WORKER_SERVER_SOCKET": f"{directory}/torch_rank_{rank}.sock",
        "WATCHDOGD_TRACE_SERVER": f"{directory}/trace_rank_{rank}.sock",
    }
    return {name: path for name, path in paths.items() if len(path.encode()) <= _MAX_SOCKET_PATH}


def flight_recorder_env(directory: str, env: Mapping[str, str]) -> dict[str, str]:
    """What ``--flight-recorder`` sets: a ring buffer, and pipes and traces in ``directory``.

    A buffer size the user chose is kept (one of 0 is not: the flag turns the
    recorder on). The size goes in ``TORCH_FR_BUFFER_SIZE`` only, which wins
    over the deprecated ``TORCH_NCCL_TRACE_BUFFER_SIZE``: setting that one
    makes every rank print torch's deprecation warning. Both trace variables
    name the same prefix, so older and newer torch write where the daemon looks.
    """
    chosen_size = _buffer_size(env)
    size = str(chosen_size if chosen_size > 0 else DEFAULT_BUFFER_SIZE)
    prefix = f"{directory}/trace_rank_"
    return {
        "TORCH_FR_BUFFER_SIZE": size,
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": f"{directory}/pipe_rank_",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix,
        "TORCH_FR_DUMP_TEMP_FILE": prefix,
    }


# What a pickle or JSON decoder raises on bytes that are not a trace.
_UNREADABLE = (
    pickle.UnpicklingError,
    msgspec.DecodeError,
    EOFError,
    ValueError,
    TypeError,
    IndexError,
)


class _ValuesOnly(pickle.Unpickler):
    """An unpickler that can build no object: every class or function lookup is refused."""

    def find_class(self, module: str, name: str) -> object:
        raise pickle.UnpicklingError(f"names {module}.{name}, which a trace never does")


def decode_trace(data: bytes) -> dict[str, object]:
    """The trace's top-level dict, from torch's pickle (the NCCL pipe's) or JSON (a worker
    server's); TraceError if ``data`` is anything else."""
    try:
        if data.lstrip()[:1] == b"{":
            decoded = msgspec.json.decode(data)
        else:
            decoded = _ValuesOnly(io.BytesIO(data)).load()
    except _UNREADABLE as e:
        raise TraceError(f"not a flight-recorder trace: {e}") from None
    if not isinstance(decoded, dict) or not isinstance(decoded.get("entries", []), list):
        raise TraceError("not a flight-recorder trace: no dict with a list of entries")
    return decoded


def _entries(trace: Mapping[str, object]) -> list[dict[str, object]]:
    entries = trace.get("entries", [])
    assert isinstance(entries, list)
    return [e for e in entries if isinstance(e, dict)]


def _group(entry: Mapping[str, object]) -> str:
    group = entry.get("process_group")
    if isinstance(group, tuple | list) and len(group) == 2:
        return f"{group[0]}:{group[1]}" if group[1] else str(group[0])
    return str(entry.get("pg_id", "?"))


def _pending(entry: Mapping[str, object]) -> bool:
    # A retired entry is done with even where the backend never marks it completed.
    return entry.get("state") != "completed" and entry.get("retired") is not True


def _seq(entry: Mapping[str, object]) -> object:
    """Its number in its group's sequence: point-to-point and collectives count apart."""
    return entry.get("p2p_seq_id") if entry.get("is_p2p") else entry.get("collective_seq_id")


def _describe(entry: Mapping[str, object]) -> str:
    return (
        f"{entry.get('profiling_name', '?')} (pg {_group(entry)}, seq {_seq(entry)}, "
        f"{entry.get('state', '?')})"
    )


def summarize_trace(trace: Mapping[str, object]) -> str:
    """One line: the oldest collective this rank has not finished, else its last one."""
    entries = _entries(trace)
    if not entries:
        return "no collective recorded"
    pending = [e for e in entries if _pending(e)]
    if pending:
        more = f", {len(pending) - 1} more after it" if len(pending) > 1 else ""
        return f"waiting in {_describe(pending[0])}{more}"
    return f"nothing pending; last {_describe(entries[-1])}"


def _when(ns: object) -> str:
    if not isinstance(ns, int):
        return "-"
    return datetime.fromtimestamp(ns / 1e9).isoformat(timespec="milliseconds")


def _frame(entry: Mapping[str, object]) -> str:
    frames = entry.get("frames")
    if isinstance(frames, list):
        # The innermost frame is torch's own wrapper; the caller's is the first not in torch.
        for frame in frames:
            if isinstance(frame, dict) and "/torch/" not in str(frame.get("filename", "")):
                return f"{frame.get('name')} {frame.get('filename')}:{frame.get('line')}"
    return ""


TRACE_COLUMNS = (
    "RECORD", "PG", "SEQ", "COLLECTIVE", "STATE", "CREATED", "INPUT", "OUTPUT", "CALLER",
)  # fmt: skip


def trace_header(trace: Mapping[str, object]) -> list[str]:
    """What the trace says about itself: its version and summary, its groups and their status."""
    lines = [f"flight recorder {trace.get('version', '?')}: {summarize_trace(trace)}"]
    groups = trace.get("pg_config")
    if isinstance(groups, dict):
        lines += [f"process group {name}: {config}" for name, config in groups.items()]
    status = trace.get("pg_status")
    if isinstance(status, dict):
        lines += [f"status of group {name}: {state}" for name, state in status.items()]
    return lines


def trace_rows(trace: Mapping[str, object]) -> list[tuple[object, ...]]:
    """One row per collective, oldest first, under :data:`TRACE_COLUMNS`."""
    return [
        (
            e.get("record_id", "?"),
            _group(e),
            _seq(e),
            e.get("profiling_name", "?"),
            e.get("state", "?"),
            _when(e.get("time_created_ns")),
            e.get("input_sizes", ""),
            e.get("output_sizes", ""),
            _frame(e),
        )
        for e in _entries(trace)
    ]
