"""A toy trainer: steps wrapped in ``expires``, told to succeed, crash or hang.

    python examples/trainer.py --steps 5
    python examples/trainer.py --hang-at 3 --step-timeout 2   # killed by watchdogd

No torch needed. Under torchrun-style launchers it reads RANK/LOCAL_RANK for
its log lines; the timer client comes from the environment
(``WATCHDOGD_SOCKET``, else torch's ``TORCHELASTIC_TIMER_FILE``, else the
socket ``watchdogd serve`` listens on by default for this user).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import watchdogd_client as wd


def say(line: str) -> None:
    """One line in one write: ranks share the console, and print() under
    PYTHONUNBUFFERED (which workers get) writes the text and its newline apart."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--step-time", type=float, default=0.05, help="seconds per step")
    parser.add_argument("--step-timeout", type=float, default=10.0, help="expires(after=...)")
    parser.add_argument("--hang-at", type=int, help="hang forever inside this step")
    parser.add_argument("--crash-at", type=int, help="exit 1 at this step")
    parser.add_argument(
        "--only-attempt", type=int, help="hang or crash only in this attempt (0: the first)"
    )
    args = parser.parse_args(argv)
    rank = os.environ.get("RANK", "0")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if args.only_attempt is not None and attempt != args.only_attempt:
        args.hang_at = args.crash_at = None
    for step in range(args.steps):
        with wd.expires(after=args.step_timeout, scope="train_step"):
            if step == args.crash_at:
                say(f"rank {rank}: crashing at step {step}")
                return 1
            if step == args.hang_at:
                say(f"rank {rank}: hanging at step {step}")
                while True:
                    time.sleep(3600)
            time.sleep(args.step_time)
        say(f"rank {rank}: step {step} done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
