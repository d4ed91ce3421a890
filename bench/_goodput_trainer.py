"""The goodput bench's trainer: one script for every launcher (``bench_goodput.py`` runs it).

Data parallel with gloo: each step computes (a sleep of ``--compute-ms``),
all-reduces ``--mb`` MB of float32 and pads with sleep to ``--step-ms``; rank 0 saves the state with
``torch.save`` every ``--ckpt-every`` steps, and every attempt resumes from
the latest checkpoint. Each launcher's hang timer is armed the way its
documentation says:

- ``watchdogd``: ``watchdogd_client.expires(after=LEARN(initial=...), scope="step")``
  around the step (the deadline is learned by the daemon, ``--deadline`` on the
  command line), and ``scope="compute"`` around the rank's own compute, before
  the all-reduce: the step holds the collective, so a slow rank slows every
  rank's step alike, and only the compute scope names it a straggler;
- ``torchrun``: the process group's ``timeout=``;
- ``nvrx``: ``RankMonitorClient`` sections ``setup``, ``step`` and
  ``checkpointing``; ``calculate_and_set_section_timeouts()`` once enough steps
  were seen, its ``state_dict()`` saved in the checkpoint and loaded at resume.

Faults are asked for from outside, through files the bench writes under
``OUT/flags``: ``hang-PID`` (this rank sleeps before its next all-reduce, so
that its peers block inside the collective) and ``slow-PID`` (holding the
wall time until which this rank's compute and steps take ``--slow-factor`` times
longer).
Crashes and lost nodes are signals from the bench.

Every rank appends JSON lines to ``OUT/trainer.jsonl`` (one ``write`` each,
``O_APPEND``): ``start`` (at user code), ``pg`` (process group up, with the
attempt's generation: rank 0's start time, broadcast), ``loaded`` (resumed
from step N), ``step`` (rank 0 only), ``ckpt`` and ``error``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import torch
import torch.distributed as dist

STARTED = time.time()


class Log:
    def __init__(self, path: Path, rank: int) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.rank, self.pid, self.gen = rank, os.getpid(), 0.0

    def __call__(self, event: str, t: float | None = None, **fields: object) -> None:
        line = {"ev": event, "t": time.time() if t is None else t, "rank": self.rank}
        line.update(pid=self.pid, gen=self.gen, **fields)
        os.write(self.fd, (json.dumps(line) + "\n").encode())


def latest_checkpoint(directory: Path) -> Path | None:
    found = sorted(directory.glob("step-*.pt"), key=lambda p: int(p.stem.split("-")[1]))
    return found[-1] if found else None


class Timers:
    """The launcher's hang timer around a step and around a checkpoint."""

    def __init__(self, launcher: str, args: argparse.Namespace) -> None:
        self.launcher, self.steps_seen, self.nvrx = launcher, 0, None
        if launcher == "watchdogd":
            import watchdogd_client as wd

            self.wd = wd
        elif launcher == "nvrx":
            from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

            self.nvrx = RankMonitorClient()
            self.nvrx.init_workload_monitoring()
            self.nvrx.start_section("setup")
        self.calculate_after = args.nvrx_calculate_after

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        if self.launcher == "watchdogd":
            with self.wd.expires(after=self.wd.LEARN, scope="step"):
                yield
        elif self.nvrx is not None:
            self.nvrx.start_section("step")
            yield
            self.nvrx.end_section("step")
            self.steps_seen += 1
            if self.steps_seen == self.calculate_after:
                # NVRx's usage guide: once some steps (and a checkpoint) were seen.
                self.nvrx.calculate_and_set_section_timeouts()
        else:
            yield

    @contextlib.contextmanager
    def compute(self) -> Iterator[None]:
        if self.launcher == "watchdogd":
            # No --deadline rule names it: the initial is the call's (NVRx's step value).
            with self.wd.expires(after=self.wd.LEARN(initial=180), scope="compute"):
                yield
        else:
            yield

    @contextlib.contextmanager
    def checkpoint(self) -> Iterator[None]:
        if self.nvrx is not None:
            self.nvrx.start_section("checkpointing")
            yield
            self.nvrx.end_section("checkpointing")
        else:
            yield

    def setup_done(self) -> None:
        if self.nvrx is not None:
            self.nvrx.end_section("setup")

    def state(self) -> dict[str, object]:
        return dict(self.nvrx.state_dict()) if self.nvrx is not None else {}

    def load(self, state: dict[str, object]) -> None:
        if self.nvrx is not None and state:
            self.nvrx.load_state_dict(state)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("launcher", choices=["watchdogd", "torchrun", "nvrx"])
    parser.add_argument("--mb", type=float, default=10.0)
    parser.add_argument("--step-ms", type=float, default=100.0)
    parser.add_argument("--compute-ms", type=float, default=40.0)
    parser.add_argument("--ckpt-every", type=int, default=10)
    parser.add_argument("--slow-factor", type=float, default=1.5)
    parser.add_argument("--pg-timeout", type=float, default=1800.0)
    parser.add_argument("--nvrx-calculate-after", type=int, default=50)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    log = Log(args.out / "trainer.jsonl", rank)
    env = os.environ
    master = f"{env.get('MASTER_ADDR')}:{env.get('MASTER_PORT')}"
    attempt = env.get("TORCHELASTIC_RESTART_COUNT")
    log("start", t=STARTED, node=env.get("GROUP_RANK"), attempt=attempt, master=master)
    timers = Timers(args.launcher, args)
    timeout = datetime.timedelta(seconds=args.pg_timeout)
    dist.init_process_group("gloo", timeout=timeout)
    gen = torch.tensor([STARTED if rank == 0 else 0.0], dtype=torch.float64)
    dist.broadcast(gen, 0)
    log.gen = float(gen.item())
    log("pg", world=world)
    ckpt_dir = args.out / "ckpt"
    model = torch.zeros(int(args.mb * 2**20 / 4))
    step = 0
    found = latest_checkpoint(ckpt_dir)
    if found is not None:
        state = torch.load(found, weights_only=False)
        step, model = state["step"], state["model"]
        timers.load(state["timers"])
    log("loaded", step=step)
    timers.setup_done()
    flags = args.out / "flags"
    hang_flag, slow_flag = flags / f"hang-{log.pid}", flags / f"slow-{log.pid}"
    grad = torch.ones_like(model)
    try:
        while True:
            began = time.time()
            slow = args.slow_factor if slow_flag.exists() else 1.0
            if slow != 1.0 and float(slow_flag.read_text() or 0) < began:
                slow = 1.0
            with timers.step():
                if hang_flag.exists():
                    log("hung", step=step + 1)
                    time.sleep(1e6)  # the peers block in the all_reduce below
                with timers.compute():
                    time.sleep(slow * args.compute_ms / 1000)
                dist.all_reduce(grad)
                model.add_(grad, alpha=1e-9)
                time.sleep(max(0.0, began + slow * args.step_ms / 1000 - time.time()))
            step += 1
            if rank == 0:
                log("step", step=step, slow=slow != 1.0)
            if step % args.ckpt_every == 0 and rank == 0:
                with timers.checkpoint():
                    saved = time.time()
                    ckpt_dir.mkdir(exist_ok=True)
                    temporary = ckpt_dir / f".step-{step}.pt"
                    state = {"step": step, "model": model, "timers": timers.state()}
                    torch.save(state, temporary)
                    temporary.rename(ckpt_dir / f"step-{step}.pt")
                    for old in sorted(ckpt_dir.glob("step-*.pt"))[:-2]:
                        if int(old.stem.split("-")[1]) < step - args.ckpt_every:
                            old.unlink(missing_ok=True)
                    log("ckpt", step=step, seconds=time.time() - saved)
    except Exception as error:
        log("error", step=step, error=f"{type(error).__name__}: {str(error)[:200]}")
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
