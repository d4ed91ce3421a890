"""Seeing what happened: stack dumps of hung processes, escalation, live events."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

import watchdogd_client as wd

from ..conftest import python, wait_until
from .test_cli import ctl, serve

HUNG_TRAINER = """
import signal, sys, time, watchdogd_client as wd
transport = sys.argv[1]
if transport == "socket":
    client = wd.SocketTimerClient(sys.argv[2])
else:
    client = wd.FileTimerClient(sys.argv[2])

def all_reduce_that_never_returns():
    while True:
        time.sleep(0.01)

with wd.expires(after=0.3, scope="allreduce", client=client):
    all_reduce_that_never_returns()
"""


def test_hung_process_leaves_a_faulthandler_dump_naming_where_it_hung(short_dir: Path) -> None:
    sock = short_dir / "watchdogd.sock"
    with serve(short_dir):
        trainer = python(HUNG_TRAINER, "socket", str(sock))
        assert trainer.wait(30) == -signal.SIGKILL
        (dump,) = json.loads(ctl(sock, "dumps", "--json").stdout)
        assert (dump["pid"], dump["scope_id"], dump["method"]) == (
            trainer.pid,
            "allreduce",
            "faulthandler",
        )
        text = ctl(sock, "dump", dump["id"]).stdout
        assert "all_reduce_that_never_returns" in text
        assert "allreduce" in ctl(sock, "dumps").stdout
        (expired,) = [
            json.loads(line)
            for line in ctl(sock, "events", "--json").stdout.splitlines()
            if '"timer_expired"' in line
        ]
        assert expired["metadata"]["dump"] == dump["id"]
        assert ctl(sock, "dump", "12345-1").returncode == 1


def test_py_spy_dumps_a_process_that_registered_nothing(short_dir: Path) -> None:
    pyspy = subprocess.run(["py-spy", "--version"], capture_output=True)
    if pyspy.returncode != 0:
        pytest.skip("py-spy is not installed")
    sock = short_dir / "watchdogd.sock"
    with serve(short_dir):
        trainer = python(HUNG_TRAINER, "fifo", str(short_dir / "timer.fifo"))
        assert trainer.wait(30) == -signal.SIGKILL
        dumps = json.loads(ctl(sock, "dumps", "--json").stdout)
        if not dumps:
            pytest.skip("py-spy could not attach here (no ptrace permission)")
        (dump,) = dumps
        assert dump["method"] == "py-spy"
        assert "all_reduce_that_never_returns" in ctl(sock, "dump", dump["id"]).stdout


def test_sigkill_follows_a_signal_the_process_ignored(short_dir: Path) -> None:
    config = short_dir / "watchdogd.toml"
    config.write_text("kill_grace = 0.5\nstack_dumps = 'off'\n")
    sock = short_dir / "watchdogd.sock"
    with serve(short_dir, "--config", str(config)):
        stubborn = python(
            f"""
            import signal, time, watchdogd_client as wd
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            client = wd.SocketTimerClient({str(sock)!r}, signal=signal.SIGTERM)
            with wd.expires(after=0.2, client=client):
                time.sleep(600)
            """
        )
        started = time.monotonic()
        assert stubborn.wait(30) == -signal.SIGKILL
        assert time.monotonic() - started >= 0.5
        names = [
            json.loads(line)["name"] for line in ctl(sock, "events", "--json").stdout.splitlines()
        ]
        assert "process_escalated" in names
        assert wd.status(str(sock)).signalled == 1


def test_events_follow_sees_an_expiry_as_it_happens(short_dir: Path) -> None:
    sock = short_dir / "watchdogd.sock"
    with serve(short_dir):
        follower = subprocess.Popen(
            ["watchdogctl", "--socket", str(sock), "events", "--follow", "--json"],
            stdout=subprocess.PIPE,
            text=True,
        )
        with follower:
            try:
                assert follower.stdout is not None
                assert json.loads(follower.stdout.readline())["name"] == "daemon_started"
                trainer = python(
                    f"""
                    import time, watchdogd_client as wd
                    with wd.expires(after=0.2, client=wd.SocketTimerClient({str(sock)!r})):
                        time.sleep(600)
                    """
                )
                assert trainer.wait(30) == -signal.SIGKILL
                for line in follower.stdout:
                    event = json.loads(line)
                    if event["name"] == "timer_expired":
                        break
                assert event["metadata"]["pid"] == trainer.pid
                assert event["metadata"]["action"] == "signalled"
            finally:
                follower.kill()


def test_a_slow_follower_loses_events_not_the_daemon(short_dir: Path) -> None:
    sock = short_dir / "watchdogd.sock"
    config = short_dir / "watchdogd.toml"
    # Every refusal an event (no rate limit): a flood of them for the follower to miss.
    config.write_text("log_level = 'warning'\n[limits]\nmax_noisy_events_per_s = 1000000\n")
    with serve(short_dir, "--config", str(config)):
        client = wd.SocketTimerClient(sock, name="slow-follower")
        batches = client.events(follow=True)
        next(batches)  # subscribed; now read nothing while events pile up
        flood = python(
            f"""
            import time, watchdogd_client as wd
            c = wd.SocketTimerClient({str(sock)!r})
            for i in range(3001):
                try:
                    if i < 3000:
                        c.acquire_for(1, f"x{{i}}", time.time() + 60, 9)  # refused: an event
                    else:
                        c.sync()
                except wd.RequestError:
                    pass
            """
        )
        assert flood.wait(60) == 0
        status = wd.status(str(sock))
        assert status.refused == 3000
        dropped = 0
        seen = 0
        while seen + dropped < 3000:
            batch = next(batches)
            dropped += batch.dropped
            seen += sum(1 for e in batch.events if e.name == "request_refused")
        assert dropped > 0
        client.close()
        # The follower's connection goes as soon as it closes (the query is the one left).
        wait_until(lambda: wd.status(str(sock)).connections == 1)
