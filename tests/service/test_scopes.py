"""`watchdogctl scopes`: each named scope's durations, per job and rank, over a real socket."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest

import watchdogd_client as wd
from watchdogd.core.config import Limits
from watchdogd_client.groups import GroupSpec, GroupState

from ..conftest import REPO, running_daemon, wait_for

pytestmark = pytest.mark.anyio

# Rank 1 computes three times as long as rank 0; both release 10 "compute" scopes.
UNEVEN_RANKS = textwrap.dedent(
    """
    import os, time
    import watchdogd_client as wd
    hold = 0.02 * (3 if os.environ["RANK"] == "1" else 1)
    for _ in range(10):
        with wd.expires(after=30, scope="compute"):
            time.sleep(hold)
    wd.get_client().sync()
    """
)

# Outside any group: one scope used 5 times, then 300 distinct names, then it waits.
MANY_NAMES = textwrap.dedent(
    """
    import sys, time
    import watchdogd_client as wd
    client = wd.SocketTimerClient(sys.argv[1])
    for _ in range(5):
        with wd.expires(after=30, scope="step", client=client):
            time.sleep(0.01)
    for index in range(300):
        with wd.expires(after=30, scope=f"name-{index}", client=client):
            pass
    client.sync()
    print("ready", flush=True)
    time.sleep(600)
    """
)


async def test_a_groups_ranks_have_their_own_durations_per_scope(short_dir: Path) -> None:
    spec = GroupSpec(name="train", entrypoint=[sys.executable, "-c", UNEVEN_RANKS], nproc=2)
    async with running_daemon(short_dir, groups=[spec]) as daemon:
        runner = daemon.supervisor.get("train")
        await wait_for(lambda: runner.state is GroupState.SUCCEEDED, 30)
        client = wd.SocketTimerClient(daemon.socket_path)
        try:
            listing = await anyio.to_thread.run_sync(client.scopes)
        finally:
            client.close()
    compute = {s.rank: s for s in listing.scopes if (s.job, s.scope) == ("train", "compute")}
    assert sorted(compute) == [0, 1]
    assert compute[0].count == compute[1].count == 10
    assert 0.018 <= compute[0].p50_s < compute[1].p50_s
    assert compute[1].p50_s > 2 * compute[0].p50_s  # the slow rank shows
    # A quantile is its bucket's midpoint: within 2 % of the samples in it, the maximum too.
    assert compute[1].max_s * 1.02 >= compute[1].p99_s >= compute[1].p50_s
    assert listing.refused == 0


async def test_the_cap_refuses_new_names_and_a_process_that_exits_takes_its_own(
    short_dir: Path,
) -> None:
    limits = Limits(max_scope_stats_per_uid=50)
    async with running_daemon(short_dir, limits=limits) as daemon:
        socket_path = str(daemon.socket_path)
        child = await anyio.open_process([sys.executable, "-c", MANY_NAMES, socket_path])
        try:
            assert child.stdout is not None
            with anyio.fail_after(30):
                assert b"ready" in await child.stdout.receive()
            command = [sys.executable, "-m", "watchdogd.cli.ctl", "--socket", socket_path]
            shown = await anyio.to_thread.run_sync(
                lambda: subprocess.run(
                    [*command, "scopes", "--json"], cwd=REPO, capture_output=True, check=True
                )
            )
            table = await anyio.to_thread.run_sync(
                lambda: subprocess.run(
                    [*command, "scopes"], cwd=REPO, capture_output=True, text=True, check=True
                )
            )
        finally:
            child.kill()
            await child.wait()
        await wait_for(lambda: len(daemon.scopes.scope_stats) == 0)  # its pid's sketches went
    listing = json.loads(shown.stdout)
    mine = [s for s in listing["scopes"] if s["rank"] == child.pid]
    assert len(mine) == 50  # the cap, not 301
    assert listing["refused"] == 301 - 50
    (step,) = [s for s in mine if s["scope"] == "step"]
    assert step["count"] == 5 and step["job"] == ""
    assert "251 samples refused" in table.stdout
    assert "step" in table.stdout and "P99 (ms)" in table.stdout
