"""The daemon's own CPU per timer request, without clients or the kernel in the way.

Runs a daemon in this process, then feeds its socket front pre-encoded
acquire/release frames and its FIFO front torch-format lines, in a loop, and
reports microseconds per request. Where ``bench_timers.py`` measures the
whole path (writers, kernel, daemon sharing the machine), this isolates the
daemon's share of it::

    python bench/bench_daemon_cpu.py [--rounds 2000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from functools import partial

import anyio
import msgspec

from watchdogd.core.config import Config
from watchdogd.daemon import Daemon
from watchdogd.service.session import Peer, Session
from watchdogd_client import protocol as p

SCOPES = 50


async def measure(rounds: int, runtime: str, target: subprocess.Popen[bytes]) -> dict[str, float]:
    daemon = Daemon(Config(runtime_dir=runtime, stack_dumps="off", log_level="warning"))
    stop = anyio.Event()
    async with anyio.create_task_group() as tg:
        await tg.start(partial(daemon.serve, shutdown_trigger=stop.wait))
        session = Session(daemon.socket_front.ports, Peer(target.pid, 0, True, None))
        session.greeted = True
        encode = msgspec.msgpack.encode
        expiration = time.time() + 3600
        frames = [
            frame
            for i in range(SCOPES)
            for frame in (
                encode(p.Acquire(f"s{i}", expiration, 9, target.pid)),
                encode(p.Release(f"s{i}", target.pid)),
            )
        ]
        lines = [
            line
            for i in range(SCOPES)
            for line in (
                json.dumps(
                    {"version": 1, "pid": target.pid, "scope_id": f"f{i}",
                     "expiration_time": expiration, "signal": 9}
                ).encode(),
                json.dumps(
                    {"version": 1, "pid": target.pid, "scope_id": f"f{i}",
                     "expiration_time": -1, "signal": 0}
                ).encode(),
            )
        ]  # fmt: skip
        results = {}
        for name, feed, items in (
            ("socket", session._handle_frame, frames),
            ("fifo", daemon.fifo_front._line, lines),
        ):
            started = time.perf_counter()
            for _ in range(rounds):
                for item in items:
                    feed(item)
            results[name] = (time.perf_counter() - started) / (rounds * len(items)) * 1e6
        stop.set()
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2000, help="passes over 100 requests")
    args = parser.parse_args()
    target = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        with tempfile.TemporaryDirectory(prefix="wd-cpu-") as runtime:
            results = anyio.run(
                measure,
                args.rounds,
                runtime,
                target,
                backend="asyncio",
                backend_options={"use_uvloop": True},
            )
    finally:
        target.kill()
        target.wait()
    for name, micros in results.items():
        print(f"{name:7} {micros:6.2f} µs of daemon CPU per request (acquire/release pairs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
