"""Arms and releases without a request: the socket client writes them in shared memory.

Real trainers in child processes against an in-process daemon: what the
daemon does when a slot-released timer's deadline comes, when its scope is
armed again (by a request or by a store arm, to a later or an earlier
deadline), when the connection closes, when the daemon restarts and when
the process exits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from functools import partial
from pathlib import Path

import anyio
import pytest

import watchdogd_client as wd
from watchdogd.core.config import Limits
from watchdogd.core.scope_stats import DurationSketch
from watchdogd.daemon import Daemon
from watchdogd.linux.release_slots import SLOTS
from watchdogd_client import protocol as p
from watchdogd_client.groups import GroupSpec

from ..conftest import exit_code, python, running_daemon, wait_for

pytestmark = pytest.mark.anyio

# Five short timers released well before their deadlines, then a wait past them all.
RELEASED_EARLY = """
    import sys, time
    import watchdogd_client as wd
    c = wd.SocketTimerClient(sys.argv[1])
    for _ in range(5):
        with wd.expires(after=0.3, scope="step", client=c):
            time.sleep(0.02)
    c.sync()
    print(c.welcome.slot_page, flush=True)
    time.sleep(0.6)
    print("alive", flush=True)
    sys.stdin.readline()
"""


@contextlib.asynccontextmanager
async def trainer_running(code: str, *args: str) -> AsyncIterator[subprocess.Popen[str]]:
    """A trainer, forked off the loop the daemon runs on; killed (if need be) and reaped."""
    proc = await anyio.to_thread.run_sync(
        partial(python, code, *args, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    )
    with proc:
        try:
            yield proc
        finally:
            proc.kill()


async def line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    return await anyio.to_thread.run_sync(proc.stdout.readline)


def step_sketch(daemon: Daemon) -> DurationSketch:
    """The statistics of the trainer's "step" scope (there is one trainer)."""
    (sketch,) = [s for k, s in daemon.timers.scope_stats.sketches.items() if k.scope == "step"]
    return sketch


async def test_a_timer_released_by_its_slot_is_not_killed_and_its_time_is_recorded(
    short_dir: Path,
) -> None:
    async with (
        running_daemon(short_dir) as daemon,
        trainer_running(RELEASED_EARLY, str(daemon.socket_path)) as trainer,
    ):
        assert await line(trainer) == f"{SLOTS}\n"
        assert await line(trainer) == "alive\n"  # every deadline passed meanwhile
        assert trainer.poll() is None
        assert daemon.stats.requests["socket.release"] == 0  # no release was sent
        assert daemon.stats.requests["socket.acquire"] == 5
        daemon.timers.follow_slots(None)
        sketch = step_sketch(daemon)
        assert sketch.count == 5
        assert 0.015 <= sketch.quantile(0.5) < 0.15  # held ~20 ms, not until the deadline
        assert len(daemon.timers.table) == 0
        assert daemon.stats.expired == 0


async def test_store_arms_send_nothing_and_a_hang_among_them_is_killed(short_dir: Path) -> None:
    code = """
        import sys, time
        import watchdogd_client as wd
        c = wd.SocketTimerClient(sys.argv[1])
        for _ in range(200):
            with wd.expires(after=1.5, scope="step", client=c):
                time.sleep(0.005)
        c.sync()
        print("steps done", flush=True)
        with wd.expires(after=1.5, scope="step", client=c):
            time.sleep(60)  # hung
    """
    async with (
        running_daemon(short_dir) as daemon,
        trainer_running(code, str(daemon.socket_path)) as trainer,
    ):
        assert await line(trainer) == "steps done\n"
        started = time.monotonic()
        assert daemon.stats.requests["socket.acquire"] < 5  # the first, not 200
        daemon.timers.follow_slots(None)  # a query's look: the held ring read
        sketch = step_sketch(daemon)
        assert sketch.count == 200  # every block's held time, from the held ring
        assert 0.004 <= sketch.quantile(0.5) < 0.1
        assert await exit_code(trainer) == -signal.SIGKILL
        assert 1.0 <= time.monotonic() - started < 6
        assert daemon.stats.expired == 1


