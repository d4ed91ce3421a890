"""A node lost on ``c10d``: how soon the survivor trains alone, ``watchdogd run`` vs ``torchrun``,
and ``watchdogd run`` on etcd beside them.

Two agents on this machine, one worker each, meet on torch's c10d
rendezvous (a ``TCPStore`` on localhost, hosted by the agent given
``is_host=true``) with ``--nnodes 1:2`` and ``--max-restarts 3``. Once
both train, one agent and everything under it is SIGKILLed, as a node that
dies. The worker (torch, gloo) appends a line per event to its node's log:
its start, and each step (``--work collective``: an all_reduce, then 0.1 s
of sleep; ``--work idle``: one all_reduce at start, then steps of sleep
alone, as a phase without collectives: data loading, a long forward).
From the survivor's log:

- seen: the kill → the survivor's worker failed in its collective, or was
  told to stop by its agent (SIGTERM), whichever came first;
- restart: the kill → its next worker's start (the old worker gone, the
  new round formed);
- trains: the kill → its first step in a world of one (the round re-formed,
  the process group made);
- or, when the survivor ends instead, how and when (``exit N``);
- or nothing within ``--timeout``.

Cases: the node lost is the other one, or the one hosting the store; the
rendezvous settings torch's defaults (a heartbeat every 5 s, dead after 3
missed, a 30 s last call for the round of one) or ``--rdzv-conf
keep_alive_interval=1,keep_alive_max_attempt=4,last_call_timeout=2``
(``fast``). The launcher ``etcd`` is ``watchdogd run --rdzv-backend etcd``
on a real etcd the bench starts (the suite's binary, ``tests/etcd.py``):
its store is no node's, so ``host`` is only the node started first; its
settings are ours (a 10 s lease, a 1 s last call) or, ``fast``,
``lease_ttl=2``. Both agents start at once; when the first round formed with one
node alone (the other joined after the last call: a loaded machine), the
case is tried again, up to 3 times: the bench measures a loss, not a
scale-up. Usage::

    python bench/bench_c10d_loss.py [--launchers watchdogd,torchrun]
        [--work collective,idle] [--conf default,fast] [--lose other,host]
        [--timeout 90] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

from watchdogd.linux.net import free_port

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from tests.etcd import find_etcd, running_etcd  # noqa: E402  (the suite's choice of binary)

WORKER = r"""
import os, signal, sys, time
log = open(sys.argv[1], "a", buffering=1)
attempt, world = os.environ["TORCHELASTIC_RESTART_COUNT"], os.environ["WORLD_SIZE"]
def note(event, *more):
    log.write(" ".join(map(str, (time.time(), event, attempt, world, *more))) + "\n")
def stopped(signum, frame):
    note("stopped")  # its agent stops it: the loss was seen there
    os._exit(1)
signal.signal(signal.SIGTERM, stopped)
note("start")
import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.ones(1)
dist.all_reduce(total)
collective = sys.argv[2] == "collective"
step = 0
while True:
    if collective:
        try:
            dist.all_reduce(total)
        except Exception:
            note("failed")  # the collective saw the peer gone
            raise
    step += 1
    note("step", step)
    time.sleep(0.1)
"""

LAUNCHERS = {
    "watchdogd": ["watchdogd", "run"],
    "torchrun": [sys.executable, "-m", "torch.distributed.run"],
    "etcd": ["watchdogd", "run"],
}
ETCD_CONFS = {"default": "join_timeout=120", "fast": "join_timeout=120,lease_ttl=2"}
CONFS = {
    "default": "join_timeout=120",
    "fast": "join_timeout=120,keep_alive_interval=1,keep_alive_max_attempt=4,last_call_timeout=2",
}


def descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{parent}/task").iterdir():
                kids = [int(c) for c in (task / "children").read_text().split()]
                found += kids
                todo += kids
    return found


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """The node dies: its agent and every process under it, at once."""
    tree = descendants(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    for pid in tree:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def read_log(path: Path) -> list[tuple[float, str, int, int]]:
    """(time, event, attempt, world size) of each line written whole."""
    rows = []
    with contextlib.suppress(FileNotFoundError):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 4:
                rows.append((float(parts[0]), parts[1], int(parts[2]), int(parts[3])))
    return rows


def rendezvous_flags(launcher: str, conf: str, node: str, store: str) -> list[str]:
    """``store``: etcd's endpoint, or the one the c10d store is to be hosted at."""
    if launcher == "etcd":
        return ["--rdzv-backend=etcd", f"--rdzv-endpoint={store}",
                f"--rdzv-conf={ETCD_CONFS[conf]}"]  # fmt: skip
    is_host = "true" if node == "host" else "false"
    return ["--rdzv-backend=c10d", f"--rdzv-endpoint={store}",
            f"--rdzv-conf={CONFS[conf]},is_host={is_host}"]  # fmt: skip


