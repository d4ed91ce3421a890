"""Collective traces before the kill: every rank's flight recorder, made to dump.

NCCL's ranks run ``tests/flight_recorder_standin.py``, which owns its pipe
and writes its trace when poked as torch's ``ProcessGroupNCCL`` does; real
FIFOs, real processes, the installed commands. gloo's is a real torch job
(``tests/gloo_hang_worker.py``), asked through torch's worker server.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pickle
import shutil
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from watchdogd.core.flight_recorder import Recorder, decode_trace, summarize_trace, trace_rows
from watchdogd.linux.flight_recorder import MAX_TRACE, collect
from watchdogd.linux.worker_server import fetch_trace

from ..conftest import REPO, kept_dumps, wait_until, watchdogd_run
from ..flight_recorder_standin import FlightRecorder
from .test_cli import ctl, serve

STANDIN = REPO / "tests" / "flight_recorder_standin.py"
GLOO_HANG = REPO / "tests" / "gloo_hang_worker.py"


def test_a_hang_leaves_the_trace_of_every_rank_of_its_group(short_dir: Path) -> None:
    sock = short_dir / "watchdogd.sock"
    spec = short_dir / "fr.toml"
    spec.write_text(
        f"""
        name = "fr"
        entrypoint = [{sys.executable!r}, {str(STANDIN)!r}, "3", "1"]
        nproc = 2
        flight_recorder = true
        log_dir = {str(short_dir / "logs")!r}
        env = {{ TORCH_NCCL_COORD_CHECK_MILSEC = "50", PYTHONPATH = {str(REPO / "client")!r} }}
        """.replace("\n        ", "\n")
    )
    with serve(short_dir):
        assert ctl(sock, "submit", str(spec)).returncode == 0
        wait_until(lambda: json.loads(ctl(sock, "dumps", "--json").stdout) != [], 30)
        (dump,) = json.loads(ctl(sock, "dumps", "--json").stdout)
        assert dump["scope_id"] == "step"
        assert [(t["rank"], t["size"] > 0, t["problem"]) for t in dump["traces"]] == [
            (0, True, ""),
            (1, True, ""),
        ]
        listing = ctl(sock, "dump", dump["id"]).stdout
        assert "in main" in listing  # the hung rank's stacks come first
        ranks = {
            line.split()[0]: line
            for line in listing.split("flight-recorder traces")[1].splitlines()[3:]
        }
        # Rank 0 waits in the all_reduce that rank 1, the hung one, never reached.
        rank0, rank1 = ranks["0"], ranks["1"]
        assert "waiting in nccl:all_reduce (pg 0:default_pg, seq 4, started)" in rank0
        assert "nothing pending; last nccl:all_reduce (pg 0:default_pg, seq 3" in rank1
        trace = ctl(sock, "dump", dump["id"], "--trace", "1")
        assert trace.returncode == 0, trace.stderr
        lines = trace.stdout.splitlines()
        assert lines[0] == (
            "# flight recorder 2.10: nothing pending; "
            "last nccl:all_reduce (pg 0:default_pg, seq 3, completed)"
        )
        rows = [line.split() for line in lines if line.split()[3:4] == ["nccl:all_reduce"]]
        assert [(row[2], row[4]) for row in rows] == [
            ("1", "completed"),
            ("2", "completed"),
            ("3", "completed"),
        ]
        raw = subprocess.run(
            ["watchdogctl", "--socket", str(sock), "dump", dump["id"], "--trace", "0", "--raw"],
            capture_output=True,
            check=True,
        )
        assert decode_trace(raw.stdout)["entries"][-1]["state"] == "started"  # type: ignore[index]
        missing = ctl(sock, "dump", dump["id"], "--trace", "5")
        assert missing.returncode == 1
        assert "no trace of rank 5" in missing.stderr
        # The variables --flight-recorder sets: a directory per attempt, beside the logs.
        recorder_dir = short_dir / "logs" / "fr" / "attempt_0" / "flight_recorder"
        assert sorted(p.name for p in recorder_dir.iterdir()) == [
            "pipe_rank_0.pipe",
            "pipe_rank_1.pipe",
            "trace_rank_0",
            "trace_rank_1",
        ]
        assert stat.S_IMODE(recorder_dir.stat().st_mode) == 0o700


@pytest.fixture
def recorder(short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """Rank 3's recorder, listening in this process (its monitor thread polls every 10 ms)."""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "100")
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_PIPE_FILE", str(short_dir / "pipe_"))
    monkeypatch.setenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE", str(short_dir / "trace_"))
    monkeypatch.setenv("TORCH_NCCL_COORD_CHECK_MILSEC", "10")
    standin = FlightRecorder(3)
    standin.record("broadcast", "completed")
    assert standin.listen()
    return Recorder(
        3, os.getpid(), str(short_dir / "pipe_3.pipe"), str(short_dir / "trace_3"), os.geteuid()
    )


