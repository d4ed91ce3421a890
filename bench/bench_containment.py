"""What containment costs a worker: its cgroup made, entered, killed, awaited and removed.

Each round makes a cell in a job cgroup of this process's own
(``watchdogd.linux.cgroups``, as the daemon does), forks a child that
places itself in it (writes ``0`` to its ``cgroup.procs``, as the exec shim
does), then kills the cell (``cgroup.kill``, handed to the job's writer
thread, as the daemon does), waits until it is empty (``until_empty``:
``cgroup.events`` through inotify) and removes it (that thread again: the
figure is the hand-over's). The first kill also starts the warm-up (one
no-op move of this process, which waits out the grace period holding
``cgroup_mutex``): the second cell's kill waits behind it, as a restart's
later kills do. The
placement is timed twice: *cold*, after a pause, when the kernel's lock for
moving processes between cgroups first waits for an RCU grace period, and
*warm*, a second child placed right after the first, as the daemon's
warm-up makes it for a restart's workers. Needs a writable cgroup v2 (root).
Usage::

    python bench/bench_containment.py [--rounds 50] [--pause 0.1]
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
import time

import anyio

from watchdogd.groups.cell_memory import with_memory
from watchdogd.groups.child import Cell
from watchdogd.linux import cgroups, memory_cgroups
from watchdogd.linux.memory_cgroups import MemoryJob


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def place_child(procs: tuple[str, ...]) -> tuple[int, list[float]]:
    """A child that moves into each of ``procs``' cgroups, in turn, and sleeps: its pid,
    and each move's µs."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        took = []
        for path in procs:
            started = time.perf_counter()
            with open(path, "w") as f:
                f.write("0")
            took.append((time.perf_counter() - started) * 1e6)
        os.write(write, repr(took).encode())
        time.sleep(3600)
        os._exit(0)
    os.close(write)
    took = ast.literal_eval(os.read(read, 4096).decode())
    os.close(read)
    return pid, took


async def one_round(
    job: cgroups.JobCgroup,
    memory: MemoryJob | None,
    n: int,
    costs: dict[str, list[float]],
    children: list[int],
) -> None:
    def timed(key: str, started: float) -> float:
        now = time.perf_counter()
        costs[key].append((now - started) * 1e6)
        return now

    cells = []
    for i in range(2):
        started = time.perf_counter()
        cell: Cell = job.cell(f"bench.{n}.{i}")
        if memory is not None:
            cell = with_memory(cell, memory, f"bench.{n}.{i}", None)
        cells.append(cell)
        timed("mkdir", started)
    for key, cell in zip(("cold", "warm"), cells, strict=True):
        pid, took = place_child(cell.procs)
        for what, move in zip(("place", "+ memory v1"), took, strict=False):
            costs[f"{what}, {key}"].append(move)
        children.append(pid)
    # A worker runs longer than this: the kernel announces a cgroup.events change at most
    # every 20 ms per file, so one right after the placement's would be held back.
    await anyio.sleep(0.03)
    for emptied, cell in zip(("kill -> empty", "kill -> empty, 2nd"), cells, strict=True):
        started = time.perf_counter()
        cell.kill()
        started = timed("cgroup.kill", started)
        await cgroups.until_empty([cell])
        started = timed(emptied, started)
        cell.remove()
        timed("rmdir", started)


async def main(children: list[int]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--pause", type=float, default=0.1, help="s between rounds (cold lock)")
    parser.add_argument(
        "--memory", action="store_true", help="each cell with its memory cgroup, as the daemon's"
    )
    args = parser.parse_args()
    try:
        job = cgroups.open_job_cgroup()
    except OSError as e:
        print(f"cgroup v2 cannot be written here: {e}", file=sys.stderr)
        return 1
    memory = memory_cgroups.open_memory_job(job.path) if args.memory else None
    second = memory is not None and memory.files is memory_cgroups.V1
    keys = ["mkdir", "place, cold", *(["+ memory v1, cold"] if second else [])]
    keys += ["place, warm", *(["+ memory v1, warm"] if second else [])]
    keys += ["cgroup.kill", "kill -> empty", "kill -> empty, 2nd", "rmdir"]
    costs: dict[str, list[float]] = {key: [] for key in keys}
    try:
        for n in range(args.rounds):
            await anyio.sleep(args.pause)
            await one_round(job, memory, n, costs, children)
    finally:
        job.close()
        if memory is not None:
            memory.remove()
    print(f"containment cost per worker, {args.rounds} rounds, {args.pause:g} s apart (µs)")
    for key, values in costs.items():
        print(f"{key:20} p50 {percentile(values, 0.5):8.0f}   p99 {percentile(values, 0.99):8.0f}")
    return 0


def run() -> int:
    children: list[int] = []
    try:
        return anyio.run(main, children)
    finally:
        for pid in children:  # killed with their cells
            os.waitpid(pid, 0)


if __name__ == "__main__":
    sys.exit(run())
