"""bench/bench_goodput.py's schedule and its reading of a step log (no launcher runs here)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_goodput as bench


def test_the_schedule_is_seeded_and_brings_every_kind_as_often() -> None:
    faults = bench.schedule(seed=7, every=30, duration=600)
    assert [f.at for f in faults] == [30.0 * k for k in range(1, 20)]
    assert faults == bench.schedule(seed=7, every=30, duration=600)
    assert [f.kind for f in faults] != [f.kind for f in bench.schedule(8, 30, 600)]
    counts = Counter(f.kind for f in faults[:16])
    assert counts == dict.fromkeys(bench.KINDS, 4)


def test_standby_names_the_launchers_that_get_one_and_alone_means_all() -> None:
    given = [[], ["--standby"], ["--standby", "watchdogd"], ["--standby", "watchdogd,nvrx"]]
    standby = [bench.parser().parse_args(flags).standby for flags in given]
    assert [bench.launcher_list(text) for text in standby] == [
        (),
        bench.LAUNCHERS,
        ("watchdogd",),
        ("watchdogd", "nvrx"),
    ]
    with pytest.raises(SystemExit, match=r"unknown launcher.*torchrn"):
        bench.launcher_list("watchdogd,torchrn")


def _line(ev: str, t: float, gen: float, pid: int, **fields: Any) -> dict[str, Any]:
    return {"ev": ev, "t": t, "gen": gen, "pid": pid, "rank": fields.pop("rank", 0), **fields}


def test_a_crash_loses_the_gap_in_progress_and_its_recomputed_steps(tmp_path: Path) -> None:
    """Steps every 0.1 s to step 25; a crash at 2.52; the new attempt resumes at step 20."""
    settings = bench.Settings(
        duration=60, fault_every=30, seed=1, node_return=5, slow_for=60, ttl=2,
        keep_alive=(2, 2), torch_timeout=10, mb=1, step_ms=100, nvrx_dir=tmp_path,
        standby=(), watchdogd_rdzv="c10d",
    )  # fmt: skip
    run = bench.Run("torchrun", settings, tmp_path, "127.0.0.1:1")
    lines = [_line("pg", 0.0, 1.0, 10), _line("loaded", 0.0, 1.0, 10, step=0)]
    lines += [_line("step", 0.1 * s, 1.0, 10, step=s, slow=False) for s in range(1, 26)]
    lines += [_line("start", 4.0, 0.0, 20), _line("pg", 4.5, 2.0, 20)]
    lines += [_line("loaded", 4.6, 2.0, 20, step=20)]
    lines += [
        _line("step", 4.6 + 0.1 * (s - 20), 2.0, 20, step=s, slow=False) for s in range(21, 40)
    ]
    run.lines = lines
    run.deaths = {10: 2.52}
    fault = bench.Fault(at=2.5, kind="crash", pick=0.0, done_at=2.52, target="rank 0 (pid 99)")
    result = bench.analyse(run, [fault], launched=0.0, first=0.1)
    assert abs(result["clean_step_s"] - 0.1) < 1e-6
    assert result["final_step"] == 39
    loss = result["faults"][0]
    assert loss["restarts"] == 1
    assert loss["recomputed_steps"] == 5
    # Step 26 (the first beyond 25) at 4.6 + 0.6 = 5.2: 5.2 - 2.52 - one step.
    assert abs(loss["lost_s"] - (5.2 - 2.52 - 0.1)) < 1e-6
    assert abs(loss["phases"]["checkpoint_reload"] - 0.1) < 1e-6
    assert abs(loss["phases"]["recompute"] - 0.5) < 1e-6


def test_watchdogds_agents_run_in_a_cgroup_of_their_own_ended_with_the_run() -> None:
    """Out of reach of another daemon's sweep of the cgroups beside its own."""
    with bench.agents_cgroup() as cgroup:
        if cgroup is None:
            pytest.skip("no writable cgroup v2 here")
        proc = subprocess.Popen(bench.placed(cgroup, ["sleep", "60"]))
        cmdline, deadline = Path(f"/proc/{proc.pid}/cmdline"), time.monotonic() + 5
        while cmdline.read_bytes().split(b"\0")[0] != b"sleep":  # the same pid, exec'd
            assert time.monotonic() < deadline, "the command never ran"
            time.sleep(0.01)
        assert str(proc.pid) in (cgroup / "cgroup.procs").read_text().split()
        (cgroup / "job" / "cell").mkdir(parents=True)  # a daemon's job cgroup, left over
    assert proc.wait(timeout=5) == -signal.SIGKILL
    assert not cgroup.exists()