def test_collect_takes_the_new_trace_not_the_one_an_earlier_attempt_left(
    recorder: Recorder,
) -> None:
    Path(recorder.trace).write_bytes(pickle.dumps({"entries": []}, protocol=2))
    collected = collect(recorder, time.monotonic() + 5)
    assert collected.problem == ""
    assert pickle.loads(collected.data)["entries"][0]["profiling_name"] == "nccl:broadcast"


def test_collect_says_why_when_nobody_reads_the_pipe(short_dir: Path) -> None:
    pipe = short_dir / "pipe_0.pipe"
    os.mkfifo(pipe)
    recorder = Recorder(0, 1, str(pipe), str(short_dir / "trace_0"), os.geteuid())
    started = time.monotonic()
    assert "nobody reads" in collect(recorder, time.monotonic() + 5).problem
    assert time.monotonic() - started < 1  # no wait for a trace that cannot come


def test_collect_never_writes_through_a_symlink_or_into_a_plain_file(short_dir: Path) -> None:
    target = short_dir / "precious"
    target.write_text("keep me")
    link = short_dir / "link_0.pipe"
    link.symlink_to(target)
    plain = short_dir / "plain_0.pipe"
    plain.write_text("also mine")
    missing = short_dir / "missing_0.pipe"
    problems = [
        collect(
            Recorder(0, 1, str(path), str(short_dir / "t0"), os.geteuid()), time.monotonic() + 1
        ).problem
        for path in (link, plain, missing)
    ]
    assert "symlink: not followed" in problems[0]
    assert "not a FIFO" in problems[1]
    assert "no flight recorder listening" in problems[2]
    assert target.read_text() == "keep me"
    assert plain.read_text() == "also mine"


def test_collect_does_not_follow_a_symlink_planted_at_the_trace(
    recorder: Recorder, short_dir: Path
) -> None:
    secret = short_dir / "secret"
    secret.write_bytes(b"\x80\x02}q\x00.")  # a pickle, but not the rank's
    Path(recorder.trace).symlink_to(secret)
    started = time.monotonic()
    collected = collect(recorder, time.monotonic() + 2)
    assert collected.data == b""
    assert "symlink: not followed, and the rank not asked to write" in collected.problem
    assert time.monotonic() - started < 1
    time.sleep(0.05)  # several polls of the rank's monitor: it was not poked
    assert secret.read_bytes() == b"\x80\x02}q\x00."


def test_collect_keeps_a_trace_still_being_written_at_the_deadline_and_says_so(
    short_dir: Path,
) -> None:
    pipe = short_dir / "pipe_0.pipe"
    os.mkfifo(pipe)
    reader = os.open(pipe, os.O_RDONLY | os.O_NONBLOCK)
    trace = short_dir / "trace_0"
    stop = threading.Event()

    def slow_writer() -> None:  # a dump that never finishes: it grows and never ends as a pickle
        with trace.open("wb") as f:
            f.write(b"\x80\x02}(")
            while not stop.wait(0.005):
                f.write(b"X")
                f.flush()

    writer = threading.Thread(target=slow_writer)
    writer.start()
    try:
        recorder = Recorder(0, 1, str(pipe), str(trace), os.geteuid())
        collected = collect(recorder, time.monotonic() + 0.3)
    finally:
        stop.set()
        writer.join()
        os.close(reader)
    assert collected.data.startswith(b"\x80\x02}(")
    assert "incomplete" in collected.problem


