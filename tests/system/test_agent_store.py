"""The job's store on MASTER_PORT outlives every rank: a torch helper hosts it, as torchrun's agent.

Static jobs, ``watchdogd run`` end to end. Without the agent store, rank 0's
``init_process_group`` hosts the store and it dies with rank 0.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

from watchdogd.linux.net import free_port

from .test_c10d import python_without

WORKER = """
import datetime, os, sys, time
import torch, torch.distributed as dist
port, rank, world = int(sys.argv[1]), int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
dist.init_process_group("gloo", init_method=f"tcp://localhost:{port}", rank=rank, world_size=world)
total = torch.ones(1)
dist.all_reduce(total)
assert total.item() == world
dist.destroy_process_group()
if rank != 0:
    time.sleep(1)  # rank 0 has exited by now: the store must still serve
    late = dist.TCPStore("localhost", port, is_master=False, timeout=datetime.timedelta(seconds=9))
    late.add("late", 1)
"""


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["watchdogd", "run", *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.timeout(180)
def test_tcp_init_on_master_port_with_the_store_outliving_rank_0(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    port = free_port("127.0.0.1")
    for _ in range(2):  # the same port again, as a job's restart would
        # Two ranks: every rank but 0 does the same, and each imports torch (seconds of CPU).
        flags = ["--nproc-per-node=2", "--master-addr=localhost", f"--master-port={port}"]
        out = run(*flags, str(worker), str(port))
        assert out.returncode == 0, out.stderr


RESTARTED = """
import os, sys, time
import torch, torch.distributed as dist
rank, attempt = int(os.environ["RANK"]), os.environ["TORCHELASTIC_RESTART_COUNT"]
if rank == 1 and attempt == "1":
    time.sleep(2)  # rank 0 looks up rank 1's address first: last attempt's must be gone
dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
print(f"attempt {attempt} rank {rank} sum {total.item()}", flush=True)
dist.destroy_process_group()
sys.exit(1 if rank == 0 and attempt == "0" else 0)
"""


def test_each_attempt_gets_an_empty_store(tmp_path: Path) -> None:
    # torch's agent makes a store per round; one kept across attempts would hand
    # rank 0 the address of rank 1's previous, dead process.
    worker = tmp_path / "worker.py"
    worker.write_text(RESTARTED)
    out = run("--nproc-per-node=2", "--max-restarts=1", str(worker))
    assert out.returncode == 0, out.stderr
    assert "attempt 1 rank 0 sum 2.0" in out.stdout and "attempt 1 rank 1 sum 2.0" in out.stdout


def test_without_torch_rank_0_keeps_the_store(tmp_path: Path) -> None:
    python = python_without(tmp_path)
    out = run(
        "--nproc-per-node=2", "--no-python", "sh", "-c", "echo $TORCHELASTIC_USE_AGENT_STORE",
        env={"PYTHON_EXEC": str(python)},
    )  # fmt: skip
    assert (out.returncode, out.stdout) == (0, "False\nFalse\n"), out.stderr


def test_a_taken_master_port_leaves_the_store_to_rank_0() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        show = "echo $TORCHELASTIC_USE_AGENT_STORE $MASTER_PORT"
        out = run(f"--master-port={port}", "--", "sh", "-c", show)
    assert (out.returncode, out.stdout) == (0, f"False {port}\n"), out.stderr
    assert f"port {port}: Address already in use; the job's store stays with rank 0" in out.stderr


def test_standalone_serves_the_store_on_a_free_port() -> None:
    pytest.importorskip("torch")
    out = run(
        "--standalone", "--nproc-per-node=2", "--", "sh", "-c", "echo $TORCHELASTIC_USE_AGENT_STORE"
    )
    assert (out.returncode, out.stdout) == (0, "True\nTrue\n"), out.stderr


def test_a_store_that_cannot_start_restarts_the_attempt_without_it(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    python = python_without(tmp_path, "torch.distributed")  # torch is there, but broken
    worker = (
        'if [ "$TORCHELASTIC_USE_AGENT_STORE" = True ]; then sleep 60; fi; '  # until restarted
        "echo $TORCHELASTIC_USE_AGENT_STORE $TORCHELASTIC_RESTART_COUNT"
    )
    out = run("--no-python", "sh", "-c", worker, env={"PYTHON_EXEC": str(python)})
    assert (out.returncode, out.stdout) == (0, "False 0\n"), out.stderr
    assert "the job's store could not start; it goes to rank 0" in out.stderr