async def test_the_last_releases_before_an_exit_are_in_the_statistics(short_dir: Path) -> None:
    # Microseconds apart: the client writes them into the held ring at exit, not at a look.
    code = """
        import sys
        import watchdogd_client as wd
        c = wd.SocketTimerClient(sys.argv[1])
        for _ in range(50):
            with wd.expires(after=30, scope="step", client=c):
                pass
        assert c._unwritten  # still to be written: the exit writes them
    """

    def released_steps() -> int:
        return sum(
            timer.scope_id == "step" and outcome == "released"
            for timer, _, outcome, _ in daemon.timers.timeline.ended
        )

    async with (
        running_daemon(short_dir) as daemon,
        trainer_running(code, str(daemon.socket_path)) as trainer,
    ):
        assert await exit_code(trainer) == 0
        await wait_for(lambda: not daemon.timers.processes)  # its exit, handled
        assert released_steps() == 50
        assert daemon.stats.held_lost == 0


async def test_releases_beyond_the_held_ring_are_counted_lost_not_misread(
    short_dir: Path,
) -> None:
    code = """
        import sys
        import watchdogd_client as wd
        c = wd.SocketTimerClient(sys.argv[1])
        for _ in range(5000):  # milliseconds: far more than a sweep's ring of releases
            with wd.expires(after=30, scope="step", client=c):
                pass
        c.sync()
        print("done", flush=True)
        sys.stdin.readline()
    """
    async with (
        running_daemon(short_dir) as daemon,
        trainer_running(code, str(daemon.socket_path)) as trainer,
    ):
        assert await line(trainer) == "done\n"
        daemon.timers.follow_slots(None)
        sketch = step_sketch(daemon)
        assert daemon.stats.held_lost > 0
        assert sketch.count + daemon.stats.held_lost == 5000
        assert sketch.quantile(0.99) < 0.01  # no entry read torn (or as another's)
        client = wd.SocketTimerClient(daemon.socket_path)
        status = await anyio.to_thread.run_sync(client.status)
        client.close()
        assert status.held_lost == daemon.stats.held_lost


async def test_a_flood_of_slot_releases_never_holds_the_loop(short_dir: Path) -> None:
    # 32 connections' held rings full at once: read in chunks (running_daemon fails
    # the test if the loop stalls for more than 50 ms).
    code = """
        import sys
        import watchdogd_client as wd
        clients = [wd.SocketTimerClient(sys.argv[1]) for _ in range(32)]
        for c in clients:
            for _ in range(1024):
                with wd.expires(after=30, scope="step", client=c):
                    pass
            c._write_held()  # all of them, now
        print("flooded", flush=True)
        sys.stdin.readline()
    """
    async with (
        running_daemon(short_dir) as daemon,
        trainer_running(code, str(daemon.socket_path)) as trainer,
    ):
        assert await line(trainer) == "flooded\n"
        sketches = daemon.timers.scope_stats.sketches
        await wait_for(
            lambda: sum(s.count for s in sketches.values()) + daemon.stats.held_lost >= 32 * 1024
        )
        assert step_sketch(daemon).count > 16 * 1024


async def test_a_store_arm_to_an_earlier_deadline_is_killed_at_it(short_dir: Path) -> None:
    code = """
        import sys, time
        import watchdogd_client as wd
        c = wd.SocketTimerClient(sys.argv[1])
        c.acquire("step", time.time() + 60)
        c.sync()
        c.acquire("step", time.time() + 1.5)  # ahead enough: written, not sent
        time.sleep(60)  # hung
    """
    async with (
        running_daemon(short_dir) as daemon,
        trainer_running(code, str(daemon.socket_path)) as trainer,
    ):
        started = time.monotonic()
        assert await exit_code(trainer) == -signal.SIGKILL
        assert time.monotonic() - started < 8  # not the 60 s one
        assert daemon.stats.requests["socket.acquire"] == 1


async def test_a_store_arm_to_a_later_deadline_outlives_the_one_before(short_dir: Path) -> None:
    code = """
        import sys, time
        import watchdogd_client as wd
        c = wd.SocketTimerClient(sys.argv[1])
        first = time.time() + 1
        c.acquire("step", first)
        c.sync()
        # Just before it: most likely only the look at the deadline itself sees the next.
        time.sleep(max(0.0, first - time.time() - 0.05))
        c.acquire("step", time.time() + 2)
        time.sleep(1.5)
        print("alive", flush=True)
        time.sleep(60)  # hung
    """
    async with (
        running_daemon(short_dir) as daemon,
        trainer_running(code, str(daemon.socket_path)) as trainer,
    ):
        assert await line(trainer) == "alive\n"  # past the first deadline
        assert await exit_code(trainer) == -signal.SIGKILL
        assert daemon.stats.requests["socket.acquire"] == 1
        assert daemon.stats.expired == 1