def test_a_real_torch_trace_decodes(tmp_path: Path) -> None:
    """What torch 2.13 itself writes (gloo's recorder, on CPU): values only, read as such."""
    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    out = tmp_path / "trace"
    code = f"""
import os, socket
os.environ["TORCH_FR_BUFFER_SIZE"] = "10"
import torch, torch.distributed as dist
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{{port}}", rank=0, world_size=1)
dist.all_reduce(torch.ones(4))
open({str(out)!r}, "wb").write(torch._C._distributed_c10d._dump_fr_trace())
dist.destroy_process_group()
"""
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, capture_output=True)
    trace = decode_trace(out.read_bytes())
    (row,) = trace_rows(trace)
    assert row[3] == "gloo:all_reduce"
    assert row[6] == [[4]]


@pytest.mark.timeout(60)
def test_a_hung_gloo_job_leaves_every_ranks_collectives(short_dir: Path) -> None:
    """Rank 0 hangs in gloo's all_reduce (its main thread in C) past its timer; rank 1 never
    reached it. No pipe listens under gloo: the traces come from torch's worker servers."""
    pytest.importorskip("torch")
    logs = short_dir / "logs"
    out = watchdogd_run(
        "--flight-recorder", "--log-dir", str(logs), "--nproc-per-node", "2",
        "--max-restarts", "0", "--master-addr", "127.0.0.1", str(GLOO_HANG),
    )  # fmt: skip
    assert out.returncode != 0
    assert "timer 'hang' expired" in out.stderr, out.stderr
    dumps = kept_dumps(out.stderr)
    (dump,) = dumps.glob("*.txt")
    traces = {
        rank: decode_trace((dump.parent / f"{dump.stem}.rank{rank}.trace").read_bytes())
        for rank in (0, 1)
    }
    for trace in traces.values():
        names = [row[3] for row in trace_rows(trace)]
        assert names[:3] == ["gloo:all_reduce"] * 3
    assert summarize_trace(traces[0]).startswith(
        "waiting in gloo:all_reduce (pg 0:default_pg, seq 4,"
    )
    assert summarize_trace(traces[1]).startswith(
        "nothing pending; last gloo:all_reduce (pg 0:default_pg, seq 3,"
    )
    shutil.rmtree(dumps.parent)


def test_a_worker_server_that_is_not_the_ranks_is_never_asked(short_dir: Path) -> None:
    path = short_dir / "trace_rank_0.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()
    with server:
        # Served by this process, not by the rank's (pid 1): the request is not sent.
        data, problem = fetch_trace(str(path), 1, os.geteuid(), MAX_TRACE, time.monotonic() + 2)
        assert data == b""
        assert f"served by pid {os.getpid()}, not the rank's 1" in problem
        peer, _ = server.accept()
        with peer:
            peer.settimeout(0.2)
            assert peer.recv(100) == b""  # it was closed, never written to


def test_a_worker_server_that_never_answers_costs_its_deadline_only(short_dir: Path) -> None:
    path = short_dir / "trace_rank_0.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    server.listen()
    with server:  # it accepts (the backlog does) and never writes a byte
        started = time.monotonic()
        data, problem = fetch_trace(str(path), os.getpid(), os.geteuid(), MAX_TRACE, started + 0.3)
        assert time.monotonic() - started < 1
    assert data == b""
    assert "did not come whole before the deadline" in problem


def test_collect_says_why_no_way_gave_a_trace(short_dir: Path) -> None:
    recorder = Recorder(
        0, 1, str(short_dir / "pipe_0.pipe"), str(short_dir / "t0"), os.geteuid(),
        (str(short_dir / "torch_rank_0.sock"),),
    )  # fmt: skip
    problem = collect(recorder, time.monotonic() + 1).problem
    assert "no flight recorder listening" in problem
    assert "the rank serves no trace there" in problem
