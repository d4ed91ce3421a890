"""The daemon's own log output: a console nobody reads holds up no kill and no exit."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import watchdogd_client as wd

from ..conftest import wait_until
from ..hostile import sleepers

# `watchdogd serve`'s log line: "2025-01-31 12:00:00,123 watchdogd INFO …".
LOG_LINE = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} watchdogd (DEBUG|INFO|WARNING|ERROR) ")
FLOOD = 20_000  # bad FIFO lines, one log record each: far more than the pipe and the queue hold
VICTIMS = 20
# Generous for a loaded machine: a loop held by its log output would not fire them at all.
MAX_LATE_MS = 200


def test_a_log_pipe_nobody_reads_holds_up_no_kill_and_no_exit(short_dir: Path) -> None:
    sock, fifo, event_log = (
        short_dir / name for name in ("watchdogd.sock", "timer.fifo", "events.jsonl")
    )
    config = short_dir / "watchdogd.toml"
    config.write_text('stack_dumps = "off"\n')  # lateness here is the loop's, not a capture's
    serve = [sys.executable, "-m", "watchdogd.cli.main", "serve", "--config", str(config)]
    daemon = subprocess.Popen(
        [
            *serve,
            "--runtime-dir",
            str(short_dir),
            "--event-log",
            str(event_log),
            "--log-level",
            "debug",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,  # never read until the daemon has exited
        pipesize=4096,
        text=True,
    )
    assert daemon.stdout is not None and daemon.stderr is not None
    try:
        assert "serving" in daemon.stdout.readline()
        fd = os.open(fifo, os.O_WRONLY)
        try:
            data = b"this is not a timer request\n" * FLOOD
            while data:
                data = data[os.write(fd, data) :]
        finally:
            os.close(fd)
        wait_until(lambda: wd.status(str(sock)).bad_input == FLOOD, timeout=30)

        with sleepers(*[None] * VICTIMS) as victims:
            start = time.time() + 0.3
            with wd.SocketTimerClient(sock, stack_signal=None) as client:
                for i, victim in enumerate(victims):
                    client.acquire_for(victim.pid, f"hang-{i}", start + i * 0.02, signal.SIGKILL)
                client.sync()
            assert [victim.wait(10) for victim in victims] == [-signal.SIGKILL] * VICTIMS
            pids = {victim.pid for victim in victims}

        def kills() -> list[dict[str, object]]:
            with open(event_log) as f:
                lines = [json.loads(line) for line in f]
            return [
                e["metadata"]
                for e in lines
                if e["name"] == "timer_expired" and e["metadata"]["pid"] in pids
            ]

        wait_until(lambda: len(kills()) == VICTIMS)
        late = [kill["late_ms"] for kill in kills()]
        assert all(isinstance(ms, float) and ms < MAX_LATE_MS for ms in late), late

        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(20) == 0  # the stuck writer does not hold up the exit either
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()
    output = daemon.stderr.read()
    daemon.stdout.close()
    daemon.stderr.close()
    lines = output.splitlines()
    assert lines, "the daemon logged nothing"
    assert all(LOG_LINE.match(line) for line in lines), lines[:5]
