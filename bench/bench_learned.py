"""Learned deadlines and stragglers on a synthetic synchronous job of 8 ranks.

    python bench/bench_learned.py                              # 10,000 healthy steps, ~5 min
    python bench/bench_learned.py --steps 2000 --median-ms 10  # a quick look
    python bench/bench_learned.py --json learned.json

The job is a worker group the daemon runs (``submit_group``), so its ranks
learn together, as under ``watchdogd run``. A step is a ``compute`` scope
(``expires(after=LEARN(initial=60), scope="compute")`` around a sleep:
log-normal around ``--median-ms`` with sigma 0.1; in 0.5 % of the steps,
at random, 5x the median, never more than 6x), then a barrier at which
every rank waits for the slowest (the sync); every ``--checkpoint-every``
steps a ``checkpoint`` scope of its own (20x the median). The group's
``deadlines`` rules: N = 1,000 samples for ``compute``, 16 for
``checkpoint``; margin 2; a half-life of 10,000 samples; floor 0; no skip
(nothing here compiles).

The timers carry SIGUSR1, which a rank counts: a SIGUSR1 during a healthy
step is a false kill, and a ``straggler`` event during them a false flag.
Then, for ``--slow-steps`` steps, one rank computes 1.3x slower (a relative
score of about 0.77 against the 0.85 threshold): rank 0 asks the daemon
(``stragglers()``) after every step, and the bench counts the steps until
that rank is flagged. After that, ``--hangs`` times one rank
(in turn) hangs inside ``compute`` until its SIGUSR1 arrives: the
detection delay is arm -> signal received, in multiples of the median step
(the slowest rank's compute plus the sync, as rank 0 sees it). The delays
under a fixed 300 s deadline and under NVRx's rule (the maximum observed
x 5, its default safety factor, over the same warm-up samples) follow from
their deadlines: a hang is found when its deadline passes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
from _harness import Watchdogd, percentile, wait_until

import watchdogd_client as wd
from watchdogd_client.groups import DeadlineRule, GroupSpec, GroupState

COMPUTE_SAMPLES = 1000
CHECKPOINT_SAMPLES = 16
MARGIN = 2.0
HALF_LIFE = 10_000
OUTLIER_RATE = 0.005
OUTLIER = 5.0
OUTLIER_CAP = 6.0
SIGMA = 0.1
CHECKPOINT_FACTOR = 20.0
SLOWER = 1.3
FIXED_DEADLINE = 300.0
NVRX_FACTOR = 5.0


class Plan(msgspec.Struct, frozen=True):
    """What every rank does, step by step (the same plan on each: the job is synchronous)."""

    ranks: int
    steps: int
    """Healthy steps; the hangs come after them."""
    median_s: float
    checkpoint_every: int
    slow_steps: int
    """After the healthy steps, ``slow_rank`` computes ``SLOWER`` times longer for these."""
    slow_rank: int
    hangs: dict[int, int]
    """Step -> the rank that hangs in it (after the slow steps)."""
    seed: int

    @property
    def total_steps(self) -> int:
        return max(self.hangs, default=self.steps + self.slow_steps - 1) + 1

    def slower(self, step: int, rank: int) -> float:
        slow = rank == self.slow_rank and self.steps <= step < self.steps + self.slow_steps
        return SLOWER if slow else 1.0


class RankResult(msgspec.Struct):
    rank: int
    compute_s: list[float] = []
    step_s: list[float] = []
    """Rank 0 only: each healthy step, from its start to the end of its sync."""
    false_kills: int = 0
    detections_s: list[float] = []
    missed: int = 0
    slow_started: float = 0.0
    """Rank 0: wall-clock time the slow steps began (a straggler event before is false)."""
    flagged_after: int | None = None
    """Rank 0: slow steps taken when the daemon first listed the slow rank as flagged."""
    flagged_relative: float = 0.0


def _compute_seconds(rng: random.Random, median: float) -> float:
    seconds = median * rng.lognormvariate(0, SIGMA)
    if rng.random() < OUTLIER_RATE:
        seconds *= OUTLIER
    return min(seconds, OUTLIER_CAP * median)


# -- in each rank ---------------------------------------------------------------


def rank_main() -> None:
    plan = msgspec.json.decode(os.environ["BENCH_PLAN"], type=Plan)
    rank = int(os.environ["RANK"])
    result = RankResult(rank)
    hanging = False

    def on_signal(signum: int, frame: object) -> None:
        if not hanging:
            result.false_kills += 1

    signal.signal(signal.SIGUSR1, on_signal)
    client = wd.SocketTimerClient(signal=signal.SIGUSR1, stack_signal=None, name=f"rank{rank}")
    sync = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sync.connect(os.environ["BENCH_BARRIER"])
    rng = random.Random(plan.seed * 1000 + rank)
    compute = wd.LEARN(initial=60)
    for step in range(plan.total_steps):
        started = time.monotonic()
        seconds = _compute_seconds(rng, plan.median_s) * plan.slower(step, rank)
        if rank == 0 and step == plan.steps:
            result.slow_started = time.time()
        with wd.expires(after=compute, scope="compute", client=client):
            armed = time.monotonic()
            if plan.hangs.get(step) == rank:
                signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
                hanging = True
                if signal.sigtimedwait({signal.SIGUSR1}, 120) is None:
                    result.missed += 1
                else:
                    result.detections_s.append(time.monotonic() - armed)
                hanging = False
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})
            else:
                time.sleep(seconds)
                result.compute_s.append(seconds)
        if step % plan.checkpoint_every == plan.checkpoint_every - 1:
            checkpoint = CHECKPOINT_FACTOR * plan.median_s * rng.lognormvariate(0, SIGMA)
            with wd.expires(after=wd.LEARN(initial=600), scope="checkpoint", client=client):
                time.sleep(checkpoint)
        sync.sendall(b".")
        if not sync.recv(1):
            raise SystemExit("the barrier went away")
        if rank == 0 and step < plan.steps:
            result.step_s.append(time.monotonic() - started)
        slow_step = step - plan.steps + 1
        if rank == 0 and result.flagged_after is None and 0 < slow_step <= plan.slow_steps:
            for flag in client.stragglers().stragglers:
                if (flag.rank, flag.scope, flag.flagged) == (plan.slow_rank, "compute", True):
                    result.flagged_after, result.flagged_relative = slow_step, flag.relative
    client.sync()
    Path(os.environ["BENCH_OUT"], f"rank{rank}.json").write_bytes(msgspec.json.encode(result))


# -- in the bench ----------------------------------------------------------------


def barrier_server(listener: socket.socket, ranks: int) -> None:
    """Every rank sends a byte per step; all are answered once the last one has."""
    peers = [listener.accept()[0] for _ in range(ranks)]
    while True:
        for peer in peers:
            if not peer.recv(1):
                return
        for peer in peers:
            peer.sendall(b".")


def run(args: argparse.Namespace) -> dict[str, Any]:
    order = list(range(args.ranks))
    random.Random(args.seed).shuffle(order)  # which rank is slow, then hangs, in turn
    first_hang = args.steps + args.slow_steps + 5
    hangs = {first_hang + 3 * i: order[i % args.ranks] for i in range(args.hangs)}
    plan = Plan(
        args.ranks,
        args.steps,
        args.median_ms / 1000,
        args.checkpoint_every,
        args.slow_steps,
        order[0],
        hangs,
        args.seed,
    )
    workdir = Path(tempfile.mkdtemp(prefix="bench-learned-"))
    out = workdir / "out"
    out.mkdir()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(workdir / "barrier.sock"))
    listener.listen(args.ranks)
    threading.Thread(target=barrier_server, args=(listener, args.ranks), daemon=True).start()
    rules = [
        DeadlineRule(
            scope=scope, samples=samples, margin=MARGIN, floor=0, half_life=HALF_LIFE, skip=0
        )
        for scope, samples in (("compute", COMPUTE_SAMPLES), ("checkpoint", CHECKPOINT_SAMPLES))
    ]
    spec = GroupSpec(
        name="bench",
        entrypoint=[sys.executable, str(Path(__file__).resolve()), "--rank-main"],
        nproc=args.ranks,
        env={
            "BENCH_PLAN": msgspec.json.encode(plan).decode(),
            "BENCH_BARRIER": str(workdir / "barrier.sock"),
            "BENCH_OUT": str(out),
            "PYTHONPATH": os.pathsep.join(sys.path),
        },
        deadlines=rules,
    )
    settings: dict[str, str | int | float | bool] = {"stack_dumps": "off", "kill_grace": 1e9}
    try:
        with Watchdogd(workdir / "run", settings) as daemon:
            query = wd.SocketTimerClient(daemon.socket_path, name="bench")
            query.submit_group(spec)
            expected = plan.total_steps * args.median_ms / 1000 * 1.5 + 300

            def finished() -> bool:
                (group,) = query.list_groups()
                return group.state not in (GroupState.INIT, GroupState.HEALTHY)

            wait_until(finished, expected, "the bench job", interval=1.0)
            (group,) = query.list_groups()
            if group.state is not GroupState.SUCCEEDED:
                raise SystemExit(f"the bench job ended {group.state}: {group.last_failure}")
            scopes = query.scopes().scopes
            query.close()
            flags = [event["timestamp"] / 1000 for event in daemon.events("straggler")]
        results = [
            msgspec.json.decode((out / f"rank{r}.json").read_bytes(), type=RankResult)
            for r in range(args.ranks)
        ]
    finally:
        listener.close()
        shutil.rmtree(workdir, ignore_errors=True)
    return summarize(plan, results, scopes, flags)


def summarize(
    plan: Plan, results: list[RankResult], scopes: list[wd.protocol.ScopeInfo], flags: list[float]
) -> dict[str, Any]:
    median_step = percentile(results[0].step_s, 50)
    healthy = [s for r in results for s in r.compute_s]
    warm_up = [s for r in results for s in r.compute_s[: COMPUTE_SAMPLES // plan.ranks]]
    detections = [d for r in results for d in r.detections_s]
    compute = [s for s in scopes if s.scope == "compute"]
    return {
        "plan": {
            "ranks": plan.ranks,
            "healthy_steps": plan.steps,
            "median_compute_ms": plan.median_s * 1000,
            "checkpoint_every": plan.checkpoint_every,
            "hangs": len(plan.hangs),
            "slow_steps": plan.slow_steps,
            "seed": plan.seed,
            "compute_samples": COMPUTE_SAMPLES,
            "checkpoint_samples": CHECKPOINT_SAMPLES,
            "margin": MARGIN,
            "half_life": HALF_LIFE,
        },
        "median_step_s": median_step,
        "healthy_compute_scopes": len(healthy),
        "longest_compute_in_median_steps": max(healthy) / median_step,
        "false_kills": sum(r.false_kills for r in results),
        "false_straggler_flags": sum(t < results[0].slow_started for t in flags),
        "slow_rank_flagged_after_steps": results[0].flagged_after,
        "slow_rank_relative_score": results[0].flagged_relative,
        "hangs_detected": len(detections),
        "missed_hangs": sum(r.missed for r in results),
        "learned_compute_deadline_s": compute[0].deadline_s if compute else math.nan,
        "deadline_sources": sorted({(s.scope, s.deadline_source) for s in scopes}),
        "detection_in_median_steps": {
            "learned_median": percentile(detections, 50) / median_step,
            "learned_max": max(detections, default=math.nan) / median_step,
            "nvrx_max_x5": NVRX_FACTOR * max(warm_up) / median_step,
            "fixed_300s_this_step": FIXED_DEADLINE / median_step,
            "fixed_300s_2s_step": FIXED_DEADLINE / 2.0,
        },
    }


def table(report: dict[str, Any]) -> str:
    d = report["detection_in_median_steps"]
    plan = report["plan"]
    step_ms = report["median_step_s"] * 1000
    rows = [
        (
            "learned: margin 2 x decayed max, median / max",
            f"{d['learned_median']:.1f} / {d['learned_max']:.1f}",
        ),
        ("NVRx's rule: max observed x 5", f"{d['nvrx_max_x5']:.1f}"),
        (f"fixed 300 s, on this {step_ms:.0f} ms step", f"{d['fixed_300s_this_step']:,.0f}"),
        ("fixed 300 s, on a 2 s step", f"{d['fixed_300s_2s_step']:.0f}"),
    ]
    return "\n".join(
        [
            f"{plan['ranks']} ranks, {plan['healthy_steps']:,} healthy steps; compute median "
            f"{plan['median_compute_ms']:g} ms (sigma {SIGMA}; {OUTLIER_RATE:.1%} of steps "
            f"{OUTLIER:g}x, at most {OUTLIER_CAP:g}x); checkpoint every "
            f"{plan['checkpoint_every']} steps; learned with N = {plan['compute_samples']:,} "
            f"samples ({plan['checkpoint_samples']} for checkpoint), margin {plan['margin']:g}, "
            f"half-life {plan['half_life']:,} samples; median step {step_ms:.1f} ms",
            "",
            "| hang detection delay, in median steps | |",
            "|---|---|",
            *(f"| {name} | {value} |" for name, value in rows),
            "",
            f"- hangs detected: {report['hangs_detected']} of {plan['hangs']}",
            f"- false kills over the {report['healthy_compute_scopes']:,} compute scopes that did "
            f"not hang (healthy, slow and between hangs; {plan['ranks']} ranks): "
            f"{report['false_kills']}",
            f"- the learned compute deadline at the end: "
            f"{report['learned_compute_deadline_s'] * 1000:.0f} ms; the longest compute that did "
            "not hang: "
            f"{report['longest_compute_in_median_steps']:.1f} median steps",
            f"- false straggler flags over the {plan['healthy_steps']:,} healthy steps (uniform "
            f"ranks): {report['false_straggler_flags']}",
            f"- a rank made {SLOWER:g}x slower in compute: flagged after "
            f"{report['slow_rank_flagged_after_steps']} steps (relative score "
            f"{report['slow_rank_relative_score']:.2f}; threshold 0.85, window 50 scored every 25, "
            f"2 in a row)",
            f"- deadline sources shown by `watchdogctl scopes`: {report['deadline_sources']}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--steps", type=int, default=10_000, help="healthy steps (%(default)s)")
    parser.add_argument("--median-ms", type=float, default=20.0, help="compute (%(default)s)")
    parser.add_argument("--checkpoint-every", type=int, default=500)
    parser.add_argument("--slow-steps", type=int, default=150, help="steps with a 1.3x rank")
    parser.add_argument("--hangs", type=int, default=16, help="hangs after the slow steps")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    parser.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_main:
        rank_main()
        return 0
    report = run(args)
    print(file=sys.stderr)
    print(table(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    ok = report["false_kills"] == report["missed_hangs"] == report["false_straggler_flags"] == 0
    return 0 if ok and report["slow_rank_flagged_after_steps"] is not None else 1


if __name__ == "__main__":
    sys.exit(main())