async def test_a_store_arm_outlives_its_connection(short_dir: Path) -> None:
    # The page is read no more: the daemon adopts what it says and keeps a plain timer.
    code = """
        import sys, time
        import watchdogd_client as wd
        c = wd.SocketTimerClient(sys.argv[1])
        c.acquire("step", time.time() + 60)
        c.sync()
        c.acquire("step", time.time() + 1.5)
        c.close()
        time.sleep(60)  # hung
    """
    async with (
        running_daemon(short_dir) as daemon,
        trainer_running(code, str(daemon.socket_path)) as trainer,
    ):
        started = time.monotonic()
        assert await exit_code(trainer) == -signal.SIGKILL
        assert time.monotonic() - started < 8
        assert daemon.stats.requests["socket.acquire"] == 1


async def test_a_restarted_daemon_restores_a_store_arm(short_dir: Path) -> None:
    code = f"""
        import sys, time
        import watchdogd_client as wd
        c = wd.SocketTimerClient({str(short_dir / "watchdogd.sock")!r})
        c.acquire("step", time.time() + 60)
        c.sync()
        c.acquire("step", time.time() + 4)  # room for a restart on a busy machine
        print("armed", flush=True)
        time.sleep(60)  # hung
    """
    async with trainer_running(code) as trainer:
        async with running_daemon(short_dir):
            assert await line(trainer) == "armed\n"
        started = time.monotonic()
        async with running_daemon(short_dir) as daemon:
            (timer,) = daemon.timers.table
            assert timer.deadline - time.monotonic() < 5  # the store arm's, from the snapshot
            assert await exit_code(trainer) == -signal.SIGKILL
            assert time.monotonic() - started < 10


async def test_a_scope_armed_again_after_a_slot_release_still_expires(short_dir: Path) -> None:
    code = """
        import sys, time
        import watchdogd_client as wd
        c = wd.SocketTimerClient(sys.argv[1])
        for _ in range(3):
            with wd.expires(after=0.3, scope="step", client=c):
                pass
        with wd.expires(after=0.3, scope="step", client=c):
            time.sleep(60)  # hung
    """
    async with (
        running_daemon(short_dir) as daemon,
        trainer_running(code, str(daemon.socket_path)) as trainer,
    ):
        started = time.monotonic()
        assert await exit_code(trainer) == -signal.SIGKILL
        assert time.monotonic() - started < 5
        assert daemon.stats.expired == 1


async def test_the_same_deadline_armed_again_after_its_release_still_expires(
    short_dir: Path,
) -> None:
    # The slot says the first arm is released; the second, at the same deadline, is not.
    code = """
        import sys, time
        import watchdogd_client as wd
        c = wd.SocketTimerClient(sys.argv[1])
        deadline = time.time() + 0.4
        c.acquire("step", deadline)
        c.release("step")
        c.acquire("step", deadline)
        time.sleep(60)  # hung
    """
    async with (
        running_daemon(short_dir) as daemon,
        trainer_running(code, str(daemon.socket_path)) as trainer,
    ):
        assert await exit_code(trainer) == -signal.SIGKILL
        assert daemon.stats.expired == 1


async def test_a_refused_rearm_leaves_the_timer_before_it_releasable(short_dir: Path) -> None:
    # The release counts for every arm of the slot up to it, the refused one's too.
    code = """
        import math, sys, time
        import watchdogd_client as wd
        c = wd.SocketTimerClient(sys.argv[1])
        deadline = time.time() + 2
        c.acquire("step", deadline)
        c.acquire("step", math.inf)  # refused: not a finite deadline
        try:
            c.sync()
        except wd.RequestError as e:
            print(e.code, flush=True)
        c.release("step")
        time.sleep(max(0.0, deadline - time.time()) + 0.5)
        print("alive", flush=True)
        sys.stdin.readline()
    """
    async with (
        running_daemon(short_dir) as daemon,
        trainer_running(code, str(daemon.socket_path)) as trainer,
    ):
        assert await line(trainer) == "bad_request\n"
        assert await line(trainer) == "alive\n"
        assert daemon.stats.expired == 0