def one_case(
    launcher: str, work: str, conf: str, lose: str, timeout: float, etcd: str | None
) -> dict[str, object]:
    directory = Path(tempfile.mkdtemp(prefix="bench-c10d-"))
    worker = directory / "worker.py"
    worker.write_text(WORKER)
    store = etcd if launcher == "etcd" else f"127.0.0.1:{free_port('127.0.0.1')}"
    assert store is not None
    run_id = f"loss-{uuid.uuid4().hex[:8]}"
    nodes: dict[str, subprocess.Popen[bytes]] = {}
    logs = {name: directory / f"{name}.log" for name in ("host", "other")}
    try:
        for name in ("host", "other"):
            command = [
                *LAUNCHERS[launcher],
                *rendezvous_flags(launcher, conf, name, store),
                f"--rdzv-id={run_id}",
                "--nnodes=1:2",
                "--nproc-per-node=1",
                "--max-restarts=3",
                "--local-addr=127.0.0.1",
                str(worker),
                str(logs[name]),
                work,
            ]
            err = open(directory / f"{name}.stderr", "wb")  # noqa: SIM115 (closed with the dir)
            nodes[name] = subprocess.Popen(command, stdout=err, stderr=err)
        # Both train: a few steps in a world of two on each node, in their first round.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = [read_log(path) for path in logs.values()]
            if any(row[1] == "start" and row[3] == 1 for node in rows for row in node):
                return {"error": "the first round formed with one node"}
            if all(sum(1 for row in node if row[1] == "step") >= 10 for node in rows):
                break
            time.sleep(0.1)
        else:
            return {"error": "the two nodes never trained together"}
        survivor = "other" if lose == "host" else "host"
        killed = time.time()
        kill_tree(nodes[lose])
        result: dict[str, object] = {}
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            rows = [row for row in read_log(logs[survivor]) if row[0] > killed]
            seen = [row for row in rows if row[1] in ("failed", "stopped")]
            if seen and "seen_s" not in result:
                result["seen_s"] = round(seen[0][0] - killed, 2)
            starts = [row for row in rows if row[1] == "start"]
            alone = [row for row in rows if row[1] == "step" and row[3] == 1]
            if starts and "restart_s" not in result:
                result["restart_s"] = round(starts[0][0] - killed, 2)
            if alone:
                result["trains_s"] = round(alone[0][0] - killed, 2)
                break
            code = nodes[survivor].poll()
            if code is not None:
                result["exit"] = code
                result["exit_s"] = round(time.time() - killed, 2)
                break
            time.sleep(0.05)
        else:
            result["none_within_s"] = timeout
        return result
    finally:
        for proc in nodes.values():
            kill_tree(proc)
            proc.wait()
        if os.environ.get("BENCH_KEEP") is None:
            shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launchers", default="watchdogd,torchrun")
    parser.add_argument("--work", default="collective,idle")
    parser.add_argument("--conf", default="default,fast")
    parser.add_argument("--lose", default="other,host")
    parser.add_argument("--timeout", type=float, default=90)
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    launchers = args.launchers.split(",")
    with contextlib.ExitStack() as stack:
        etcd = None
        if "etcd" in launchers:
            binary, source = find_etcd()
            if binary is None:
                raise SystemExit(f"no etcd: {source}")
            etcd = stack.enter_context(running_etcd(binary)).endpoint
        results = run_cases(args, launchers, etcd)
    for row in results:
        print(json.dumps(row))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def run_cases(
    args: argparse.Namespace, launchers: list[str], etcd: str | None
) -> list[dict[str, object]]:
    results = []
    print(f"{'launcher':10} {'work':10} {'conf':8} {'lost':6} result")
    for lose, work, conf, launcher in itertools.product(
        args.lose.split(","), args.work.split(","), args.conf.split(","), launchers
    ):
        for _ in range(3):
            result = one_case(launcher, work, conf, lose, args.timeout, etcd)
            if "error" not in result:
                break
        row = {"launcher": launcher, "work": work, "conf": conf, "lost": lose, **result}
        results.append(row)
        print(f"{launcher:10} {work:10} {conf:8} {lose:6} {json.dumps(result)}", flush=True)
    return results


if __name__ == "__main__":
    main()
