"""torch's flight recorder, read from outside: its variables, and its traces decoded as values."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from watchdogd.core.flight_recorder import (
    TraceError,
    decode_trace,
    flight_recorder_env,
    recorder_paths,
    summarize_trace,
    trace_rows,
    trace_server_env,
    trace_servers,
)


def test_a_rank_listens_only_with_a_pipe_and_a_buffer() -> None:
    pipe = {"TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/run/fr/pipe_"}
    assert recorder_paths(pipe, 3) is None  # no buffer: torch creates no pipe
    assert recorder_paths({"TORCH_NCCL_TRACE_BUFFER_SIZE": "100"}, 3) is None
    env = {**pipe, "TORCH_NCCL_TRACE_BUFFER_SIZE": "100"}
    assert recorder_paths(env, 3) == ("/run/fr/pipe_3.pipe", "/tmp/nccl_trace_rank_3")
    # The first of TORCH_FR_BUFFER_SIZE and TORCH_NCCL_TRACE_BUFFER_SIZE that is set wins.
    assert recorder_paths({**env, "TORCH_FR_BUFFER_SIZE": "0"}, 3) is None
    assert recorder_paths({**env, "TORCH_NCCL_TRACE_BUFFER_SIZE": "x"}, 3) is None


def test_the_newer_trace_variable_wins() -> None:
    env = {
        "TORCH_NCCL_DEBUG_INFO_PIPE_FILE": "/p/pipe_",
        "TORCH_FR_BUFFER_SIZE": "10",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": "/old/rank_",
    }
    assert recorder_paths(env, 0) == ("/p/pipe_0.pipe", "/old/rank_0")
    assert recorder_paths({**env, "TORCH_FR_DUMP_TEMP_FILE": "/new/rank_"}, 0) == (
        "/p/pipe_0.pipe",
        "/new/rank_0",
    )


def test_flight_recorder_flag_keeps_a_buffer_size_the_user_chose() -> None:
    env = flight_recorder_env("/logs/g/attempt_1/flight_recorder", {})
    assert env["TORCH_FR_BUFFER_SIZE"] == "2000"
    # The deprecated name makes every rank print torch's warning: never set.
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env
    assert recorder_paths(env, 7) == (
        "/logs/g/attempt_1/flight_recorder/pipe_rank_7.pipe",
        "/logs/g/attempt_1/flight_recorder/trace_rank_7",
    )
    chosen = flight_recorder_env("/d", {"TORCH_NCCL_TRACE_BUFFER_SIZE": "20000"})
    assert chosen["TORCH_FR_BUFFER_SIZE"] == "20000"  # the user's size, under the new name
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in chosen
    # A recorder turned off by the variable that wins is turned on by the flag.
    off = {"TORCH_FR_BUFFER_SIZE": "0"}
    assert recorder_paths({**off, **flight_recorder_env("/d", off)}, 0) is not None


def test_a_rank_serves_its_trace_on_each_socket_short_enough_to_bind() -> None:
    env = trace_server_env("/logs/g/attempt_0/flight_recorder", 5)
    assert env == {
        "TORCH_WORKER_SERVER_SOCKET": "/logs/g/attempt_0/flight_recorder/torch_rank_5.sock",
        "WATCHDOGD_TRACE_SERVER": "/logs/g/attempt_0/flight_recorder/trace_rank_5.sock",
    }
    # torch's server would fail the rank at a path sockaddr_un cannot hold: none is named.
    assert trace_server_env("/" + "d" * 90, 5) == {}
    assert trace_servers(env) == ()  # no ring buffer: nothing recorded to serve
    served = {**env, "TORCH_FR_BUFFER_SIZE": "10"}
    assert trace_servers(served) == tuple(env.values())  # torch's own first


def test_a_worker_servers_json_trace_decodes_and_summarizes() -> None:
    """What torch 2.13's ``fr_trace_json`` answers for gloo (cut down): the pickle's dict."""
    data = (
        b'{"entries":[{"collective_seq_id":4,"process_group":["0","default_pg"],'
        b'"profiling_name":"gloo:all_reduce","retired":false,"state":"scheduled",'
        b'"is_p2p":false,"input_sizes":[[4]]}],"pg_config":{},"version":"2.10"}'
    )
    trace = decode_trace(data)
    assert (
        summarize_trace(trace) == "waiting in gloo:all_reduce (pg 0:default_pg, seq 4, scheduled)"
    )
    with pytest.raises(TraceError):
        decode_trace(b'{"entries": 3}')
    with pytest.raises(TraceError):
        decode_trace(b'{"entries": [')


class Exploit:
    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, ("touch /tmp/watchdogd-exploited",))


def test_a_trace_that_names_any_class_or_function_is_refused_unbuilt() -> None:
    for hostile in (
        pickle.dumps({"entries": [Exploit()]}, protocol=2),
        pickle.dumps({"entries": [], "when": Path("/")}, protocol=4),
    ):
        with pytest.raises(TraceError, match="which a trace never does"):
            decode_trace(hostile)
    assert not Path("/tmp/watchdogd-exploited").exists()
    with pytest.raises(TraceError):
        decode_trace(b"\x80\x02}q\x00(X")  # cut short, as a trace read mid-write
    with pytest.raises(TraceError, match="no dict"):
        decode_trace(pickle.dumps([1, 2], protocol=2))


def _entry(seq: int, name: str, state: str, **more: object) -> dict[str, object]:
    return {
        "record_id": seq - 1,
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "is_p2p": False,
        "profiling_name": name,
        "state": state,
        "process_group": ("1", "tp"),
        "retired": state == "completed",
        **more,
    }


def test_the_summary_names_the_oldest_collective_not_finished() -> None:
    entries = [
        _entry(1, "nccl:all_reduce", "completed"),
        _entry(2, "nccl:all_gather", "started"),
        _entry(3, "nccl:reduce_scatter", "scheduled"),
    ]
    assert summarize_trace({"entries": entries}) == (
        "waiting in nccl:all_gather (pg 1:tp, seq 2, started), 1 more after it"
    )
    assert summarize_trace({"entries": entries[:1]}) == (
        "nothing pending; last nccl:all_reduce (pg 1:tp, seq 1, completed)"
    )
    assert summarize_trace({"entries": []}) == "no collective recorded"
    frames = [
        {"name": "all_reduce", "filename": "/x/torch/distributed/distributed_c10d.py", "line": 3},
        {"name": "train_step", "filename": "/job/train.py", "line": 42},
    ]
    (row,) = trace_rows({"entries": [_entry(1, "nccl:send", "started", frames=frames)]})
    assert row[-1] == "train_step /job/train.py:42"  # the caller, not torch's wrapper
