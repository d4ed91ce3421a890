"""Worker functions for the launcher tests: importable, so ``spawn`` can send them."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import watchdogd_client as wd


def rank_and_args(*args: Any) -> tuple[int, int, tuple[Any, ...]]:
    return int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), args


def fails_once(marker_dir: str) -> str:
    """Rank 1 raises on the first attempt; every rank says which attempt it saw.

    Rank 1 waits for rank 0's marker before it raises: otherwise its failure
    can stop rank 0 before rank 0 has run at all.
    """
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    Path(marker_dir, f"{os.environ['RANK']}-{attempt}").touch()
    if os.environ["RANK"] == "1" and attempt == "0":
        deadline = time.monotonic() + 20
        while not Path(marker_dir, "0-0").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        raise RuntimeError("rank 1 gives up on attempt 0")
    return f"attempt {attempt}"


def always_fails() -> None:
    if os.environ["RANK"] == "1":
        raise ValueError("the loss is NaN")
    time.sleep(30)  # stopped by the group when rank 1 fails


def hangs_once() -> int:
    """Rank 0 hangs inside a timer on the first attempt: the daemon kills it."""
    attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
    with wd.expires(after=0.5, scope="step"):
        if os.environ["RANK"] == "0" and attempt == "0":
            stuck_in_allreduce()
    return int(attempt)


def stuck_in_allreduce() -> None:
    time.sleep(60)


def unpicklable_result() -> Any:
    return lambda: None


def from_the_queue(queue: Any) -> str:
    queue.put(int(os.environ["RANK"]))
    return "sent"


def sleeps() -> None:
    time.sleep(60)


def all_reduce() -> tuple[float, int]:
    """A gloo world over the job's store; and how many torch helpers run meanwhile."""
    import torch
    import torch.distributed as dist

    assert os.environ["TORCHELASTIC_USE_AGENT_STORE"] == "True"
    dist.init_process_group("gloo")
    total = torch.ones(1)
    dist.all_reduce(total)
    dist.destroy_process_group()
    helpers = 0
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            helpers += b"watchdogd.groups.torch_helper" in (proc / "cmdline").read_bytes()
        except OSError:
            continue
    return float(total.item()), helpers


def leaves_children(marker: str, out_dir: str, hang: bool = False) -> int:
    """Starts a sleeper in a session of its own and one in its own session, notes their
    pids in ``out_dir``, and returns (what torchrun leaves running); or, with ``hang``,
    notes its own pid too and sleeps."""
    import subprocess
    import sys
    import time

    for own_session in (True, False):
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(3000)", marker],
            start_new_session=own_session,
        )
        Path(out_dir, f"child-{child.pid}").touch()
    if hang:
        Path(out_dir, f"worker-{os.getpid()}").touch()
        time.sleep(300)
    return int(os.environ["RANK"])


def allocates(megabytes: int) -> int:
    """Touch ``megabytes`` of memory, page by page (a cap makes the OOM killer end it)."""
    block = bytearray(megabytes << 20)
    return len(block)
