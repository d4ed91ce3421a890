"""Stragglers named on a real 4-rank group: events, `watchdogctl stragglers`, metrics."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import anyio
import pytest
from prometheus_client import generate_latest

import watchdogd_client as wd
from watchdogd.core.job_stragglers import NodeSummary, RankSummary
from watchdogd.daemon import Daemon
from watchdogd_client.groups import GroupSpec, GroupState

from ..conftest import REPO, running_daemon, wait_for

pytestmark = pytest.mark.anyio

# Each rank releases 20 "compute" scopes; the rank named in argv[1] (if any) really
# computes 1.5x as long as its peers.
RANKS = textwrap.dedent(
    """
    import os, sys, time
    import watchdogd_client as wd
    slow = len(sys.argv) > 1 and os.environ["RANK"] == sys.argv[1]
    hold = 0.05 * (1.5 if slow else 1)
    for _ in range(20):
        with wd.expires(after=30, scope="compute"):
            time.sleep(hold)
    wd.get_client().sync()
    """
)
# Every rank's host time is the same, but rank 2's GPU takes 1.5x as long: a stand-in
# for torch.cuda's events whose elapsed time we set, and which complete only once they
# were looked at (so a pair is reported by a later release, never waited for).
DEVICE_TIMED = textwrap.dedent(
    """
    import os, sys, time, types
    factor = 1.5 if os.environ["RANK"] == "2" else 1.0

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing
            self.polls = 0
        def record(self):
            self.at = time.monotonic()
        def query(self):
            self.polls += 1
            return self.polls > 1
        def elapsed_time(self, end):
            assert end.polls > 1, "asked before the end event completed"
            return (end.at - self.at) * 1000 * factor
        def synchronize(self):
            raise AssertionError("a host sync on the hot path")

    def synchronize():
        raise AssertionError("a host sync on the hot path")

    torch = types.ModuleType("torch")
    torch.cuda = types.SimpleNamespace(
        is_available=lambda: True, Event=Event, synchronize=synchronize
    )
    sys.modules["torch"] = torch
    import watchdogd_client as wd
    from watchdogd_client import _device_time
    for _ in range(21):
        with wd.expires(after=30, scope="compute", device_time=True):
            time.sleep(0.05)
    assert len(_device_time._pending) == 1  # the last pair: not complete yet
    plain = wd.expires(after=30, scope="other")
    assert type(plain) is wd.expires
    wd.get_client().sync()
    """
)
# Windows of 5 releases: 4 per rank; two in a row under 0.85 flag a rank.
SETTINGS = {"straggler_window": 5, "straggler_windows": 2, "stack_dumps": "off"}


async def run_group(daemon: Daemon, *argv: str, code: str = RANKS) -> None:
    entrypoint = [sys.executable, "-c", code, *argv]
    daemon.supervisor.submit(GroupSpec(name="train", entrypoint=entrypoint, nproc=4))
    runner = daemon.supervisor.get("train")
    await wait_for(lambda: runner.state is GroupState.SUCCEEDED, 30)


async def ctl(daemon: Daemon, *args: str) -> str:
    command = [sys.executable, "-m", "watchdogd.cli.ctl", "--socket", str(daemon.socket_path)]
    done = await anyio.to_thread.run_sync(
        lambda: subprocess.run(
            [*command, *args], cwd=REPO, capture_output=True, text=True, check=True
        )
    )
    return done.stdout


async def test_a_rank_that_computes_slower_is_flagged_and_shown(short_dir: Path) -> None:
    async with running_daemon(short_dir, **SETTINGS) as daemon:
        await run_group(daemon, "2")
        listing = json.loads(await ctl(daemon, "stragglers", "--json"))
        table = await ctl(daemon, "stragglers")
        groups = await ctl(daemon, "groups")
        metrics = generate_latest(daemon.metrics.registry).decode()
        events = [e for e in daemon.events.since() if e.name.startswith("straggler")]
    (flag,) = events
    assert flag.name == "straggler"
    meta = flag.metadata
    assert (meta["group"], meta["scope"], meta["rank"], meta["clock"]) == (
        "train",
        "compute",
        2,
        "host",
    )
    assert isinstance(meta["relative"], float) and meta["relative"] < 0.85
    assert meta["windows"] == 2 and meta["hostname"]
    ranks = {s["rank"]: s for s in listing["stragglers"]}
    assert sorted(ranks) == [0, 1, 2, 3] and listing["window"] == 5
    assert [r for r, s in ranks.items() if s["flagged"]] == [2]
    assert ranks[2]["windows"] == 8 and 0.5 < ranks[2]["relative"] < 0.85
    assert ranks[2]["p50_s"] > ranks[0]["p50_s"]
    (row,) = [line for line in table.splitlines() if "STRAGGLER" in line]
    assert row.split()[:3] == ["train", "compute", "2"]
    assert "STRAGGLERS" in groups and groups.splitlines()[-1].split()[-1] == "2"
    series = 'watchdogd_stragglers{group="train",injected="false",rank="2",scope="compute"} 1.0'
    assert series in metrics
    assert 'watchdogd_straggler_flags_total{injected="false"} 1.0' in metrics


async def test_job_listing_adds_what_other_nodes_published(short_dir: Path) -> None:
    # What a rendezvous hands the StragglerShare port: node 1 ran ranks 4 and 5, slower.
    other = NodeSummary(
        hostname="gpu-b",
        node_rank=1,
        seq=3,
        ranks=[
            RankSummary("compute", 4, 0.1, 0.5, 1.0, 6, False, True),
            RankSummary("compute", 5, 0.05, 1.0, 1.0, 6, False, False),
        ],
    )
    async with running_daemon(short_dir, **SETTINGS) as daemon:
        await run_group(daemon)
        # Its run over: its publisher, which tells "no other node" as it ends, is gone.
        await daemon.supervisor.get("train").finished.wait()
        daemon.scopes.stragglers.received("train", {"node-b": other})
        local = json.loads(await ctl(daemon, "stragglers", "--json"))["stragglers"]
        job = json.loads(await ctl(daemon, "stragglers", "--job", "--json"))["stragglers"]
        table = await ctl(daemon, "stragglers", "--job")
        events = [e for e in daemon.events.since() if e.name.startswith("straggler")]
    assert sorted(s["rank"] for s in local) == [0, 1, 2, 3]
    ranks = {s["rank"]: s for s in job}
    assert sorted(ranks) == [0, 1, 2, 3, 4, 5]
    assert (ranks[4]["hostname"], ranks[4]["node_rank"], ranks[4]["uid"]) == ("gpu-b", 1, -1)
    assert ranks[4]["flagged"] and not ranks[4]["stale"]
    # Rescored against the job's fastest median, here or there.
    fastest = min(s["p50_s"] for s in job)
    assert abs(ranks[4]["relative"] - fastest / 0.1) < 1e-9
    assert all(s["uid"] >= 0 for r, s in ranks.items() if r < 4)
    (row,) = [line.split() for line in table.splitlines() if "STRAGGLER" in line.split()]
    assert row[:5] == ["train", "compute", "4", "1", "gpu-b"]
    assert events == []  # node 1 flagged rank 4: its event is node 1's to raise


async def test_uniform_ranks_get_no_flag(short_dir: Path) -> None:
    async with running_daemon(short_dir, **SETTINGS) as daemon:
        await run_group(daemon)
        listing = json.loads(await ctl(daemon, "stragglers", "--json"))
        events = [e for e in daemon.events.since() if e.name.startswith("straggler")]
    assert events == []
    ranks = {s["rank"]: s for s in listing["stragglers"]}
    assert sorted(ranks) == [0, 1, 2, 3]
    assert not any(s["flagged"] for s in ranks.values())
    assert all(
        s["windows"] == 8 for s in ranks.values()
    )  # 20 releases, scored every 2 from the 5th


async def test_device_time_scores_a_gpu_straggler_that_host_time_cannot_see(
    short_dir: Path,
) -> None:
    async with running_daemon(short_dir, **SETTINGS) as daemon:
        await run_group(daemon, code=DEVICE_TIMED)
        listing = json.loads(await ctl(daemon, "stragglers", "--json"))
        scopes = json.loads(await ctl(daemon, "scopes", "--json"))
        events = [e for e in daemon.events.since() if e.name.startswith("straggler")]
    (flag,) = events
    assert (flag.metadata["rank"], flag.metadata["clock"]) == (2, "device")
    ranks = {s["rank"]: s for s in listing["stragglers"]}
    # 20 pairs reported (the last was still pending): scored 8 times each, every 2 from the 5th.
    assert all(s["device"] and s["windows"] == 8 for s in ranks.values())
    assert [r for r, s in ranks.items() if s["flagged"]] == [2]
    # The sketches keep the host time, alike on every rank.
    host = [s["p50_s"] for s in scopes["scopes"] if s["scope"] == "compute"]
    assert len(host) == 4 and max(host) < 1.3 * min(host)


def test_without_torch_device_time_is_a_plain_timer() -> None:
    code = textwrap.dedent(
        """
        import sys
        import watchdogd_client as wd
        assert "torch" not in sys.modules
        timer = wd.expires(after=30, scope="s", device_time=True)
        assert type(timer) is wd.expires, type(timer)
        """
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=REPO)


def test_device_time_needs_the_socket_client(tmp_path: Path) -> None:
    code = textwrap.dedent(
        """
        import os, sys, types
        torch = types.ModuleType("torch")
        torch.cuda = types.SimpleNamespace(is_available=lambda: True, Event=None)
        sys.modules["torch"] = torch
        import watchdogd_client as wd
        fifo = wd.FileTimerClient(sys.argv[1])
        try:
            with wd.expires(after=30, scope="s", client=fifo, device_time=True):
                raise AssertionError("armed")
        except wd.NotConfiguredError as e:
            assert "SocketTimerClient" in str(e), e
        """
    )
    fifo = tmp_path / "timer.fifo"
    os.mkfifo(fifo)
    subprocess.run([sys.executable, "-c", code, str(fifo)], check=True, cwd=REPO)


async def test_a_device_time_that_is_no_duration_is_refused(short_dir: Path) -> None:
    def report(path: Path) -> None:
        with wd.SocketTimerClient(path) as client:
            client.device_time("compute", float("nan"))
            client.sync()

    async with running_daemon(short_dir) as daemon:
        with pytest.raises(wd.RequestError, match="finite") as caught:
            await anyio.to_thread.run_sync(report, daemon.socket_path)
    assert caught.value.code == "bad_request"