async def test_released_timers_waiting_to_be_looked_at_do_not_count_against_the_limit(
    short_dir: Path,
) -> None:
    code = """
        import sys, time
        import watchdogd_client as wd
        c = wd.SocketTimerClient(sys.argv[1])
        for index in range(6):
            with wd.expires(after=60, scope=f"phase-{index}", client=c):
                pass
        c.sync()
        print("ok", flush=True)
    """
    async with running_daemon(short_dir, limits=Limits(max_timers_per_pid=3)) as daemon:
        async with trainer_running(code, str(daemon.socket_path)) as trainer:
            assert await line(trainer) == "ok\n"  # no limit_exceeded at the 4th
            assert await exit_code(trainer) == 0
        assert daemon.stats.refused == 0


async def test_a_slot_release_holds_while_the_next_arm_is_still_a_request_on_its_way(
    short_dir: Path,
) -> None:
    # Released in time through the slot, then armed again with a frame (under a
    # second ahead): the daemon, busy, reaches the first deadline before the frame.
    code = """
        import sys, time
        import watchdogd_client as wd
        c = wd.SocketTimerClient(sys.argv[1])
        c.acquire("step", time.time() + 0.3)
        c.sync()
        print("armed", flush=True)
        sys.stdin.readline()
        c.release("step")
        c.acquire("step", time.time() + 0.9)
        time.sleep(0.7)
        c.release("step")
        time.sleep(1.0)
        print("alive", flush=True)
        sys.stdin.readline()
    """
    async with (
        running_daemon(short_dir, max_stall=None) as daemon,
        trainer_running(code, str(daemon.socket_path)) as trainer,
    ):
        assert await line(trainer) == "armed\n"
        assert trainer.stdin is not None
        trainer.stdin.write("\n")
        trainer.stdin.flush()
        time.sleep(0.5)  # noqa: ASYNC251 - the loop held on purpose: the first deadline passes
        assert await line(trainer) == "alive\n"
        assert daemon.stats.expired == 0


async def test_a_refused_arm_after_a_slot_release_brings_nothing_back(short_dir: Path) -> None:
    code = """
        import math, sys, time
        import watchdogd_client as wd
        c = wd.SocketTimerClient(sys.argv[1])
        deadline = time.time() + 1.5
        c.acquire("step", deadline)
        c.sync()
        c.release("step")  # in time, through the slot
        c.acquire("step", math.inf)  # refused: not finite
        try:
            c.sync()
        except wd.RequestError as e:
            print(e.code, flush=True)
        time.sleep(max(0.0, deadline - time.time()) + 0.5)
        print("alive", flush=True)
        sys.stdin.readline()
    """
    async with (
        running_daemon(short_dir) as daemon,
        trainer_running(code, str(daemon.socket_path)) as trainer,
    ):
        assert await line(trainer) == "bad_request\n"
        assert await line(trainer) == "alive\n"
        assert daemon.stats.expired == 0


async def test_an_arm_without_the_slot_stops_the_slots_store_arms(short_dir: Path) -> None:
    # A learned arm replaces a slot-armed timer: the slot says nothing of it any more,
    # so the next arm of the scope must be a request the daemon reads.
    code = """
        import sys, time
        import watchdogd_client as wd
        c = wd.SocketTimerClient(sys.argv[1])
        with wd.expires(after=60, scope="step", client=c):
            pass
        c.sync()
        c.acquire_learned("step", 60)
        c.sync()
        c.acquire("step", time.time() + 1.5)  # a request again, not a store arm
        c.sync()
        print("armed", flush=True)
        time.sleep(60)  # hung
    """
    async with (
        running_daemon(short_dir) as daemon,
        trainer_running(code, str(daemon.socket_path)) as trainer,
    ):
        assert await line(trainer) == "armed\n"
        assert daemon.stats.requests["socket.acquire"] == 3
        assert await exit_code(trainer) == -signal.SIGKILL
        assert daemon.stats.expired == 1


async def test_a_slot_release_after_the_daemon_restarted_reaches_the_new_one(
    short_dir: Path,
) -> None:
    # The old daemon marked the page closed: the release goes as a frame, which
    # finds the new daemon (it restored the timer from its snapshot).
    code = f"""
        import sys, time
        import watchdogd_client as wd
        c = wd.SocketTimerClient({str(short_dir / "watchdogd.sock")!r})
        deadline = time.time() + 4  # room for a restart on a busy machine
        c.acquire("checkpoint", deadline)
        c.sync()
        print("armed", flush=True)
        sys.stdin.readline()  # the daemon restarts meanwhile
        c.release("checkpoint")
        time.sleep(max(0.0, deadline - time.time()) + 0.5)
        print("alive", flush=True)
        sys.stdin.readline()
    """
    async with trainer_running(code) as trainer:
        assert trainer.stdin is not None
        async with running_daemon(short_dir):
            assert await line(trainer) == "armed\n"
        async with running_daemon(short_dir) as daemon:
            assert [t.scope_id for t in daemon.timers.table] == ["checkpoint"]
            trainer.stdin.write("go\n")
            trainer.stdin.flush()
            assert await line(trainer) == "alive\n"
            assert len(daemon.timers.table) == 0
            assert daemon.stats.expired == 0


async def test_a_restarted_daemon_does_not_restore_what_slots_released(short_dir: Path) -> None:
    code = f"""
        import sys, time
        import watchdogd_client as wd
        c = wd.SocketTimerClient({str(short_dir / "watchdogd.sock")!r})
        c.acquire("held", time.time() + 60)
        c.acquire("done", time.time() + 60)
        c.release("done")
        c.sync()
        print("armed", flush=True)
        sys.stdin.readline()
    """
    async with trainer_running(code) as trainer:
        async with running_daemon(short_dir) as daemon:
            assert await line(trainer) == "armed\n"
        async with running_daemon(short_dir) as daemon:
            assert [t.scope_id for t in daemon.timers.table] == ["held"]


async def test_a_process_that_exits_after_slot_releases_drops_no_timer(short_dir: Path) -> None:
    code = """
        import sys
        import watchdogd_client as wd
        c = wd.SocketTimerClient(sys.argv[1])
        for scope in ("load", "step", "save"):
            with wd.expires(after=60, scope=scope, client=c):
                pass
        c.sync()
    """
    async with (
        running_daemon(short_dir) as daemon,
        trainer_running(code, str(daemon.socket_path)) as trainer,
    ):
        assert await exit_code(trainer) == 0
        await wait_for(lambda: trainer.pid not in daemon.timers.processes)
        assert len(daemon.timers.table) == 0
        assert daemon.stats.dropped == 0  # they had ended: released, not dropped
        assert not [e for e in daemon.events.since(None, None) if e.name == "timers_dropped"]


async def test_a_release_slot_is_for_the_callers_own_timers_within_the_page(
    short_dir: Path,
) -> None:
    async with running_daemon(short_dir) as daemon:
        client = wd.SocketTimerClient(daemon.socket_path)
        deadline = time.time() + 60

        def refused(acquire: p.Acquire) -> str:
            client._send(acquire)
            with pytest.raises(wd.RequestError) as caught:
                client.sync()
            assert caught.value.code == "bad_request"
            return str(caught.value)

        try:
            await anyio.to_thread.run_sync(client.sync)
            header = p.Acquire("x", deadline, 9, release_slot=0)
            assert f"release_slot: 0 is not in 1..{SLOTS - 1}" in await anyio.to_thread.run_sync(
                refused, header
            )
            outside = p.Acquire("x", deadline, 9, release_slot=SLOTS)
            assert (
                f"release_slot: {SLOTS} is not in 1..{SLOTS - 1}"
                in await anyio.to_thread.run_sync(refused, outside)
            )
            other = p.Acquire("x", deadline, 9, pid=os.getpid(), release_slot=1)
            assert "only for the caller's own timers" in await anyio.to_thread.run_sync(
                refused, other
            )
            assert len(daemon.timers.table) == 0
        finally:
            client.close()


async def test_a_worker_with_an_idle_timeout_gets_no_slots(short_dir: Path) -> None:
    # The daemon must see at once that such a worker holds no timer.
    out = short_dir / "slots"
    code = f"""
        import watchdogd_client as wd
        client = wd.get_client()
        client.sync()
        open({str(out)!r}, "w").write(str(client.welcome.slot_page))
    """
    spec = GroupSpec(
        name="train",
        entrypoint=[sys.executable, "-c", textwrap.dedent(code)],
        nproc=1,
        idle_timeout=30,
    )
    async with running_daemon(short_dir, groups=[spec]):
        await wait_for(lambda: out.exists() and out.read_text() != "", 30)
    assert out.read_text() == "0"
